"""A config that says one thing twice, or expands without bound, is refused.

Each refusal is one line naming the file and, where YAML knows it, the line; it
comes quickly, however the file was built to make it slow or long.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.loading import load_config, parse_config
from gateway.model.errors import ConfigError, RealmError

SHIPPED = Path(__file__).resolve().parents[1] / "triggers.yaml"
SHIPPED_SECRETS = ("GITHUB_WEBHOOK_SECRET", "STRIPE_WEBHOOK_SECRET", "REALM_TRIGGER_TOKEN")

HEAD = """version: 1
workflows:
  w:
    steps: [go]
triggers:
"""
TRIGGER = """  t:
    workflow: w
    path: /hooks/t
    verify: {scheme: github, secret_env: GH}
    event_id: {header: X-Id}
"""
ENV = {"GH": "s3cret"}


def refusal(text: str, *, env: dict[str, str] | None = None, within: float = 2.0) -> str:
    """The one-line error for ``text``, which must come within ``within`` seconds."""
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_config(text, file="triggers.yaml", env=ENV if env is None else env)
    elapsed = time.perf_counter() - started
    message = str(info.value)
    assert elapsed < within, f"took {elapsed:.2f} s"
    assert message.startswith("triggers.yaml: ")
    assert "\n" not in message and len(message) < 400, message[:500]
    return message


# --------------------------------------------------------------------------- duplicates


def test_a_second_verify_in_a_trigger_is_refused_naming_line_and_key() -> None:
    # YAML would keep the last: GitHub verification silently turned into `none`.
    text = HEAD + TRIGGER + "    verify: {scheme: none}\n"
    assert refusal(text) == (
        "triggers.yaml: not valid YAML at line 11, column 5: duplicate key 'verify' "
        "(first at line 9); write each key once"
    )


def test_a_repeated_trigger_name_is_refused() -> None:
    text = HEAD + TRIGGER + TRIGGER.replace("/hooks/t", "/hooks/u")
    assert refusal(text) == (
        "triggers.yaml: not valid YAML at line 11, column 3: duplicate key 't' "
        "(first at line 6); write each key once"
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("version: 1\nversion: 1\nworkflows: {w: {steps: [go]}}\n", "'version'"),
        ("version: 1\nworkflows:\n  w: {steps: [go]}\n  w: {steps: [x]}\n", "'w'"),
        ("version: 1\nworkflows: {w: {steps: [go], steps: [x]}}\n", "'steps'"),
        ("version: 1\nworkflows: {w: {steps: [go], params_schema: {type: object, type: string}}}\n",
         "'type'"),
        # YAML's true and 1 are one Python dict key: the second would replace the first.
        ("version: 1\nworkflows: {w: {steps: [go]}}\nsettings: {1: a, true: b}\n", "True"),
    ],
)  # fmt: skip
def test_every_duplicate_key_is_refused(text: str, key: str) -> None:
    assert f"duplicate key {key}" in refusal(text)


def test_a_merge_key_may_still_be_overridden() -> None:
    # `<<: *base` then a key of its own is YAML's way to share a block: allowed.
    text = (
        HEAD
        + TRIGGER.replace("verify: {", "verify: &v {")
        + (
            "  u:\n    <<: {workflow: w, path: /hooks/x}\n    path: /hooks/u\n"
            "    verify: *v\n    event_id: {header: X-Id}\n"
        )
    )
    config = parse_config(text, env=ENV)
    assert config.triggers["u"].path == "/hooks/u"
    assert config.triggers["u"].verify == config.triggers["t"].verify


# --------------------------------------------------------------------------- aliases


def _bomb(levels: int, indent: str) -> str:
    lines = [f"{indent}l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        refs = ", ".join([f"*l{i - 1}"] * 9)
        lines.append(f"{indent}l{i}: &l{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_in_params_is_refused_at_once() -> None:
    # ~740 bytes that expand to 9**9 (387 million) values; main spent minutes here.
    params = "    params:\n" + _bomb(9, "      ")
    assert len(params) < 800
    message = refusal(HEAD + TRIGGER + params, within=1.0)
    assert "aliases expand to more than 100000 values" in message


def test_a_schema_bomb_is_refused_with_a_short_line() -> None:
    text = "version: 1\nworkflows:\n  w:\n    steps: [go]\n    params_schema:\n      enum:\n"
    text += "        - " + _bomb(9, "          ").lstrip()
    message = refusal(text, within=1.0)
    assert "aliases expand" in message


def test_aliases_that_stay_small_are_fine() -> None:
    params = "    params:\n" + _bomb(3, "      ")  # 9**3 values
    config = parse_config(HEAD + TRIGGER + params, env=ENV)
    assert len(config.triggers["t"].params.entries) == 3


@pytest.mark.parametrize(
    "text",
    [
        # A schema that contains itself: main printed a RecursionError traceback.
        "version: 1\nworkflows:\n  w:\n    steps: [go]\n    params_schema: &s\n"
        "      type: object\n      properties: {a: *s}\n",
        "version: 1\nworkflows: {w: {steps: &l [go, *l]}}\n",
        HEAD + TRIGGER + "    params: &p {a: *p}\n",
    ],
)
def test_recursive_anchors_are_refused(text: str) -> None:
    assert "an anchor is used inside itself (a recursive alias)" in refusal(text)


@pytest.mark.parametrize("depth", [100, 1500])
def test_deep_nesting_is_one_line(depth: int) -> None:
    text = "version: 1\nworkflows: {w: {steps: [go]}}\nsettings: " + "[" * depth + "]" * depth
    assert "nested more than 64 levels deep" in refusal(text, within=10.0)


def test_a_date_yaml_cannot_build_is_one_line() -> None:
    text = "version: 1\nworkflows: {w: {steps: [go], retention: 2024-13-45}}\n"
    assert refusal(text) == "triggers.yaml: not valid YAML: month must be in 1..12"


def test_triggers_check_refuses_a_bomb_quickly_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "triggers.yaml"
    config.write_text(HEAD + TRIGGER + "    params:\n" + _bomb(9, "      "))
    started = time.monotonic()
    result = _realm("triggers", "check", "--config", str(config), cwd=tmp_path, env=ENV)
    assert time.monotonic() - started < 30  # a process start; main went past 60 s
    assert (result.returncode, result.stdout) == (3, "")
    assert len(result.stderr.splitlines()) == 1 and "aliases expand" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- exact values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: true\nworkflows: {w: {steps: [go]}}\n", "field 'version' must be 1 (got True)"),
        ("version: 1.0\nworkflows: {w: {steps: [go]}}\n", "field 'version' must be 1 (got 1.0)"),
        ('version: 1\nworkflows: {"w\\n": {steps: [go]}}\n', "workflow 'w\\n': workflow names use"),
        ('version: 1\nworkflows: {w: {steps: [go], retention: "7d\\n"}}\n',
         "field 'retention': must be a duration"),
    ],
)  # fmt: skip
def test_near_misses_are_refused(text: str, message: str) -> None:
    assert message in refusal(text)


@pytest.mark.parametrize("path", ["/hooks/caf%C3%A9", "/hooks/a%20b", "/hooks/%"])
def test_a_percent_encoded_path_is_refused(path: str) -> None:
    message = refusal(HEAD + TRIGGER.replace("/hooks/t", path))
    assert "trigger 't': field 'path': must not contain '%'" in message
    assert "write it decoded" in message


def test_a_decoded_non_ascii_path_is_accepted() -> None:
    config = parse_config(HEAD + TRIGGER.replace("/hooks/t", "/hooks/café"), env=ENV)
    assert config.triggers["t"].path == "/hooks/café"


def test_not_found_workflow_names_only_the_file_s_base_name(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "triggers.yaml"
    path.parent.mkdir()
    path.write_text("version: 1\nworkflows: {w: {steps: [go]}}\n")
    config = load_config(path.resolve(), with_triggers=False)
    with pytest.raises(RealmError) as info:
        config.workflow("nope")
    assert info.value.code == "NOT_FOUND_WORKFLOW"
    assert info.value.message == "Workflow 'nope' is not defined in triggers.yaml (defined: w)."
    assert str(tmp_path) not in str(info.value)


# --------------------------------------------------------------------------- secrets


def test_every_missing_secret_is_reported_at_once() -> None:
    message = refusal(SHIPPED.read_text(), env={"REALM_TRIGGER_TOKEN": ""})
    assert message == (
        "triggers.yaml: triggers: field 'verify.secret_env': 3 environment variables for "
        "secrets are missing: GITHUB_WEBHOOK_SECRET is not set (triggers github-push, "
        "github-preview); STRIPE_WEBHOOK_SECRET is not set (trigger stripe-billing); "
        "REALM_TRIGGER_TOKEN is empty (triggers nightly-sync, rebuild-cache)"
    )


def test_one_missing_secret_keeps_the_message_naming_its_trigger() -> None:
    env = {name: "x" for name in SHIPPED_SECRETS if name != "STRIPE_WEBHOOK_SECRET"}
    assert refusal(SHIPPED.read_text(), env=env) == (
        "triggers.yaml: trigger 'stripe-billing': field 'verify.secret_env': "
        "environment variable STRIPE_WEBHOOK_SECRET is not set"
    )


def test_another_error_in_the_file_is_reported_before_missing_secrets() -> None:
    text = HEAD + TRIGGER + "    on_live_match: sometimes\n"
    assert "field 'on_live_match'" in refusal(text, env={})


def test_triggers_check_lists_every_missing_secret_and_run_needs_none(tmp_path: Path) -> None:
    check = _realm("triggers", "check", "--config", str(SHIPPED), cwd=tmp_path, env={})
    assert check.returncode == 3
    assert all(name in check.stderr for name in SHIPPED_SECRETS)
    assert len(check.stderr.splitlines()) == 1
    # The run commands load the workflows only: no secret needed (README says so).
    config = load_config(SHIPPED, with_triggers=False, env={})
    assert set(config.workflows) >= {"deploy", "nightly-sync"} and not config.triggers


def _realm(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    full.update(env)
    for name in (*SHIPPED_SECRETS, "GH"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd, env=full, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("workflows: {w: {steps: [go]}}\n",
         "triggers.yaml: field 'version' is missing; write 'version: 1' at the top"),
        ("version:\nworkflows: {w: {steps: [go]}}\n",
         "triggers.yaml: field 'version' has no value; write 'version: 1' at the top"),
    ],
)  # fmt: skip
def test_a_missing_version_is_said_so_not_got_none(text: str, message: str) -> None:
    assert refusal(text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: 1\nworkflows: {w: {stpes: [go]}}\n",
         "triggers.yaml: workflow 'w': field 'stpes': unknown field (did you mean 'steps'?); "
         "allowed fields: description, handlers, lease, max_attempts, params_schema, "
         "partitions, retention, retry_backoff, steps, stream_retention"),
        ("version: 1\nworkflows: {w: {steps: [go]}}\nsettings: {durability: {replica: 1}}\n",
         "triggers.yaml: settings: field 'durability.replica': unknown field (did you mean "
         "'replicas'?); allowed fields: fsync, replicas, timeout"),
        ("version: 1\nworkflows: {w: {steps: [go]}}\ntrigers: {}\n",
         "triggers.yaml: unknown top-level field 'trigers' (did you mean 'triggers'?); "
         "allowed fields: settings, triggers, version, workflows"),
        # Nothing close: no guess.
        ("version: 1\nworkflows: {w: {steps: [go], zzz: 1}}\n",
         "triggers.yaml: workflow 'w': field 'zzz': unknown field; allowed fields: "
         "description, handlers, lease, max_attempts, params_schema, partitions, retention, "
         "retry_backoff, steps, stream_retention"),
        ("version: 1\nworkflows: {w: {steps: [go]}}\nsetting: {}\nx: 1\n",
         "triggers.yaml: unknown top-level fields 'setting' (did you mean 'settings'?), 'x'; "
         "allowed fields: settings, triggers, version, workflows"),
    ],
)  # fmt: skip
def test_an_unknown_field_names_the_one_meant(text: str, message: str) -> None:
    assert refusal(text) == message


def test_an_unknown_setting_names_the_one_meant() -> None:
    message = refusal("version: 1\nworkflows: {w: {steps: [go]}}\nsettings: {max_body_byte: 10}\n")
    assert message.startswith(
        "triggers.yaml: settings: field 'max_body_byte': unknown field (did you mean "
        "'max_body_bytes'?); allowed fields: body_timeout, delivery_log, "
    ), message


def test_one_missing_secret_of_two_triggers_is_counted_in_the_singular() -> None:
    env = {name: "x" for name in SHIPPED_SECRETS if name != "GITHUB_WEBHOOK_SECRET"}
    assert refusal(SHIPPED.read_text(), env=env) == (
        "triggers.yaml: triggers: field 'verify.secret_env': 1 environment variable for "
        "secrets is missing: GITHUB_WEBHOOK_SECRET is not set (triggers github-push, "
        "github-preview)"
    )
