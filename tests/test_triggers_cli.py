"""`realm triggers check` and `realm triggers test` as a CI job and a user run them: the
real CLI in a process of its own; the dry run asks a private Redis."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis as redis_sync

from tests.servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "triggers.yaml"
PUSH = ROOT / "examples" / "github-push.json"
SECRETS = {
    "GITHUB_WEBHOOK_SECRET": "dev-github-secret",
    "STRIPE_WEBHOOK_SECRET": "whsec_dev",
    "REALM_TRIGGER_TOKEN": "dev-token",
}
PUSH_HEADERS = ("--header", "X-GitHub-Event: push", "--header", "X-GitHub-Delivery: d-1")


def realm(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``realm ARGS`` with exactly the secrets of ``env`` (none of the caller's)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    for name in SECRETS:
        full.pop(name, None)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd, env=full, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def shipped(tmp_path: Path) -> Path:
    """A copy of the shipped triggers.yaml as ./triggers.yaml of the test's folder."""
    shutil.copy(SHIPPED, tmp_path / "triggers.yaml")
    return tmp_path


# --------------------------------------------------------------------------- check


def test_check_without_secrets_passes_and_names_what_it_could_not_check(shipped: Path) -> None:
    out = realm("triggers", "check", "--no-secrets", cwd=shipped, env={})
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["TRIGGER", "PATH", "WORKFLOW", "VERIFY", "EVENT", "ID", "ON",
                                "LIVE", "ON", "TERMINAL"]  # fmt: skip
    assert [line.split()[0] for line in lines[1:6]] == [
        "github-push", "github-preview", "stripe-billing", "nightly-sync", "rebuild-cache",
    ]  # fmt: skip
    assert lines[6:] == [
        "triggers.yaml: ok: 5 workflows, 5 triggers",
        "not checked (--no-secrets): that these variables are set where the triggers are served:",
        "  GITHUB_WEBHOOK_SECRET (triggers github-push, github-preview)",
        "  STRIPE_WEBHOOK_SECRET (trigger stripe-billing)",
        "  REALM_TRIGGER_TOKEN (triggers nightly-sync, rebuild-cache)",
    ]


def test_check_without_secrets_still_refuses_every_other_error(shipped: Path) -> None:
    config = shipped / "triggers.yaml"
    config.write_text(config.read_text().replace("on_live_match: fail", "on_live_match: never"))
    out = realm("triggers", "check", "--no-secrets", cwd=shipped, env={})
    assert out.returncode == 3
    assert out.stderr.startswith(
        "error: triggers.yaml: trigger 'nightly-sync': field 'on_live_match': "
    ), out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr


def test_check_without_secrets_ignores_the_variables_it_finds(tmp_path: Path) -> None:
    """The result does not hang on the shell it runs in: a variable that is set, even to
    what its scheme refuses, is not read."""
    (tmp_path / "triggers.yaml").write_text(
        "version: 1\nworkflows: {w: {steps: [go]}}\ntriggers:\n"
        "  hook:\n    workflow: w\n    path: /hooks/w\n"
        "    verify: {scheme: standard, secret_env: HOOK_SECRET}\n"
        "    event_id: {header: webhook-id}\n"
    )
    strict = realm("triggers", "check", cwd=tmp_path, env={"HOOK_SECRET": "not-whsec"})
    assert strict.returncode == 3 and "Standard Webhooks secret" in strict.stderr
    out = realm("triggers", "check", "--no-secrets", cwd=tmp_path, env={"HOOK_SECRET": "x"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-3:] == [
        "triggers.yaml: ok: 1 workflow, 1 trigger",
        "not checked (--no-secrets): that this variable is set where the triggers are served:",
        "  HOOK_SECRET (trigger hook)",
    ]


def test_check_with_secrets_missing_says_how_to_check_without_them(shipped: Path) -> None:
    out = realm("triggers", "check", cwd=shipped, env={})
    assert out.returncode == 3
    assert len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("error: triggers.yaml: triggers: field 'verify.secret_env': ")
    assert out.stderr.endswith("; --no-secrets checks all but the secrets\n")
    # The hint only when the secrets are all that is wrong.
    config = shipped / "triggers.yaml"
    config.write_text(config.read_text().replace("on_live_match: fail", "on_live_match: never"))
    other = realm("triggers", "check", cwd=shipped, env={})
    assert other.returncode == 3 and "--no-secrets" not in other.stderr


# --------------------------------------------------------------------------- test


@pytest.fixture
def dry(shipped: Path, module_redis: RedisServer, db: redis_sync.Redis):
    """``realm triggers test`` on the shipped config and the module's (flushed) Redis."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return realm("triggers", "test", *args, "--redis-url", module_redis.url,
                     cwd=shipped, env=SECRETS)  # fmt: skip

    return run


def test_a_delivery_that_would_start_a_run_exits_0(dry) -> None:
    out = dry("--path", "/hooks/github", "--body", str(PUSH), "--sign", *PUSH_HEADERS)
    assert out.returncode == 0, out.stderr
    assert "  result: a claim now would start a new run" in out.stdout.splitlines()
    assert out.stderr.splitlines()[-1] == "the listener would answer 202"


def test_a_signature_that_fails_exits_1_with_the_listener_s_401(dry, db) -> None:
    out = dry("--path", "/hooks/github", "--body", str(PUSH), *PUSH_HEADERS)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines().count("  result: 401: signature did not verify") == 2
    assert out.stderr.splitlines()[-1] == "the listener would answer 401"
    as_json = dry("--path", "/hooks/github", "--body", str(PUSH), *PUSH_HEADERS, "--json")
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["status"] == 401
    assert [t["status"] for t in report["triggers"]] == [401, 401]
    assert db.dbsize() == 0  # a dry run writes nothing


def test_params_that_fail_the_schema_exit_1_with_the_listener_s_422(dry, shipped: Path) -> None:
    body = json.loads(PUSH.read_text())
    body["after"] = "not-a-sha"  # deploy's params_schema wants 40 hex digits
    (shipped / "bad.json").write_text(json.dumps(body))
    out = dry("--path", "/hooks/github", "--body", "bad.json", "--sign", *PUSH_HEADERS, "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    push = next(t for t in report["triggers"] if t["trigger"] == "github-push")
    assert push["status"] == 422 and push["result"].startswith("422: VALIDATION_PARAMS: ")
    assert report["status"] == 422  # over the other trigger's 200 (not matched)


def test_a_delivery_no_trigger_matches_exits_0(dry) -> None:
    out = dry("--path", "/hooks/github", "--body", str(PUSH), "--sign",
              "--header", "X-GitHub-Event: ping", "--header", "X-GitHub-Delivery: d-2")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-1] == "the listener would answer 200"


def test_an_unreachable_store_exits_4_with_its_code_not_a_traceback(shipped: Path) -> None:
    out = realm("triggers", "test", "--path", "/hooks/github", "--body", str(PUSH), "--sign",
                *PUSH_HEADERS, "--redis-url", f"redis://127.0.0.1:{free_port()}",
                cwd=shipped, env=SECRETS)  # fmt: skip
    assert out.returncode == 4
    assert out.stdout == (
        "status: error\nSTORE_UNAVAILABLE: Redis is unreachable: connection refused\n"
    )
    assert "Traceback" not in out.stderr
