"""Keys and event ids name one event only.

A key template's values are encoded one by one (gateway/ingest/idempotency.py;
docs/triggers.md, "Keys and event ids name one event"): plain strings stay as they are,
``%`` and the template's separators are percent-encoded, and a JSON string that reads as
a number or boolean is marked ``%s``. These tests decode every rendered key back to the
values it came from: a key that decodes to exactly its values cannot be shared by two
different ones.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from starlette.datastructures import Headers

from gateway.ingest.body import FORM_LOOKS_LIKE_JSON, BodyError, parse_body
from gateway.ingest.delivery import handle
from gateway.ingest.dryrun import dry_run
from gateway.ingest.idempotency import (
    VALIDATION_EVENT_ID,
    ExtractError,
    KeyTemplate,
    compile_event_id,
    compile_key,
)
from gateway.ingest.jsonpath import compile_path
from gateway.ingest.triggers import Trigger
from gateway.loading import parse_config
from gateway.store.runs import MAX_KEY_BYTES
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.servers import RedisServer

READS_AS_JSON = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false")

# --------------------------------------------------------------------------- a decoder


def decode(template: KeyTemplate, key: str) -> list[object]:
    """The values ``key`` was rendered from, by the rules README documents."""
    values: list[object] = []
    parts = template.parts
    pos = 0
    for i, (kind, text, _ref, chars) in enumerate(parts):
        if kind == "text":
            assert key.startswith(text, pos), (key, pos, text)
            pos += len(text)
            continue
        later = [p for p in parts[i + 1 :] if p[0] != "text"]
        if later:  # the value ends at the first (unescaped) separator
            end = key.index(parts[i + 1][1][0], pos)
        else:  # the last value ends where the fixed tail begins
            tail = parts[i + 1][1] if i + 1 < len(parts) else ""
            end = len(key) - len(tail)
        raw, pos = key[pos:end], end
        if kind != "path":
            values.append(unquote(raw, errors="strict") if chars else raw)
        elif raw.startswith("%s"):
            values.append(unquote(raw[2:], errors="strict"))
        else:
            text_value = unquote(raw, errors="strict")
            values.append(
                json.loads(text_value) if READS_AS_JSON.fullmatch(text_value) else text_value
            )
    assert pos == len(key)
    return values


def typed(values: list[object]) -> list[tuple[str, object]]:
    """Values compared with their JSON type (Python says 1 == True == 1.0)."""
    return [(type(v).__name__, v) for v in values]


# Strings made of separators, escapes and marks, and strings that read as JSON.
TRICKY = st.one_of(
    st.text(alphabet=list(":-/.%s3A2D5ab1é{} _"), min_size=1, max_size=8),
    st.sampled_from(["1", "-1", "1.5", "1e5", "true", "false", "%s1", "%3A", "%25", "x:y", "y:z"]),
)
JSON_SCALAR = st.one_of(
    TRICKY,
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
)
TEMPLATES = [
    "{$.a}:{$.b}",
    "pr-{$.a}-{$.b}-{$.c}",
    "{$.a}",
    "k{$.a}",
    "{header:X-A}/{event_id}.{$.b}",
    "{$.a}::{$.b}x",
    "{$.a}-{event_id}",
    "{event_id}",
]


def render(template: KeyTemplate, values: list[object]) -> str:
    doc: dict[str, object] = {}
    headers: dict[str, str] = {}
    event_id = "unused"
    holes = [p for p in template.parts if p[0] != "text"]
    for (kind, _text, ref, _chars), value in zip(holes, values, strict=True):
        if kind == "path":
            doc[ref.expr[2:]] = value  # type: ignore[union-attr]
        elif kind == "header":
            headers[str(ref).lower()] = str(value)
        else:
            event_id = str(value)
    return template.render(headers, doc, event_id, exact=True)


@st.composite
def template_and_values(draw: st.DrawFn) -> tuple[KeyTemplate, list[object]]:
    template = compile_key(draw(st.sampled_from(TEMPLATES)))
    values = [
        draw(JSON_SCALAR if kind == "path" else TRICKY)
        for kind, *_ in template.parts
        if kind != "text"
    ]
    return template, values


@settings(max_examples=600, deadline=None)
@given(template_and_values())
def test_every_key_decodes_to_exactly_its_values(case: tuple[KeyTemplate, list[object]]) -> None:
    template, values = case
    assert typed(decode(template, render(template, values))) == typed(values)


@st.composite
def template_and_many(draw: st.DrawFn) -> tuple[KeyTemplate, list[list[object]]]:
    template = compile_key(draw(st.sampled_from(TEMPLATES)))
    kinds = [kind for kind, *_ in template.parts if kind != "text"]
    # Few distinct atoms, so that near-collisions (x:y|z vs x|y:z) come up often.
    atoms = draw(st.lists(JSON_SCALAR, min_size=2, max_size=6))
    strings = [a for a in atoms if isinstance(a, str)] or ["x"]
    row = st.tuples(*(st.sampled_from(atoms if k == "path" else strings) for k in kinds))
    return template, [list(r) for r in draw(st.lists(row, min_size=2, max_size=30))]


@settings(max_examples=300, deadline=None)
@given(template_and_many())
def test_two_different_value_tuples_never_share_a_key(
    case: tuple[KeyTemplate, list[list[object]]],
) -> None:
    template, rows = case
    seen: dict[str, list[tuple[str, object]]] = {}
    for values in rows:
        key = render(template, values)
        assert seen.setdefault(key, typed(values)) == typed(values), key


def test_the_issue_examples_no_longer_collide() -> None:
    key = compile_key("{$.a}:{$.b}")
    first = key.render({}, {"a": "x:y", "b": "z"}, "e")
    second = key.render({}, {"a": "x", "b": "y:z"}, "e")
    assert (first, second) == ("x%3Ay:z", "x:y%3Az")
    one = compile_key("{$.id}")
    assert one.render({}, {"id": 1}, "e") != one.render({}, {"id": "1"}, "e")
    assert one.render({}, {"id": True}, "e") != one.render({}, {"id": "true"}, "e")


@pytest.mark.parametrize(
    ("template", "doc", "headers", "event_id", "key"),
    [
        (
            "{event_id}",
            {},
            {},
            "72d3162e-cc78-11e3-81ab-4c9367dc0958",
            "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        ),
        ("{event_id}", {}, {}, "a%b:c/d 100%", "a%b:c/d 100%"),  # alone: exactly the id
        ("nightly-sync", {}, {}, "e", "nightly-sync"),
        ("{header:X-Tenant}", {}, {"x-tenant": "a:b%c"}, "e", "a:b%c"),
        ("pr-{$.n}-{$.sha}", {"n": 42, "sha": "ec26c3e5"}, {}, "e", "pr-42-ec26c3e5"),
        ("pr-{$.repo}-{$.n}", {"repo": "acme/my-app", "n": 7}, {}, "e", "pr-acme/my%2Dapp-7"),
        ("{$.repo}:{$.n}", {"repo": "acme/my-app", "n": -7}, {}, "e", "acme/my-app:-7"),
        ("{$.id}", {"id": "evt_1Q2w3E"}, {}, "e", "evt_1Q2w3E"),
        ("{$.id}", {"id": "42"}, {}, "e", "%s42"),
        ("{$.id}", {"id": 42}, {}, "e", "42"),
        ("{$.id}", {"id": "50%"}, {}, "e", "50%25"),
        ("{$.flag}", {"flag": False}, {}, "e", "false"),
        ("{$.x}", {"x": 1.5}, {}, "e", "1.5"),
    ],
)
def test_plain_values_stay_readable(
    template: str, doc: dict[str, object], headers: dict[str, str], event_id: str, key: str
) -> None:
    assert compile_key(template).render(headers, doc, event_id) == key


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{$.a}{$.b}", "need text between them"),
        ("{event_id}{header:X-A}", "need text between them"),
        ("{$.a}x{$.b}", "must start with a separator"),
        ("{$.a}7{$.b}", "must start with a separator"),
        ("{$.a}%{$.b}", "must start with a separator"),
        ("k" * (MAX_KEY_BYTES + 1), f"at most {MAX_KEY_BYTES} bytes"),
    ],
)
def test_templates_whose_values_could_run_together_are_refused(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compile_key(template)


# --------------------------------------------------------------------------- event ids


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(TRICKY, st.integers(min_value=-(2**80), max_value=2**80)), min_size=2, max_size=20
    )
)
def test_event_ids_from_json_keep_their_type(values: list[object]) -> None:
    source = compile_event_id(path=compile_path("$.id"))
    seen: dict[str, tuple[str, object]] = {}
    for value in values:
        got = source.resolve({}, {"id": value}, b"", exact=True)
        assert seen.setdefault(got, (type(value).__name__, value)) == (type(value).__name__, value)


def test_event_id_one_and_string_one_differ_and_header_ids_stay_as_sent() -> None:
    source = compile_event_id(path=compile_path("$.id"))
    assert source.resolve({}, {"id": 1}, b"") == "1"
    assert source.resolve({}, {"id": "1"}, b"") == "%s1"
    assert source.resolve({}, {"id": "evt_1"}, b"") == "evt_1"
    header = compile_event_id(header="X-Id")
    assert header.resolve({"x-id": "1"}, {}, b"") == "1"


def test_event_id_is_capped_like_a_key() -> None:
    source = compile_event_id(header="X-Id")
    assert source.resolve({"x-id": "e" * MAX_KEY_BYTES}, {}, b"") == "e" * MAX_KEY_BYTES
    with pytest.raises(ExtractError) as info:
        source.resolve({"x-id": "e" * (MAX_KEY_BYTES + 1)}, {}, b"")
    assert info.value.code == VALIDATION_EVENT_ID
    assert f"{MAX_KEY_BYTES + 1} bytes long; at most {MAX_KEY_BYTES}" in info.value.message


# --------------------------------------------------------------------------- big integers

BIG = 2**64  # orjson reads this as the double 1.8446744073709552e19


@pytest.mark.parametrize("base", [BIG, -(2**63) - 1, 10**30])
def test_integers_beyond_64_bits_give_neighbouring_events_their_own_key(base: int) -> None:
    trigger = _trigger(
        "t:\n  workflow: w\n  path: /h\n  verify: {scheme: none}\n"
        "  event_id: {jsonpath: $.id}\n  key: 'order-{$.order}'\n"
    )
    seen = set()
    for n in (base, base + 1):
        body = f'{{"id": {n}, "order": {n}}}'.encode()
        doc = parse_body(body, "application/json")
        got = trigger.extract({"content-type": "application/json"}, doc, body)
        assert (got.event_id, got.key) == (str(n), f"order-{n}")
        seen.add(got.key)
    assert len(seen) == 2


def test_a_form_payload_with_a_big_integer_is_read_exactly_too() -> None:
    trigger = _trigger(
        "t:\n  workflow: w\n  path: /h\n  verify: {scheme: none}\n  event_id: {jsonpath: $.id}\n"
    )
    body = f"payload=%7B%22id%22%3A{BIG + 1}%7D".encode()
    ctype = "application/x-www-form-urlencoded"
    got = trigger.extract({"content-type": ctype}, parse_body(body, ctype), body)
    assert got.event_id == str(BIG + 1)


def test_a_300_digit_id_is_exact_and_a_longer_number_is_a_clear_400() -> None:
    trigger = _trigger(
        "t:\n  workflow: w\n  path: /h\n  verify: {scheme: none}\n  event_id: {jsonpath: $.id}\n"
    )
    body = b'{"id": ' + b"9" * 300 + b"}"
    doc = parse_body(body, "application/json")
    assert trigger.extract({"content-type": "application/json"}, doc, body).event_id == "9" * 300
    # Past the double range orjson refuses the body outright: 400 VALIDATION_BODY.
    with pytest.raises(BodyError, match="number is infinity"):
        parse_body(b'{"id": ' + b"9" * 400 + b"}", "application/json")


# --------------------------------------------------------------------------- live vs dry run

CONFIG = """
version: 1
workflows:
  w: {steps: [go]}
triggers:
  by-part:
    workflow: w
    path: /h
    verify: {scheme: none}
    when: [{jsonpath: $.kind, equals: job}]
    event_id: {header: X-Id}
    key: "job-{$.name}"
  fixed:
    workflow: w
    path: /fixed
    verify: {scheme: none}
    event_id: {header: X-Id, missing: content_hash}
    key: fixed
"""


@pytest.fixture
async def live(redis: Redis) -> AsyncIterator[tuple[RunStore, dict[str, Trigger]]]:
    config = parse_config(CONFIG, file="keys.yaml")
    yield RunStore(redis, config, timeout=5.0), dict(config.triggers)


async def _both(
    live: tuple[RunStore, dict[str, Trigger]], path: str, headers: dict[str, str], body: bytes
) -> tuple[dict[str, object], str]:
    store, triggers = live
    matching = [t for t in triggers.values() if t.path == path]
    reply = await handle(store, matching, Headers(headers), headers.get("content-type"), body)
    report = await dry_run(store, matching, list(headers.items()), body, sign=False)
    return reply.body["results"][0], report["triggers"][0]["result"]


async def test_dry_run_applies_the_key_length_check_live_handling_applies(live) -> None:
    headers = {"content-type": "application/json", "x-id": "d-1"}
    body = json.dumps({"kind": "job", "name": "n" * MAX_KEY_BYTES}).encode()
    result, dry = await _both(live, "/h", headers, body)
    assert (result["outcome"], result["code"]) == ("refused", VALIDATION_EVENT_ID)
    assert f"at most {MAX_KEY_BYTES} allowed" in result["message"]
    assert dry == f"422: {result['code']}: {result['message']}"
    assert await live[0].redis.dbsize() == 0


async def test_dry_run_and_live_agree_on_an_event_id_too_long(live) -> None:
    headers = {"content-type": "application/json", "x-id": "i" * (MAX_KEY_BYTES + 1)}
    result, dry = await _both(live, "/h", headers, b'{"kind": "job", "name": "a"}')
    assert result["code"] == VALIDATION_EVENT_ID
    assert dry == f"422: {result['code']}: {result['message']}"


async def test_json_sent_as_a_form_is_ignored_with_the_reason(live) -> None:
    # What `curl -d '{...}'` sends: the body is JSON, the content type a form's.
    headers = {"content-type": "application/x-www-form-urlencoded", "x-id": "d-2"}
    result, dry = await _both(live, "/h", headers, b'{"kind": "job", "name": "a"}')
    assert (result["outcome"], result["message"]) == (
        "ignored",
        f"not matched: {FORM_LOOKS_LIKE_JSON}",
    )
    assert dry == f"ignored: {FORM_LOOKS_LIKE_JSON}"
    assert "send Content-Type: application/json" in FORM_LOOKS_LIKE_JSON
    # The same body as JSON is read and claimed.
    result, _ = await _both(
        live, "/h", {**headers, "content-type": "application/json"}, b'{"kind": "job", "name": "a"}'
    )
    assert result["outcome"] == "started"


async def test_a_trigger_reading_no_json_takes_a_form_body_as_before(live) -> None:
    headers = {"content-type": "application/x-www-form-urlencoded", "x-id": "d-3"}
    result, _ = await _both(live, "/fixed", headers, b"{}")
    assert result["outcome"] == "started"


# --------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Listener]:
    listener = Listener(tmp_path_factory.mktemp("keys-listen"), CONFIG, redis_url=module_redis.url)
    yield listener.start()
    listener.stop()


def test_listen_says_why_it_ignores_json_sent_as_a_form(http: httpx.Client) -> None:
    # The README's own mistake: `curl -d '{...}'` without a JSON content type.
    got = http.post("/h", content=b'{"kind": "job", "name": "a"}', headers={
        "Content-Type": "application/x-www-form-urlencoded", "X-Id": "f-1"})  # fmt: skip
    assert got.status_code == 200
    (result,) = got.json()["results"]
    assert (result["outcome"], result["message"]) == (
        "ignored",
        f"not matched: {FORM_LOOKS_LIKE_JSON}",
    )


def test_listen_and_triggers_test_give_one_answer_for_a_key_too_long(
    http: httpx.Client, gateway: Listener, module_redis: RedisServer, tmp_path: Path
) -> None:
    body = json.dumps({"kind": "job", "name": "n" * MAX_KEY_BYTES}).encode()
    got = http.post("/h", content=body, headers={"Content-Type": "application/json", "X-Id": "k-1"})
    assert got.status_code == 422
    (result,) = got.json()["results"]
    (tmp_path / "body.json").write_bytes(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    dry = subprocess.run(
        [sys.executable, "-m", "gateway", "triggers", "test", "--config", str(gateway.config_path),
         "--path", "/h", "--body", "body.json", "--header", "Content-Type: application/json",
         "--header", "X-Id: k-1", "--redis-url", module_redis.url, "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert dry.returncode == 1, dry.stderr  # the listener's answer is a 4xx
    (entry,) = json.loads(dry.stdout)["triggers"]
    assert entry["result"] == f"422: {result['code']}: {result['message']}"


def test_a_real_form_without_payload_gets_no_json_hint() -> None:
    doc = parse_body(b"a=1&b=2", "application/x-www-form-urlencoded")
    assert doc == {"a": "1", "b": "2"} and type(doc) is dict  # JSONPaths read it as before
    assert compile_path("$.a").get(doc) == (True, "1")
    odd = parse_body(b"{not json", "application/x-www-form-urlencoded")
    assert type(odd) is dict and odd == {"{not json": ""}


def _trigger(yaml_text: str) -> Trigger:
    config = parse_config(
        "version: 1\nworkflows: {w: {steps: [go]}}\ntriggers:\n" + _indent(yaml_text)
    )
    return next(iter(config.triggers.values()))


def _indent(text: str) -> str:
    return "".join(f"  {line}\n" for line in text.splitlines())
