"""Body parsing and the compiled extractors (gateway/ingest/: body, jsonpath, conditions,
idempotency, params). Pure: no Redis."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path as FsPath
from urllib.parse import urlencode

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonpath_ng.ext import parse as jsonpath_parse
from starlette.datastructures import Headers

from gateway.ingest.body import BodyError, parse_body
from gateway.ingest.conditions import compile_condition
from gateway.ingest.idempotency import (
    VALIDATION_EVENT_ID,
    ExtractError,
    compile_event_id,
    compile_key,
)
from gateway.ingest.jsonpath import compile_path
from gateway.ingest.params import ParamError, compile_params
from gateway.model.errors import RealmError

# Payloads kept with the tests (tests/payloads/README.md says where from).
PAYLOADS = FsPath(__file__).resolve().parent / "payloads"
NO_HEADERS = Headers({})


def fixture(name: str) -> bytes:
    return (PAYLOADS / name).read_bytes()


# --------------------------------------------------------------------------- parse_body


def test_parse_body_json() -> None:
    assert parse_body(b'{"a": [1, 2.5, null, true]}', "application/json") == {
        "a": [1, 2.5, None, True]
    }


def test_parse_body_json_is_the_default_for_other_content_types() -> None:
    assert parse_body(b"[1]", None) == [1]
    assert parse_body(b'"x"', "application/json; charset=utf-8") == "x"


def test_parse_body_github_form_payload() -> None:
    event = {"ref": "refs/heads/main", "after": "abc"}
    body = urlencode({"payload": json.dumps(event)}).encode()
    assert parse_body(body, "application/x-www-form-urlencoded") == event


def test_parse_body_form_without_payload_is_a_dict_of_fields() -> None:
    body = b"a=1&b=&c=x&c=y"
    doc = parse_body(body, "Application/X-WWW-Form-Urlencoded; charset=utf-8")
    assert doc == {"a": "1", "b": "", "c": ["x", "y"]}


def test_parse_body_form_payload_not_json() -> None:
    with pytest.raises(BodyError, match="form field 'payload' is not valid JSON"):
        parse_body(b"payload=%7Bnope", "application/x-www-form-urlencoded")


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"", "application/json", "empty body"),
        (b'{"a": "\xff"}', "application/json", "not valid UTF-8"),
        (b"a=\xff", "application/x-www-form-urlencoded", "not valid UTF-8"),
        (b"a=%ff", "application/x-www-form-urlencoded", "could not be parsed"),
        (b'{"a": ', "application/json", "not valid JSON"),
        (b"NaN", "application/json", "not valid JSON"),
    ],
)
def test_parse_body_rejects(body: bytes, content_type: str, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        parse_body(body, content_type)


def test_body_error_is_a_value_error() -> None:
    assert issubclass(BodyError, ValueError)


def test_parse_body_deep_nesting_is_a_body_error_not_recursion() -> None:
    with pytest.raises(BodyError):
        parse_body(b"[" * 100_000 + b"]" * 100_000, "application/json")
    nested = urlencode({"payload": "[" * 100_000}).encode()
    with pytest.raises(BodyError):
        parse_body(nested, "application/x-www-form-urlencoded")


def test_parse_body_huge_numbers() -> None:
    assert isinstance(parse_body(b"1" * 30, "application/json"), int | float)
    # Beyond a double's range orjson refuses the number: a 400, not a crash.
    with pytest.raises(BodyError):
        parse_body(b"1" * 400, "application/json")


# Bytes that look like JSON or a form often enough to reach past the first check.
_JSONISH = st.lists(
    st.sampled_from(
        [
            b"{",
            b"}",
            b"[",
            b"]",
            b'"',
            b":",
            b",",
            b"1",
            b"-",
            b"e9",
            b"\\u",
            b"\xff",
            b"payload=",
            b"%7B",
            b"&",
            b"null",
            b" ",
        ]
    ),
    max_size=40,
).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(
    body=st.binary(max_size=200) | _JSONISH,
    content_type=st.sampled_from([None, "application/json", "application/x-www-form-urlencoded"]),
)
def test_parse_body_fuzz_only_body_error(body: bytes, content_type: str | None) -> None:
    with contextlib.suppress(BodyError):
        parse_body(body, content_type)


# --------------------------------------------------------------------------- JSONPath

DOC = {
    "a": {"b": [{"c": 1}, {"c": None}], "x y": "space"},
    "ref": "refs/heads/main",
    "n": 0,
    "list": [10, 20],
    "s": "str",
}


@pytest.mark.parametrize(
    "expr",
    [
        "$.a.b",
        "$.a.b[0].c",
        "$.a.b[1].c",
        "$.a.b[5].c",
        "$['ref']",
        '$["a"]["x y"]',
        "$.list[1]",
        "$.nope",
        "$.s.nope",
        "$.list.nope",
        "$.a[0]",
        "$",
    ],
)
def test_fast_path_agrees_with_jsonpath_ng(expr: str) -> None:
    path = compile_path(expr)
    assert path.steps is not None, "expected the fast path"
    matches = jsonpath_parse(expr).find(DOC)
    expected = (True, matches[0].value) if matches else (False, None)
    assert path.get(DOC) == expected


@settings(max_examples=200, deadline=None)
@given(
    doc=st.recursive(
        st.none() | st.integers() | st.text(max_size=3),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)
        ),
        max_leaves=10,
    ),
    steps=st.lists(st.sampled_from([".a", ".b", "['c']", "[0]", "[1]"]), max_size=4),
)
def test_fast_path_agrees_with_jsonpath_ng_fuzzed(doc: object, steps: list[str]) -> None:
    expr = "$" + "".join(steps)
    path = compile_path(expr)
    assert path.steps is not None
    try:
        matches = jsonpath_parse(expr).find(doc)
    except (KeyError, TypeError):  # jsonpath_ng indexing a dict or a str: no match for us
        matches = []
    context = matches[0].context if matches else None
    if context is not None and isinstance(context.value, str):
        return  # jsonpath_ng indexes into strings; JSON documents never mean that
    expected = (True, matches[0].value) if matches else (False, None)
    assert path.get(doc) == expected


def test_complex_path_falls_back_to_jsonpath_ng_first_match() -> None:
    path = compile_path("$.a.b[*].c")
    assert path.steps is None
    assert path.get(DOC) == (True, 1)
    assert compile_path("$..nope").get(DOC) == (False, None)
    assert compile_path("$.list[?(@ > 15)]").get(DOC) == (True, 20)


def test_found_null_is_found() -> None:
    assert compile_path("$.a.b[1].c").get(DOC) == (True, None)


@pytest.mark.parametrize("expr", ["a.b", "", "$.a[", "$..", "$.a[?(@.b ==]"])
def test_invalid_path_is_value_error(expr: str) -> None:
    with pytest.raises(ValueError):
        compile_path(expr)


# --------------------------------------------------------------------------- conditions

GH = Headers({"X-GitHub-Event": "ping", "X-Count": "3"})


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"header": "X-GitHub-Event", "test": "equals", "operand": "ping"}, None),
        (
            {"header": "x-github-event", "test": "equals", "operand": "push"},
            "header x-github-event is 'ping', expected 'push'",
        ),
        ({"header": "X-Count", "test": "equals", "operand": 3}, None),
        ({"header": "X-GitHub-Event", "test": "in", "operand": ["push", "ping"]}, None),
        (
            {"header": "X-GitHub-Event", "test": "in", "operand": ["push", "release"]},
            "header X-GitHub-Event is 'ping', expected one of ['push', 'release']",
        ),
        ({"header": "X-GitHub-Event", "test": "exists", "operand": True}, None),
        (
            {"header": "X-Missing", "test": "exists", "operand": True},
            "header X-Missing is missing",
        ),
        ({"header": "X-Missing", "test": "exists", "operand": False}, None),
        (
            {"header": "X-GitHub-Event", "test": "exists", "operand": False},
            "header X-GitHub-Event is present",
        ),
        ({"header": "X-GitHub-Event", "test": "matches", "operand": "^pi"}, None),
        (
            {"header": "X-GitHub-Event", "test": "matches", "operand": "^push$"},
            "header X-GitHub-Event is 'ping', expected to match '^push$'",
        ),
        (
            {"header": "X-Missing", "test": "equals", "operand": "push"},
            "header X-Missing is missing, expected 'push'",
        ),
    ],
)
def test_header_conditions(kwargs: dict[str, object], reason: str | None) -> None:
    condition = compile_condition(**kwargs)  # type: ignore[arg-type]
    assert condition.check(GH, DOC) == reason


@pytest.mark.parametrize(
    ("expr", "test", "operand", "reason"),
    [
        ("$.ref", "equals", "refs/heads/main", None),
        ("$.ref", "equals", "main", "jsonpath $.ref is 'refs/heads/main', expected 'main'"),
        ("$.n", "equals", 0, None),
        ("$.n", "equals", False, "jsonpath $.n is 0, expected false"),  # JSON: 0 is not false
        ("$.n", "equals", "0", "jsonpath $.n is 0, expected '0'"),
        ("$.list", "equals", [10, 20], None),
        ("$.ref", "in", ["refs/heads/main", "refs/heads/dev"], None),
        (
            "$.ref",
            "in",
            ["refs/heads/dev"],
            "jsonpath $.ref is 'refs/heads/main', expected one of ['refs/heads/dev']",
        ),
        ("$.a.b[1].c", "exists", True, None),  # present with a null value
        ("$.zzz", "exists", True, "jsonpath $.zzz is missing"),
        ("$.zzz", "exists", False, None),
        ("$.ref", "matches", "heads/ma", None),
        ("$.n", "matches", "0", "jsonpath $.n is 0, expected to match '0'"),  # not a str
        ("$.zzz", "equals", 1, "jsonpath $.zzz is missing, expected 1"),
    ],
)
def test_jsonpath_conditions(expr: str, test: str, operand: object, reason: str | None) -> None:
    condition = compile_condition(path=compile_path(expr), test=test, operand=operand)  # type: ignore[arg-type]
    assert condition.check(NO_HEADERS, DOC) == reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"header": "X", "test": "matches", "operand": "("}, "invalid regular expression"),
        ({"header": "X", "test": "matches", "operand": 5}, "regular expression string"),
        ({"header": "X", "test": "exists", "operand": "yes"}, "true or false"),
        ({"header": "X", "test": "in", "operand": "push"}, "non-empty list"),
        ({"header": "X", "test": "in", "operand": []}, "non-empty list"),
        ({"header": "X", "test": "equals", "operand": None}, "header values are strings"),
        ({"header": "bad name", "test": "equals", "operand": "x"}, "not a valid header name"),
        ({"test": "equals", "operand": "x"}, "exactly one source"),
    ],
)
def test_condition_compile_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compile_condition(**kwargs)  # type: ignore[arg-type]


def test_condition_rejects_yaml_dates() -> None:
    import datetime

    with pytest.raises(ValueError, match="quote dates"):
        compile_condition(
            path=compile_path("$.d"), test="equals", operand=datetime.date(2024, 1, 1)
        )


# --------------------------------------------------------------------------- event id


def test_event_id_from_header() -> None:
    source = compile_event_id(header="X-GitHub-Delivery")
    headers = Headers({"x-github-delivery": "d-1"})
    assert source.resolve(headers, {}, b"{}") == "d-1"
    assert source.describe() == "header X-GitHub-Delivery"


def test_event_id_from_jsonpath_int_becomes_str() -> None:
    source = compile_event_id(path=compile_path("$.id"))
    assert source.resolve(NO_HEADERS, {"id": "evt_1"}, b"") == "evt_1"
    assert source.resolve(NO_HEADERS, {"id": 42}, b"") == "42"


@pytest.mark.parametrize("doc", [{}, {"id": ""}, {"id": None}, {"id": True}, {"id": {}}])
def test_event_id_missing_is_rejected(doc: object) -> None:
    source = compile_event_id(path=compile_path("$.id"))
    with pytest.raises(ExtractError) as info:
        source.resolve(NO_HEADERS, doc, b"{}")
    assert info.value.code == VALIDATION_EVENT_ID
    assert "jsonpath $.id" in info.value.message
    assert isinstance(info.value, RealmError)


def test_event_id_empty_header_is_missing() -> None:
    source = compile_event_id(header="X-Id")
    with pytest.raises(ExtractError, match="header X-Id"):
        source.resolve(Headers({"x-id": ""}), {}, b"{}")


def test_event_id_content_hash() -> None:
    source = compile_event_id(path=compile_path("$.id"), missing="content_hash")
    body = b'{"no": "id"}'
    assert source.resolve(NO_HEADERS, {"no": "id"}, body) == hashlib.sha256(body).hexdigest()
    assert source.resolve(NO_HEADERS, {"id": "x"}, body) == "x"
    assert source.describe() == "jsonpath $.id (else content hash)"


def test_event_id_compile_errors() -> None:
    with pytest.raises(ValueError, match="exactly one source"):
        compile_event_id()
    with pytest.raises(ValueError, match="reject, content_hash"):
        compile_event_id(header="X-Id", missing="ignore")


# --------------------------------------------------------------------------- key template


def test_key_template_pull_request() -> None:
    key = compile_key("pr-{$.pull_request.number}-{$.pull_request.head.sha}")
    doc = {"pull_request": {"number": 7, "head": {"sha": "abc123"}}}
    assert key.render(NO_HEADERS, doc, "evt") == "pr-7-abc123"


def test_key_template_pull_request_fixture() -> None:
    body = fixture("github/pull_request.opened.json")
    doc = parse_body(body, "application/json")
    key = compile_key("pr-{$.pull_request.number}-{$.pull_request.head.sha}")
    assert key.render(NO_HEADERS, doc, "evt") == "pr-42-3c8e1f5a9d2b7c4e0a6f8b1d3e5c7a9f2b4d6e80"


def test_key_template_parts_and_escapes() -> None:
    headers = Headers({"X-Tenant": "acme"})
    assert compile_key("{event_id}").render(headers, {}, "e1") == "e1"
    assert compile_key("nightly").render(headers, {}, "e1") == "nightly"
    key = compile_key("{header:X-Tenant}/{{literal}}/{event_id}/{$.flag}")
    assert key.render(headers, {"flag": True}, "e1") == "acme/{literal}/e1/true"


@pytest.mark.parametrize(
    ("template", "doc", "headers"),
    [
        ("{$.missing}", {}, {}),
        ("{$.obj}", {"obj": {"a": 1}}, {}),
        ("{$.null}", {"null": None}, {}),
        ("{$.empty}", {"empty": ""}, {}),
        ("{header:X-Tenant}", {}, {}),
    ],
)
def test_key_part_without_value_is_extract_error(
    template: str, doc: object, headers: dict[str, str]
) -> None:
    with pytest.raises(ExtractError) as info:
        compile_key(template).render(Headers(headers), doc, "e1")
    assert info.value.code == VALIDATION_EVENT_ID
    assert template in info.value.message


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("", "non-empty"),
        ("{nope}", "unknown placeholder {nope}"),
        ("{event_id", "unclosed"),
        ("a}b", "unmatched"),
        ("{header:}", "not a valid header name"),
        ("{$.a[}", "invalid JSONPath"),
    ],
)
def test_key_compile_errors(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compile_key(template)


# --------------------------------------------------------------------------- params


def test_params_jsonpath_header_literal_and_missing() -> None:
    spec = compile_params(
        {
            "repo": "$.repository.full_name",
            "sha": "$.after",
            "hook": {"header": "X-GitHub-Hook-ID"},
            "absent_header": {"header": "X-Nope"},
            "env": "prod",
            "retries": 3,
            "tags": ["a", "b"],
            "nothing": None,
        }
    )
    doc = {"repository": {"full_name": "o/r"}}
    params = spec.extract(Headers({"X-GitHub-Hook-ID": "9"}), doc)
    assert params == {
        "repo": "o/r",
        "hook": "9",
        "env": "prod",
        "retries": 3,
        "tags": ["a", "b"],
        "nothing": None,
    }
    assert list(params) == ["repo", "hook", "env", "retries", "tags", "nothing"]  # YAML order
    params["tags"].append("mutated")  # type: ignore[attr-defined]
    assert spec.extract(NO_HEADERS, doc)["tags"] == ["a", "b"]


def test_params_compile_errors_name_the_entry() -> None:
    with pytest.raises(ParamError) as info:
        compile_params({"ok": "$.a", "sha": "$.a["})
    assert info.value.name == "sha"
    with pytest.raises(ParamError) as info:
        compile_params({"h": {"header": "bad name"}})
    assert info.value.name == "h"
