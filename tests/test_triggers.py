"""gateway.ingest.triggers: the `triggers:` section → compiled Triggers. Pure: no Redis."""

from __future__ import annotations

import copy
import hashlib
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.datastructures import Headers

from gateway.ingest.body import parse_body
from gateway.ingest.idempotency import VALIDATION_EVENT_ID, ExtractError
from gateway.ingest.triggers import Extracted, Trigger, describe_event_id, parse_triggers
from gateway.model.errors import ConfigError

# Payloads kept with the tests (tests/payloads/README.md says where from).
PAYLOADS = Path(__file__).resolve().parent / "payloads"
FILE = "triggers.yaml"
WORKFLOWS = ("deploy", "sync")
ENV = {"GITHUB_SECRET": "s3cret", "STRIPE_SECRET": "whsec_abc"}

EXAMPLE = """
github-push:
  workflow: deploy
  path: /hooks/github
  verify: {scheme: github, secret_env: [GITHUB_SECRET]}
  when:
    - {header: X-GitHub-Event, equals: push}
    - {jsonpath: $.ref, in: [refs/heads/main]}
  event_id: {header: X-GitHub-Delivery}
  key: "{event_id}"
  params:
    repo: $.repository.full_name
    sha: $.after
  on_live_match: use_existing
  on_terminal_match: reuse
github-pr:
  workflow: sync
  path: /hooks/github
  verify: {scheme: github, secret_env: GITHUB_SECRET}
  when:
    - {header: X-GitHub-Event, equals: pull_request}
    - {jsonpath: $.action, in: [opened, synchronize]}
  event_id: {header: X-GitHub-Delivery}
  key: "pr-{$.pull_request.number}-{$.pull_request.head.sha}"
  params:
    number: $.pull_request.number
    delivery: {header: X-GitHub-Delivery}
    source: github
  on_live_match: cancel_existing
  on_terminal_match: rerun
  on_params_mismatch: reject
nightly:
  workflow: sync
  path: /hooks/cron
  verify: {scheme: none}
  event_id: {jsonpath: $.id, missing: content_hash}
  key: nightly
"""


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE)


def parse(raw: object) -> dict[str, Trigger]:
    return parse_triggers(raw, file=FILE, workflows=WORKFLOWS, env=ENV)


def one(**fields: object) -> dict[str, Trigger]:
    """Parse a single trigger `t`: a minimal valid trigger with `fields` applied (None deletes)."""
    spec: dict[str, object] = {
        "workflow": "deploy",
        "path": "/hooks/x",
        "verify": {"scheme": "none"},
        "event_id": {"header": "X-Id"},
    }
    for name, value in fields.items():
        if value is None:
            spec.pop(name, None)
        else:
            spec[name] = value
    return parse({"t": spec})


# --------------------------------------------------------------------------- parsing


def test_example_parses_with_defaults_and_policies() -> None:
    triggers = parse(example())
    assert list(triggers) == ["github-push", "github-pr", "nightly"]
    push, pr, nightly = triggers.values()
    assert (push.name, push.workflow, push.path) == ("github-push", "deploy", "/hooks/github")
    assert pr.path == push.path  # several triggers may share a path
    assert push.verify.scheme == "github"
    assert nightly.verify.scheme == "none"
    assert (push.on_live_match, push.on_terminal_match, push.on_params_mismatch) == (
        "use_existing",
        "reuse",
        "flag",
    )
    assert (pr.on_live_match, pr.on_terminal_match, pr.on_params_mismatch) == (
        "cancel_existing",
        "rerun",
        "reject",
    )
    assert nightly.when == ()
    assert nightly.key.template == "nightly"
    assert describe_event_id(push) == "header X-GitHub-Delivery"
    assert describe_event_id(nightly) == "jsonpath $.id (else content hash)"


def test_default_key_is_event_id() -> None:
    trigger = one()["t"]
    assert trigger.key.template == "{event_id}"
    assert trigger.extract(Headers({"X-Id": "d1"}), {}, b"{}").key == "d1"


def test_secrets_never_in_repr() -> None:
    assert "s3cret" not in repr(parse(example()))


def test_none_and_empty_mean_no_triggers() -> None:
    assert parse(None) == {}
    assert parse({}) == {}


# --------------------------------------------------------------------------- match/extract


def test_match_and_extract_push() -> None:
    push = parse(example())["github-push"]
    doc = {"ref": "refs/heads/main", "after": "abc", "repository": {"full_name": "o/r"}}
    headers = Headers({"X-GitHub-Event": "push", "X-GitHub-Delivery": "d-1"})
    assert push.match(headers, doc) is None
    assert push.extract(headers, doc, b"{}") == Extracted(
        event_id="d-1", key="d-1", params={"repo": "o/r", "sha": "abc"}
    )
    assert push.match(Headers({"X-GitHub-Event": "ping"}), doc) == (
        "header X-GitHub-Event is 'ping', expected 'push'"
    )
    other = {**doc, "ref": "refs/heads/dev"}
    assert push.match(headers, other) == (
        "jsonpath $.ref is 'refs/heads/dev', expected one of ['refs/heads/main']"
    )


def test_match_and_extract_pull_request_fixture() -> None:
    body = (PAYLOADS / "github" / "pull_request.opened.json").read_bytes()
    doc = parse_body(body, "application/json")
    pr = parse(example())["github-pr"]
    headers = Headers({"X-GitHub-Event": "pull_request", "X-GitHub-Delivery": "d-2"})
    assert pr.match(headers, doc) is None
    assert pr.extract(headers, doc, body) == Extracted(
        event_id="d-2",
        key="pr-42-3c8e1f5a9d2b7c4e0a6f8b1d3e5c7a9f2b4d6e80",
        params={"number": 42, "delivery": "d-2", "source": "github"},
    )
    assert parse(example())["github-push"].match(headers, doc) is not None


def test_extract_missing_event_id_and_content_hash() -> None:
    triggers = parse(example())
    with pytest.raises(ExtractError) as info:
        triggers["github-push"].extract(Headers({}), {}, b"{}")
    assert info.value.code == VALIDATION_EVENT_ID
    assert "header X-GitHub-Delivery" in info.value.message
    body = b'{"no": "id"}'
    got = triggers["nightly"].extract(Headers({}), {"no": "id"}, body)
    assert got == Extracted(event_id=hashlib.sha256(body).hexdigest(), key="nightly", params={})


def test_extract_missing_key_part() -> None:
    pr = parse(example())["github-pr"]
    with pytest.raises(ExtractError, match=r"\{\$\.pull_request\.number\}"):
        pr.extract(Headers({"X-GitHub-Delivery": "d"}), {}, b"{}")


# --------------------------------------------------------------------------- errors


def config_error(raw: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    assert info.value.file == FILE
    return info.value


def trigger_error(**fields: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        one(**fields)
    err = info.value
    assert (err.file, err.section, err.name) == (FILE, "trigger", "t")
    assert str(err).startswith(f"{FILE}: trigger 't': ")
    return err


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"workflow": None}, "workflow", "is required"),
        (
            {"workflow": "nope"},
            "workflow",
            "unknown workflow 'nope'; known workflows: deploy, sync",
        ),
        ({"workflow": 3}, "workflow", "must be a workflow name"),
        ({"path": None}, "path", "is required"),
        ({"path": "hooks"}, "path", "starting with '/'"),
        ({"path": ["/a"]}, "path", "starting with '/'"),
        ({"path": "/hooks/{name}"}, "path", "must not contain"),
        ({"verify": None}, "verify", "write {scheme: none}"),
        ({"verify": {"scheme": "github"}}, "verify.secret_env", ""),
        ({"verify": {"scheme": "magic"}}, "verify.scheme", "unknown scheme"),
        ({"event_id": None}, "event_id", "is required"),
        ({"event_id": "X-Id"}, "event_id", "must be a mapping"),
        ({"event_id": {}}, "event_id", "exactly one source"),
        ({"event_id": {"header": "A", "jsonpath": "$.id"}}, "event_id", "got header and jsonpath"),
        ({"event_id": {"header": ""}}, "event_id.header", "non-empty string"),
        ({"event_id": {"header": "bad name"}}, "event_id.header", "not a valid header name"),
        ({"event_id": {"jsonpath": "$.a["}}, "event_id.jsonpath", "invalid JSONPath"),
        ({"event_id": {"jsonpath": "id"}}, "event_id.jsonpath", "must start with '$'"),
        (
            {"event_id": {"header": "A", "missing": "ignore"}},
            "event_id.missing",
            "must be one of reject, content_hash",
        ),
        ({"event_id": {"header": "A", "mising": "reject"}}, "event_id.mising", "did you mean"),
        ({"when": {"header": "A", "equals": "b"}}, "when", "must be a list"),
        ({"when": ["x"]}, "when[0]", "must be a mapping"),
        ({"when": [{"equals": "push"}]}, "when[0]", "exactly one source"),
        ({"when": [{"header": "A"}]}, "when[0]", "exactly one test"),
        ({"when": [{"header": "A", "equals": 1, "in": [1]}]}, "when[0]", "got equals, in"),
        (
            {"when": [{"header": "A", "equals": "x"}, {"header": "A", "matches": "("}]},
            "when[1].matches",
            "invalid regular expression",
        ),
        ({"when": [{"header": "A", "exists": "yes"}]}, "when[0].exists", "true or false"),
        ({"when": [{"header": "A", "in": "x"}]}, "when[0].in", "non-empty list"),
        ({"when": [{"jsonpath": 5, "equals": 1}]}, "when[0].jsonpath", "non-empty string"),
        ({"when": [{"header": "A", "equal": 1}]}, "when[0].equal", "did you mean 'equals'"),
        ({"key": 5}, "key", "must be a template string"),
        ({"key": "{nope}"}, "key", "unknown placeholder {nope}"),
        ({"key": "{$.a[}"}, "key", "invalid JSONPath"),
        ({"params": ["repo"]}, "params", "must be a mapping"),
        ({"params": {"sha": "$.a["}}, "params.sha", "invalid JSONPath"),
        ({"params": {"h": {"header": 5}}}, "params.h", "not a valid header name"),
        ({"on_live_match": "panic"}, "on_live_match", "use_existing, fail, cancel_existing"),
        (
            {"on_terminal_match": "again"},
            "on_terminal_match",
            "reuse, reject, rerun_if_failed, rerun",
        ),
        ({"on_params_mismatch": True}, "on_params_mismatch", "must be one of flag, reject"),
        ({"wokflow": "deploy"}, "wokflow", "unknown field (did you mean 'workflow'?)"),
    ],
)
def test_trigger_field_errors(fields: dict[str, object], field: str, message: str) -> None:
    err = trigger_error(**fields)
    assert err.field == field
    assert f"field '{field}': " in str(err)
    assert message in str(err)


def test_mapping_with_more_than_header_is_a_literal_param() -> None:
    params = one(params={"d": {"header": "A", "x": 1}})["t"].params
    assert params.extract(Headers({"A": "no"}), {}) == {"d": {"header": "A", "x": 1}}


@pytest.mark.parametrize("name", ["when", "key", "params", "on_live_match", "event_id"])
def test_null_optional_fields_are_errors(name: str) -> None:
    spec = example()["github-push"]
    spec[name] = None
    err = config_error({"github-push": spec})
    assert err.field == name
    assert "trigger 'github-push'" in str(err)


def test_unknown_field_lists_allowed_fields() -> None:
    err = trigger_error(retries=3)
    assert str(err) == (
        "triggers.yaml: trigger 't': field 'retries': unknown field (did you mean 'stripe'?); "
        "allowed fields: "
        "workflow, path, verify, when, event_id, key, params, on_live_match, "
        "on_terminal_match, on_params_mismatch, replay_guard, order, rate_limit, queue, "
        "concurrency, debounce, delay, methods, respond, stripe"
    )


def test_exact_message_for_header() -> None:
    err = trigger_error(event_id={"header": ""})
    assert str(err) == (
        "triggers.yaml: trigger 't': field 'event_id.header': "
        "must be a non-empty string (a header name), not an empty string"
    )


@pytest.mark.parametrize("raw", [[], "x", 3, True])
def test_triggers_section_must_be_a_mapping(raw: object) -> None:
    err = config_error(raw)
    assert str(err).startswith("triggers.yaml: triggers: must be a mapping")


@pytest.mark.parametrize("spec", [None, [], "deploy", 1])
def test_trigger_must_be_a_mapping(spec: object) -> None:
    err = config_error({"t": spec})
    assert err.name == "t"
    assert err.field is None
    assert "must be a mapping" in str(err)


@pytest.mark.parametrize("name", [1, None, "", "  "])
def test_trigger_names_must_be_strings(name: object) -> None:
    err = config_error({name: example()["nightly"]})
    assert "trigger name" in str(err)


def test_missing_secret_env_names_trigger() -> None:
    spec = example()["github-push"]
    with pytest.raises(ConfigError) as info:
        parse_triggers({"gh": spec}, file="other.yaml", workflows=WORKFLOWS, env={})
    assert (info.value.file, info.value.name) == ("other.yaml", "gh")
    assert (info.value.field or "").startswith("verify")


# --------------------------------------------------------------------------- fuzz

_JUNK: list[object] = [
    None,
    0,
    -1,
    True,
    "",
    "x",
    "$",
    "$.a[",
    "{",
    "/",
    [],
    [None],
    {},
    {"header": None},
    {"jsonpath": []},
    3.5,
    ["$.a"],
    {"x": {"y": []}},
]


def _mutate(node: object, rng: random.Random) -> object:
    """Replace, delete or recurse into one random spot of a YAML tree."""
    if isinstance(node, dict) and node and rng.random() < 0.7:
        key = rng.choice(list(node))
        roll = rng.random()
        if roll < 0.2:
            del node[key]
        elif roll < 0.3:
            node[rng.choice(["extra", 7, None])] = rng.choice(_JUNK)
        else:
            node[key] = _mutate(node[key], rng)
        return node
    if isinstance(node, list) and node and rng.random() < 0.7:
        i = rng.randrange(len(node))
        node[i] = _mutate(node[i], rng)
        return node
    return copy.deepcopy(rng.choice(_JUNK))


def test_mutated_configs_give_config_error_or_triggers() -> None:
    rng = random.Random(20240601)
    base = example()
    outcomes = {"ok": 0, "error": 0}
    for _ in range(500):
        raw = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            raw = _mutate(raw, rng)
        try:
            triggers = parse(raw)
        except ConfigError as exc:
            assert str(exc).startswith(FILE)
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        for trigger in triggers.values():
            # A config that parsed must evaluate without surprises on any body.
            try:
                if trigger.match(Headers({}), {}) is None:
                    trigger.extract(Headers({}), {}, b"{}")
            except ExtractError:
                pass
    assert outcomes["error"] > 100 and outcomes["ok"] > 10
