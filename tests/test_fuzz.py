"""Property-based fuzzing (hypothesis) of the two inputs an outsider controls:
webhook deliveries to a real `realm listen`, and `triggers.yaml` documents.

Deliveries: odd bodies (invalid UTF-8, deep nesting, huge numbers, duplicate
keys, empty, random bytes), signed correctly so they reach the parser, with
random content types and extra headers. Never a 500, never a traceback in a
reply, only documented statuses; unsigned ones are 401 and write nothing.

Configs: mutations of the shipped triggers.yaml. ``parse_config`` either
succeeds or raises one ``ConfigError`` line naming the file and the field or
section; ``realm triggers check`` exits 3 with one line on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes, urlencode

import httpx
import pytest
import redis as redis_sync
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.loading import parse_config
from gateway.model.errors import ConfigError
from tests.listener import Listener, run_state_size
from tests.servers import RedisServer
from tests.signing import github_signature, standard_headers

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "triggers.yaml"

GITHUB_SECRET = "gh-fuzz-0d9c8b7a6e5f4132"
STANDARD_SECRET = "whsec_ZnV6ei1zdGFuZGFyZC13ZWJob29rcy1rZXktOTk="
ENV = {"GITHUB_WEBHOOK_SECRET": GITHUB_SECRET, "STANDARD_WEBHOOK_SECRET": STANDARD_SECRET}
CONFIG_ENV = {
    "GITHUB_WEBHOOK_SECRET": "gh-config-fuzz-secret",
    "STRIPE_WEBHOOK_SECRET": "whsec_configFuzzStripe",
    "REALM_TRIGGER_TOKEN": "tok-config-fuzz",
}
MAX_BODY = 65536

CONFIG = f"""
version: 1
settings:
  max_body_bytes: {MAX_BODY}
workflows:
  deploy:
    steps: [fetch, build]
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {{type: string}}
        sha: {{type: string, pattern: "^[0-9a-f]{{40}}$"}}
  sink: {{steps: [go]}}
  strict: {{steps: [go]}}
  events: {{steps: [go]}}
  badref:
    steps: [go]
    params_schema: {{properties: {{id: {{$ref: '#/definitions/nope'}}}}}}
triggers:
  push:
    workflow: deploy
    path: /hooks/github
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    when:
      - {{header: X-GitHub-Event, equals: push}}
      - {{jsonpath: $.ref, matches: '^refs/heads/'}}
    event_id: {{header: X-GitHub-Delivery}}
    params: {{repo: $.repository.full_name, sha: $.after}}
  any:
    workflow: sink
    path: /hooks/github
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    when: [{{jsonpath: $.kind, exists: false}}]
    event_id: {{jsonpath: $.id, missing: content_hash}}
    key: "k-{{event_id}}"
    params:
      first: "$..id"
      names: "$.items[*].name"
      all: $.all
      h: {{header: X-Fuzz}}
      lit: [1, {{a: b}}]
  strict:
    workflow: strict
    path: /hooks/github
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    when:
      - {{jsonpath: $.kind, exists: true}}
      - {{header: X-GitHub-Event, in: [push, ping]}}
    event_id: {{header: X-GitHub-Delivery}}
    params: {{kind: $.kind}}
    on_params_mismatch: reject
  std:
    workflow: events
    path: /hooks/standard
    verify: {{scheme: standard, secret_env: STANDARD_WEBHOOK_SECRET}}
    event_id: {{header: webhook-id}}
    key: "{{$.id}}-{{header:X-Fuzz-Key}}"
    params: {{type: $.type}}
  badref:
    workflow: badref
    path: /hooks/badref
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    event_id: {{header: X-GitHub-Delivery}}
    params: {{id: $.id}}
"""


SIGNED_STATUSES = {200, 202, 400, 409, 413, 422}
VERIFY_HEADERS = {
    "x-hub-signature-256",
    "x-hub-signature",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
}
# Headers whose random values would change the HTTP framing, not the delivery.
FRAMING_HEADERS = {"content-length", "transfer-encoding", "host", "connection", "expect",
                   "upgrade", "te", "trailer", "keep-alive", "content-type"}  # fmt: skip

STATS: Counter[str] = Counter()


def figures(name: str, **numbers: object) -> None:
    print(f"FIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer):
    listener = Listener(
        tmp_path_factory.mktemp("fuzz-listen"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield listener
    listener.stop()


@pytest.fixture(scope="module")
def db(module_redis: RedisServer) -> Iterator[redis_sync.Redis]:
    client = redis_sync.Redis.from_url(module_redis.url, decode_responses=True, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(gateway: Listener) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        yield client


@pytest.fixture
def clean(db: redis_sync.Redis) -> redis_sync.Redis:
    db.flushall()
    return db


# --------------------------------------------------------------------------- 12a. bodies


def _deep(depth: int, leaf: bytes = b"1") -> bytes:
    return b'{"a":' * depth + leaf + b"}" * depth


SPECIAL_BODIES: list[bytes] = [
    b"",
    b" ",
    b"[" * 10_000,
    b"[" * 1000 + b"]" * 1000,
    b"[" * 1100 + b"]" * 1100,
    b"{" * 5000,
    _deep(1000),
    b'{"id":"deep","all":' + b"[" * 300 + b"]" * 300 + b"}",
    b'{"id":"deep2","items":[{"name":' + _deep(500) + b"}]}",
    b"1e999",
    b'{"ref":1e999}',
    b"-1e999",
    b"9" * 500,
    b'{"id":' + b"9" * 500 + b"}",
    b'{"id":18446744073709551616}',
    b'{"id":-9223372036854775809}',
    b'{"id":1.5e308,"ref":"refs/heads/main"}',
    b'{"ref":"refs/heads/main","ref":"refs/heads/evil","id":"dup","id":"dup2"}',
    b'{"kind":"a","kind":{"x":1}}',
    b"\xff\xfe\xfd",
    b'{"a":"\xc3\x28"}',
    b'{"a":"\xed\xa0\x80"}',
    b"\xef\xbb\xbf{}",
    b'"\\ud800"',
    b'{"id":"\\u0000"}',
    b"null",
    b"[]",
    b"{}",
    b'"str"',
    b"true",
    b"NaN",
    b'{"id":' + b'"' + b"x" * 60_000 + b'"}',
    b"payload=%7B%22ref%22%3A1%7D",
    b"payload=%ZZ%",
    b"payload=" + quote_from_bytes(b"\xff\xfe").encode(),
    b"payload=" + quote_from_bytes(b"[" * 2000).encode(),
    b"a=1&a=2&payload=",
    b"payload=1&payload=2",
    "&".join(f"k{i}=v" for i in range(5000)).encode(),
    b"\x00" * 64,
    ("\u2028\u00e9\U0001f600").encode(),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)

shaped = st.fixed_dictionaries(
    {},
    optional={
        "ref": st.sampled_from(["refs/heads/main", "refs/tags/v1", "", 5, None, ["x"]]),
        "after": st.sampled_from(["a" * 40, "ZZ", 1, None]),
        "repository": st.fixed_dictionaries({"full_name": st.text(max_size=10) | st.integers()}),
        "id": st.text(max_size=12) | st.integers() | st.booleans() | st.none(),
        "kind": st.text(max_size=5) | st.integers(),
        "type": st.text(max_size=8),
        "items": st.lists(st.fixed_dictionaries({"name": json_values}), max_size=3),
        "all": json_values,
    },
)


def _form(doc: Any) -> bytes:
    return urlencode({"payload": json.dumps(doc)}).encode()


bodies = st.one_of(
    st.sampled_from(SPECIAL_BODIES),
    st.binary(max_size=512),
    json_values.map(lambda v: json.dumps(v).encode()),
    shaped.map(lambda v: json.dumps(v).encode()),
    shaped.map(_form),
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
)

content_types = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "application/x-www-form-urlencoded",
            "application/x-www-form-urlencoded; charset=latin-1",
            "text/plain",
            None,
            "",
            "garbage/!!",
            "multipart/form-data; boundary=x",
            "APPLICATION/X-WWW-FORM-URLENCODED",
        ]
    ),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30),
)

header_values = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_categories=("Cc",)),
    max_size=40,
).map(lambda s: s.strip().encode("latin-1"))
header_names = st.one_of(
    st.sampled_from(
        [
            "X-GitHub-Event",
            "X-GitHub-Delivery",
            "X-Fuzz",
            "X-Fuzz-Key",
            "Idempotency-Key",
            "Accept",
            "User-Agent",
            "X-Forwarded-For",
            "Content-Encoding",
        ]
    ),
    st.from_regex(r"\AX-[A-Za-z0-9!#$%&'*+.^_`|~-]{1,20}\Z"),
)
event_values = st.sampled_from([b"push", b"ping", b"pull_request", b"PUSH", b""])
delivery_values = st.sampled_from([b"d-1", b"d-2", b"", b"x" * 300])
extra_headers = st.lists(
    st.one_of(
        st.tuples(header_names, header_values),
        st.tuples(st.just("X-GitHub-Event"), event_values),
        st.tuples(st.just("X-GitHub-Delivery"), delivery_values),
    ),
    max_size=6,
)


def _signature(path: str, body: bytes) -> dict[str, str]:
    """The headers that sign ``body`` for the trigger at ``path``."""
    if path == "/hooks/standard":
        return standard_headers(body, STANDARD_SECRET, content_type=None)
    return {"X-Hub-Signature-256": github_signature(GITHUB_SECRET, body)}


def _post(
    http: httpx.Client,
    path: str,
    body: bytes,
    content_type: str | None,
    extra: list[tuple[str, bytes]],
    signing: str,
) -> httpx.Response:
    headers: list[tuple[str, bytes]] = []
    if content_type is not None:
        headers.append(("Content-Type", content_type.encode("latin-1")))
    headers += [(k, v) for k, v in extra if k.lower() not in VERIFY_HEADERS | FRAMING_HEADERS]
    if signing != "unsigned":
        # Forged: signed over another body.
        signed = body if signing == "signed" else body + b" "
        headers += [(k, v.encode()) for k, v in _signature(path, signed).items()]
    return http.post(path, content=body, headers=headers)


@pytest.mark.slow
@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    path=st.sampled_from(["/hooks/github", "/hooks/github", "/hooks/standard"]),
    body=bodies,
    content_type=content_types,
    extra=extra_headers,
    signing=st.sampled_from(["signed"] * 6 + ["unsigned", "forged"]),
)
def test_fuzzed_deliveries_never_crash(http, db, path, body, content_type, extra, signing):
    before = run_state_size(db) if signing != "signed" else None
    reply = _post(http, path, body, content_type, extra, signing)
    STATS[f"{signing}:{reply.status_code}"] += 1
    assert "Traceback" not in reply.text
    assert reply.status_code != 500, reply.text
    payload = reply.json()
    assert payload["status"] in ("ok", "error"), payload
    if signing == "signed":
        assert reply.status_code in SIGNED_STATUSES, (reply.status_code, reply.text[:300])
    else:
        assert reply.status_code == 401, (reply.status_code, reply.text[:300])
        assert payload["code"] == "AUTH_REQUIRED"
        assert run_state_size(db) == before


def test_fuzz_summary_and_listener_health(gateway, http):
    """Runs after the fuzz test: the listener is alive and logged no traceback."""
    assert gateway.process is not None and gateway.process.poll() is None
    assert http.get("/healthz").status_code == 200
    log = gateway.log()
    assert "Traceback" not in log, log[-4000:]
    figures(
        "fuzz_deliveries",
        examples=sum(STATS.values()),
        **{k.replace(":", "_"): v for k, v in sorted(STATS.items())},
        status_500=0,
        tracebacks=0,
    )


def test_special_bodies_each_once(http, clean):
    """Every hand-picked hostile body, signed, as JSON, as a form and with no type."""
    seen: Counter[int] = Counter()
    slowest = 0.0
    for body in SPECIAL_BODIES:
        for content_type in ("application/json", "application/x-www-form-urlencoded", None):
            started = time.perf_counter()
            reply = _post(http, "/hooks/github", body, content_type, [], "signed")
            slowest = max(slowest, time.perf_counter() - started)
            seen[reply.status_code] += 1
            assert "Traceback" not in reply.text
            assert reply.status_code in SIGNED_STATUSES, (body[:60], reply.text[:300])
    figures(
        "special_bodies",
        deliveries=sum(seen.values()),
        **{f"status_{k}": v for k, v in sorted(seen.items())},
        slowest_ms=round(slowest * 1000, 1),
    )


def test_unresolvable_schema_ref_is_refused_not_a_500(http, clean):
    """A $ref to nowhere that only some params reach (so the load check cannot see it)
    refuses those params (422), it does not crash the delivery."""
    body = json.dumps({"id": "x"}).encode()
    extra = [("X-GitHub-Delivery", str(uuid.uuid4()).encode())]
    reply = _post(http, "/hooks/badref", body, "application/json", extra, "signed")
    assert reply.status_code == 422, reply.text
    assert reply.json()["results"][0]["code"] == "VALIDATION_PARAMS"
    assert "Traceback" not in reply.text


def test_unresolvable_schema_ref_is_a_config_error():
    text = "version: 1\nworkflows:\n  w:\n    steps: [a]\n    params_schema: {$ref: '#/nope'}\n"
    with pytest.raises(ConfigError, match=r"field 'params_schema'"):
        parse_config(text, file="triggers.yaml", with_triggers=False)


# --------------------------------------------------------------------------- 12b. configs


def _shipped() -> dict[str, Any]:
    return yaml.safe_load(SHIPPED_CONFIG.read_text())


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


# Keys for inserted unknown fields: any printable text without line breaks (names
# with line breaks have their own test below).
field_names = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_categories=("Cc", "Zl", "Zp")),
    min_size=0,
    max_size=12,
)
odd_values = st.sampled_from(
    [
        None, True, False, 0, -1, 1.5, 10**30, "", "text", "$", "$.", "$[?(@.a ==]", "$..[*",
        "$.`this`", "([", "(?P<", "*", "/no?query", "no-slash", "/{param}", "{event_id",
        "}", "{nope}", "{header:}", "{$[}", "7 days", "0d", "99999999999999999999d", "sha384",
        "base32", "github", "none", "reject", "content_hash", "whsec_", "UNSET_VARIABLE",
        "lower-case-var", "1BAD", [], {}, [1, "a"], {"x": 1}, [None], {"scheme": "none"},
        {"header": "X-Y"}, {"jsonpath": "$.id"}, {"type": "nonsense"},
    ]
)  # fmt: skip
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()


@st.composite
def mutated_configs(draw: st.DrawFn) -> tuple[str, list[str]]:
    doc = _shipped()
    done: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        kind = draw(
            st.sampled_from(["delete", "odd", "leaf", "insert", "wrap", "unwrap", "empty", "root"])
        )
        if kind == "root":
            doc = draw(odd_values | json_leaf)
            done.append("root")
            break
        if not path:
            kind = "insert" if isinstance(doc, dict) else "odd"
        node = _get(doc, path) if path else doc
        parent = _get(doc, path[:-1]) if path else None
        if kind == "delete" and parent is not None:
            del parent[path[-1]]
        elif kind == "insert" and isinstance(node, dict):
            node[draw(field_names)] = draw(odd_values | json_leaf)
        elif kind == "wrap" and parent is not None:
            parent[path[-1]] = [node]
        elif kind == "unwrap" and parent is not None and isinstance(node, list | dict):
            parent[path[-1]] = draw(st.sampled_from(["a string", 7, None, True]))
        elif kind == "empty" and parent is not None:
            parent[path[-1]] = type(node)() if isinstance(node, list | dict | str) else None
        elif parent is not None:
            parent[path[-1]] = draw(odd_values if kind == "odd" else json_leaf)
        else:
            continue
        done.append(f"{kind} {'.'.join(map(str, path))}")
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    return text, done


TOP_LEVEL_MESSAGES = (
    "unknown top-level field",
    "must be a mapping with 'version'",
    "not valid YAML",
)
SECTIONS = ("trigger '", "workflow '", "settings", "triggers")


def check_config_error(message: str, file: str = "triggers.yaml") -> None:
    assert len(message.splitlines()) == 1, f"not one line: {message!r}"
    assert message.startswith(f"{file}: "), message
    rest = message[len(file) + 2 :]
    assert "field '" in rest or rest.startswith(SECTIONS + TOP_LEVEL_MESSAGES), message


CONFIG_STATS: Counter[str] = Counter()


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_configs())
def test_mutated_configs_parse_or_fail_with_one_line(mutated):
    text, done = mutated
    try:
        parse_config(text, file="triggers.yaml", env=CONFIG_ENV)
    except ConfigError as exc:
        CONFIG_STATS["config_error"] += 1
        check_config_error(str(exc))
    except Exception as exc:  # the property: nothing but ConfigError escapes
        pytest.fail(f"{type(exc).__name__} from parse_config after {done}: {exc}")
    else:
        CONFIG_STATS["accepted"] += 1


def test_config_fuzz_figures():
    figures("config_mutations", examples=sum(CONFIG_STATS.values()), **CONFIG_STATS,
            other_exceptions=0)  # fmt: skip


def _mutate(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def _cli_cases() -> dict[str, str]:
    text = SHIPPED_CONFIG.read_text()
    return {
        "unknown-scheme": _mutate(text, "{scheme: github,", "{scheme: gitlub,"),
        "bad-jsonpath": _mutate(text, "sha: $.after", "sha: '$[?(@.a ==]'"),
        "bad-regex": _mutate(text, "matches: '^(invoice", "matches: '(?P<(invoice"),
        "steps-not-a-list": _mutate(text, "steps: [rebuild]", "steps: rebuild"),
        "verify-not-a-mapping": _mutate(
            text,
            "verify: {scheme: stripe, secret_env: STRIPE_WEBHOOK_SECRET}",
            "verify: stripe",
        ),
        "unknown-field": _mutate(text, "    on_live_match: fail", "    on_live_mach: fail"),
        "missing-secret-env": _mutate(text, "REALM_TRIGGER_TOKEN}", "REALM_NOT_SET}"),
    }


def _run_check(paths: list[Path]) -> list[subprocess.CompletedProcess[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    env.update(CONFIG_ENV)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gateway", "triggers", "check", "--config", str(p)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in paths
    ]
    out = []
    for p, proc in zip(paths, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(p, proc.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_cli_check_on_mutated_files_exits_3_with_one_line(tmp_path):
    cases = _cli_cases()
    paths = []
    for name, text in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        paths.append(path)
    started = time.perf_counter()
    results = _run_check(paths)
    elapsed = time.perf_counter() - started
    for name, path, result in zip(cases, paths, results, strict=True):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 3, (name, result.returncode, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, name
        assert len(lines) == 1, (name, result.stderr)
        assert lines[0].startswith("error: "), lines
        check_config_error(lines[0][len("error: ") :], file=str(path))
    figures("cli_check_mutations", files=len(cases), exit_3=len(cases),
            one_line=len(cases), wall_s=round(elapsed, 2))  # fmt: skip


# --------------------------------------------------------------------------- defects found


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d["triggers"]["github-push"].__setitem__("a\nb", 1), id="field"),
        pytest.param(lambda d: d["workflows"].__setitem__("a\nb", {"steps": ["x"]}), id="wf"),
        pytest.param(lambda d: d.__setitem__("settings", {"a\nb": 1}), id="settings"),
        pytest.param(
            lambda d: d["triggers"]["github-push"].__setitem__("workflow", "a\nb"),
            id="workflow-ref",
        ),
    ],
)
def test_config_error_with_line_break_in_a_name_is_one_line(mutate):
    doc = _shipped()
    mutate(doc)
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(doc), file="triggers.yaml", env=CONFIG_ENV)
    check_config_error(str(caught.value))


@pytest.mark.parametrize("value", [1, [1], {"a": 1}, True], ids=["int", "list", "map", "bool"])
def test_non_string_dollar_schema_is_a_config_error(value):
    doc = _shipped()
    doc["workflows"]["deploy"]["params_schema"]["$schema"] = value
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(doc), file="triggers.yaml", env=CONFIG_ENV)
    check_config_error(str(caught.value))
    assert "field 'params_schema'" in str(caught.value)


def test_cli_check_non_string_dollar_schema(tmp_path):
    text = _mutate(
        SHIPPED_CONFIG.read_text(),
        "    params_schema:\n      type: object\n      required: [repo, sha]",
        "    params_schema:\n      $schema: 1\n      type: object\n      required: [repo, sha]",
    )
    path = tmp_path / "triggers.yaml"
    path.write_text(text)
    [result] = _run_check([path])
    assert "Traceback" not in result.stderr
    assert result.returncode == 3
    assert len(result.stderr.strip().splitlines()) == 1
