"""Body parsing and compiled extractors: JSONPath, ``when`` conditions, event id, key, params.

Pure code: no I/O. Everything here is compiled once at start-up (by
``gateway.triggers``); the request path only evaluates. Compile functions take
already-typed values and raise ``ValueError`` with the reason; turning YAML into
those values, and reasons into ``ConfigError`` with a field name, is the
caller's job.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args
from urllib.parse import parse_qsl

import orjson
from jsonpath_ng import JSONPath
from jsonpath_ng.ext import parse as jsonpath_parse

from gateway.errors import RealmError
from gateway.runs import MAX_KEY_BYTES

__all__ = [
    "VALIDATION_EVENT_ID",
    "BodyError",
    "Condition",
    "EventIdSource",
    "ExtractError",
    "FormFields",
    "HeaderLookup",
    "KeyTemplate",
    "Missing",
    "ParamError",
    "ParamKind",
    "ParamsSpec",
    "Path",
    "Test",
    "compile_condition",
    "compile_event_id",
    "compile_key",
    "compile_params",
    "compile_path",
    "is_header_name",
    "parse_body",
]

VALIDATION_EVENT_ID = "VALIDATION_EVENT_ID"

Test = Literal["equals", "in", "exists", "matches"]
Missing = Literal["reject", "content_hash"]
TESTS: tuple[str, ...] = get_args(Test)
MISSING: tuple[str, ...] = get_args(Missing)

# RFC 9110 token characters: what a header field name may contain.
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# A form body is attacker-sized; cap the field count so parsing stays cheap.
_MAX_FORM_FIELDS = 1000
# Values quoted in reasons are the sender's data: keep log lines and replies short.
_MAX_SHOWN = 80
# orjson keeps integers in [-2**63, 2**64) exact and turns larger ones into the
# nearest double; a double this large in an id or key part may be such an integer.
_INEXACT_FROM = 2.0**63
FORM_LOOKS_LIKE_JSON = (
    "the body was sent as application/x-www-form-urlencoded but looks like JSON; "
    "send Content-Type: application/json"
)


class BodyError(ValueError):
    """The delivery body cannot be parsed (empty, not UTF-8, not JSON): a 400."""


class ExtractError(RealmError):
    """A matched delivery lacks what its trigger needs (event id, key part): a 422."""


class InexactNumber(Exception):
    """A number an id or key part needs may have lost digits in the fast parse:
    ``Trigger.extract`` parses the body again with exact integers."""


class FormFields(dict[str, Any]):
    """A form body's fields. ``json_hint`` is set when the body has no ``payload``
    field but reads as JSON (what ``curl -d`` sends): the sender meant JSON."""

    json_hint: str | None = None


class HeaderLookup(Protocol):
    """What extractors need from request headers: ``starlette.datastructures.Headers``.

    Names are looked up lower-cased, so a plain dict with lower-case keys works too.
    """

    def get(self, key: str, default: None = None) -> str | None: ...


def is_header_name(name: object) -> bool:
    """True for a non-empty string of RFC 9110 token characters."""
    return isinstance(name, str) and bool(name) and all(c in _TCHARS for c in name)


# --------------------------------------------------------------------------- body


def parse_body(body: bytes, content_type: str | None, *, exact: bool = False) -> object:
    """Decode a delivery body: JSON, or a form (GitHub's form-encoded ``payload``).

    ``exact``: every integer exactly as written, however long (slower; orjson
    turns integers beyond 64 bits into doubles). Raises ``BodyError`` and nothing
    else: the body is untrusted input, and a crash here would turn a bad request
    into a 500.
    """
    if not body:
        raise BodyError("empty body")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    try:
        if media == "application/x-www-form-urlencoded":
            return _parse_form(body, exact=exact)
        return _parse_json(body, what="body", exact=exact)
    except BodyError:
        raise
    except Exception as exc:  # see docstring: no other exception may escape
        raise BodyError(f"body could not be parsed ({type(exc).__name__})") from None


def _parse_json(data: bytes, *, what: str, exact: bool = False) -> object:
    try:
        # orjson caps nesting at 1024 levels itself, so deep input is a
        # JSONDecodeError, never a RecursionError.
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise BodyError(f"{what} is not valid UTF-8") from None
        raise BodyError(f"{what} is not valid JSON: {exc}") from None
    if not exact:
        return doc
    # orjson accepted the text, so it is valid UTF-8 JSON: only the numbers differ.
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise BodyError(f"{what} is nested too deeply") from None
    except ValueError as exc:  # never seen: orjson refused what json would
        raise BodyError(f"{what} holds a number that cannot be read exactly: {exc}") from None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _parse_form(body: bytes, *, exact: bool = False) -> object:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("body is not valid UTF-8") from None
    try:
        pairs = parse_qsl(
            text, keep_blank_values=True, errors="strict", max_num_fields=_MAX_FORM_FIELDS
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(f"form body could not be parsed: {exc}") from None
    fields: dict[str, Any] = {}
    for name, value in pairs:
        previous = fields.get(name)
        if previous is None:
            fields[name] = value
        elif isinstance(previous, list):
            previous.append(value)
        else:
            # A repeated field keeps every value, in order, rather than silently one.
            fields[name] = [previous, value]
    payload = fields.get("payload")
    if isinstance(payload, str):
        # GitHub's form content type: the whole event is JSON in `payload`.
        return _parse_json(payload.encode("utf-8"), what="form field 'payload'", exact=exact)
    if body.lstrip()[:1] in (b"{", b"["):
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            return fields
        # Only then a FormFields: JSONPath look-ups take plain dicts (type() is dict).
        form = FormFields(fields)
        form.json_hint = FORM_LOOKS_LIKE_JSON
        return form
    return fields


# --------------------------------------------------------------------------- JSONPath

# One step of a simple path: `.name`, `[0]`, `['key']` or `["key"]`.
_STEP = re.compile(r"""\.([A-Za-z_][A-Za-z0-9_]*)|\[([0-9]+)\]|\['([^'\\]*)'\]|\["([^"\\]*)"\]""")


@dataclass(frozen=True, slots=True)
class Path:
    """A compiled JSONPath. ``get`` returns ``(found, value)`` for the first match."""

    expr: str
    # Simple paths are direct look-ups (str = mapping key, int = list index);
    # everything else goes through jsonpath_ng, which is far slower.
    steps: tuple[str | int, ...] | None = field(repr=False, compare=False)
    compiled: JSONPath | None = field(repr=False, compare=False)

    def get(self, doc: object) -> tuple[bool, object]:
        if self.steps is not None:
            value = doc
            for step in self.steps:
                if isinstance(step, int):
                    if type(value) is not list or step >= len(value):
                        return False, None
                    value = value[step]
                else:
                    if type(value) is not dict or step not in value:
                        return False, None
                    value = value[step]
            return True, value
        assert self.compiled is not None
        try:
            matches = self.compiled.find(doc)
        except Exception:  # a filter over odd data (str > int) is no match
            return False, None
        if not matches:
            return False, None
        return True, matches[0].value


def compile_path(expr: str) -> Path:
    """Compile a JSONPath starting with ``$``. Raises ValueError with the reason."""
    if not isinstance(expr, str) or not expr.startswith("$"):
        raise ValueError(f"JSONPath {expr!r} must start with '$'")
    steps = _simple_steps(expr)
    if steps is not None:
        return Path(expr=expr, steps=steps, compiled=None)
    try:
        compiled = jsonpath_parse(expr)
    except Exception as exc:  # jsonpath_ng raises several unrelated types
        raise ValueError(f"invalid JSONPath {expr!r}: {exc}") from None
    return Path(expr=expr, steps=None, compiled=compiled)


def _simple_steps(expr: str) -> tuple[str | int, ...] | None:
    steps: list[str | int] = []
    pos = 1
    while pos < len(expr):
        m = _STEP.match(expr, pos)
        if m is None:
            return None
        name, index, single, double = m.groups()
        if index is not None:
            steps.append(int(index))
        else:
            steps.append(next(s for s in (name, single, double) if s is not None))
        pos = m.end()
    return tuple(steps)


# --------------------------------------------------------------------------- conditions


@dataclass(frozen=True, slots=True)
class Condition:
    """One ``when`` item: a source (header or JSONPath) and one test."""

    header: str | None  # exactly one of header / path is set
    path: Path | None
    test: Test
    operand: object
    pattern: re.Pattern[str] | None = field(default=None, repr=False, compare=False)

    @property
    def source(self) -> str:
        return f"header {self.header}" if self.path is None else f"jsonpath {self.path.expr}"

    def check(self, headers: HeaderLookup, doc: object) -> str | None:
        """None when the condition holds, else a reason fit for a log line or reply."""
        found: bool
        value: object
        if self.header is not None:
            raw = headers.get(self.header.lower())
            found, value = raw is not None, raw
        else:
            assert self.path is not None
            found, value = self.path.get(doc)
        if self.test == "exists":
            if found == self.operand:
                return None
            return f"{self.source} is missing" if self.operand else f"{self.source} is present"
        if not found:
            return f"{self.source} is missing, {self._expected()}"
        if self._holds(value):
            return None
        return f"{self.source} is {_show(value)}, {self._expected()}"

    def _holds(self, value: object) -> bool:
        if self.test == "matches":
            assert self.pattern is not None
            return isinstance(value, str) and self.pattern.search(value) is not None
        if self.header is not None:
            # Header operands were turned to strings at compile time.
            if self.test == "equals":
                return value == self.operand
            return value in self.operand  # type: ignore[operator]
        if self.test == "equals":
            return _json_equal(value, self.operand)
        return any(_json_equal(value, item) for item in self.operand)  # type: ignore[attr-defined]

    def _expected(self) -> str:
        if self.test == "equals":
            return f"expected {_show(self.operand)}"
        if self.test == "in":
            shown = ", ".join(_show(v) for v in self.operand)  # type: ignore[attr-defined]
            return f"expected one of [{shown}]"
        return f"expected to match {_show(self.operand)}"


def compile_condition(
    *, header: str | None = None, path: Path | None = None, test: Test, operand: object
) -> Condition:
    """Build a condition. Raises ValueError when the operand does not fit the test."""
    if (header is None) == (path is None):
        raise ValueError("needs exactly one source: header or jsonpath")
    if header is not None and not is_header_name(header):
        raise ValueError(f"{header!r} is not a valid header name")
    if test == "exists":
        if not isinstance(operand, bool):
            raise ValueError("must be true or false")
        return Condition(header, path, test, operand)
    if test == "matches":
        if not isinstance(operand, str):
            raise ValueError("must be a regular expression string")
        try:
            pattern = re.compile(operand)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {operand!r}: {exc}") from None
        return Condition(header, path, test, operand, pattern)
    if test == "in":
        if not isinstance(operand, list) or not operand:
            raise ValueError("must be a non-empty list of values")
        values = tuple(_operand(v, header is not None) for v in operand)
        return Condition(header, path, test, values)
    if test == "equals":
        return Condition(header, path, test, _operand(operand, header is not None))
    raise ValueError(f"unknown test {test!r}; one of {', '.join(TESTS)}")


def _operand(value: object, for_header: bool) -> object:
    if not _is_json(value):
        raise ValueError(
            f"{value!r} is not a JSON value (quote dates and times in YAML: '2024-01-01')"
        )
    if not for_header:
        return value
    # Header values are strings: compare with the text a sender would write.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError("header values are strings; compare with a string or number")


def _json_equal(a: object, b: object) -> bool:
    # Python says True == 1; JSON does not.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _is_json(value: object, depth: int = 0) -> bool:
    if depth > 100:
        return False
    if value is None or isinstance(value, str | bool | int):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(_is_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v, depth + 1) for k, v in value.items())
    return False


def _show(value: object) -> str:
    if isinstance(value, str):
        text = f"'{value}'"
    else:
        try:
            text = orjson.dumps(value).decode()
        except TypeError:
            text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


# --------------------------------------------------------------------------- encoding

# Key and event id text must name one event only (README, "Keys"): two different
# values must never give the same text. Each substituted value is encoded on its
# own, keeping plain strings as they are:
#  - ``%`` and the template's separators (the first character of the text between
#    two placeholders) are percent-encoded, byte by byte of their UTF-8;
#  - a JSON number or boolean is written as its JSON text, and a JSON *string*
#    that reads as one is prefixed with ``%s``, so 42 and "42" stay apart.
# Decoding is then unambiguous: a value ends at the first unescaped separator;
# ``%s`` starts a string; else a value that decodes to JSON number/boolean text is
# one, anything else is a string.
_READS_AS_JSON = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false")
_STRING_MARK = "%s"
_JSON_STARTS = frozenset("-0123456789tf")  # what _READS_AS_JSON can start with
# The few characters one value escapes, fixed per template part (None: none).
# Looking for each of them in the value (`c in text`, C speed) keeps the usual
# case, a value with none of them, as cheap as a copy.
Escaper = tuple[tuple[str, str], ...] | None  # (character, its encoding), '%' first


def _escaper(chars: set[str] | frozenset[str]) -> Escaper:
    if not chars:
        return None
    # '%' first: the encodings of the others hold a '%' that must stay as it is.
    ordered = sorted(chars, key=lambda c: (c != "%", c))
    return tuple(
        (c, "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))) for c in ordered
    )


_PERCENT = _escaper({"%"})


def _escape(text: str, escaper: Escaper) -> str:
    """``text`` with each character of ``escaper`` percent-encoded (UTF-8, upper-case hex)."""
    if escaper is not None:
        for char, encoded in escaper:
            if char in text:
                text = text.replace(char, encoded)
    return text


def _typed_text(value: object, escaper: Escaper) -> str | None:
    """A JSON scalar as key text, its type kept apart (see above); None for no value.

    ``escaper`` must match ``%``. Objects and lists have no text: a key holding
    one would depend on key order.
    """
    if isinstance(value, str):
        if not value:
            return None
        if value[0] in _JSON_STARTS and _READS_AS_JSON.fullmatch(value):
            return _STRING_MARK + _escape(value, escaper)
        return _escape(value, escaper)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int):
        text = str(value)  # exact however long: orjson.dumps refuses over 64 bits
    elif isinstance(value, float):
        text = orjson.dumps(value).decode()
    else:
        return None
    return _escape(text, escaper)


def _maybe_inexact(value: object) -> bool:
    return type(value) is float and abs(value) >= _INEXACT_FROM


def _too_long(text: str) -> int:
    """The UTF-8 size of ``text`` when over MAX_KEY_BYTES, else 0."""
    if len(text) <= MAX_KEY_BYTES // 4:  # four bytes a character at most
        return 0
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > MAX_KEY_BYTES else 0


def _length_error(what: str, size: int) -> ExtractError:
    return ExtractError(
        VALIDATION_EVENT_ID, f"{what} is {size} bytes long; at most {MAX_KEY_BYTES} allowed"
    )


# --------------------------------------------------------------------------- event id


@dataclass(frozen=True, slots=True)
class EventIdSource:
    """Where a delivery's event id comes from, and what to do when it is absent."""

    header: str | None  # exactly one of header / path is set
    path: Path | None
    missing: Missing = "reject"

    def describe(self) -> str:
        return (
            f"{self._where} (else content hash)" if self.missing == "content_hash" else self._where
        )

    @property
    def _where(self) -> str:
        return f"header {self.header}" if self.path is None else f"jsonpath {self.path.expr}"

    def resolve(
        self, headers: HeaderLookup, doc: object, body: bytes, *, exact: bool = False
    ) -> str:
        """The event id; raises ExtractError (VALIDATION_EVENT_ID) when absent and rejected
        or longer than a key, and InexactNumber when ``doc`` may have rounded it."""
        text: str | None
        if self.header is not None:
            # A header is text only: its value is the id, as sent.
            text = headers.get(self.header.lower()) or None
        else:
            assert self.path is not None
            value = self.path.get(doc)[1]
            if not exact and _maybe_inexact(value):
                raise InexactNumber
            # Strings and integers only; "1" and 1 stay two ids ("%s1" and "1").
            ok = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
            text = _typed_text(value, _PERCENT) if ok else None
        if text is not None:
            size = _too_long(text)
            if size:
                raise _length_error(f"event id ({self._where})", size)
            return text
        if self.missing == "content_hash":
            # Same bytes, same id: a redelivery of an id-less body still deduplicates.
            return hashlib.sha256(body).hexdigest()
        where = self._where
        raise ExtractError(
            VALIDATION_EVENT_ID, f"event id is missing: {where} has no string or integer value"
        )


def compile_event_id(
    *, header: str | None = None, path: Path | None = None, missing: str = "reject"
) -> EventIdSource:
    if (header is None) == (path is None):
        raise ValueError("needs exactly one source: header or jsonpath")
    if header is not None and not is_header_name(header):
        raise ValueError(f"{header!r} is not a valid header name")
    if missing not in MISSING:
        raise ValueError(f"must be one of {', '.join(MISSING)}")
    return EventIdSource(header, path, missing)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- key template

# (kind, text as written, what to look up, what its value escapes): literal text,
# the event id, a header name or a compiled JSONPath.
_Part = tuple[Literal["text", "event_id", "header", "path"], str, str | Path | None, Escaper]


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """A compiled idempotency-key template such as ``pr-{$.number}-{header:X-Id}``."""

    template: str
    parts: tuple[_Part, ...] = field(repr=False, compare=False)

    def render(
        self, headers: HeaderLookup, doc: object, event_id: str, *, exact: bool = False
    ) -> str:
        """The key; raises ExtractError (VALIDATION_EVENT_ID) when a placeholder has no
        value or the key is too long, and InexactNumber when ``doc`` may have rounded
        a number it needs."""
        if self.template == "{event_id}":
            return event_id  # the default key; resolve() bounded its length already
        out: list[str] = []
        for kind, text, ref, escaper in self.parts:
            value: str | None
            if kind == "text":
                out.append(text)
                continue
            if kind == "event_id":
                value = _escape(event_id, escaper)
            elif isinstance(ref, Path):
                found = ref.get(doc)[1]
                if not exact and _maybe_inexact(found):
                    raise InexactNumber
                value = _typed_text(found, escaper)
            else:
                raw = headers.get(ref.lower())  # type: ignore[union-attr]
                value = _escape(raw, escaper) if raw else None
            if value is None:
                raise ExtractError(
                    VALIDATION_EVENT_ID,
                    f"key part {{{text}}} of key template {self.template!r} has no value",
                )
            out.append(value)
        key = "".join(out)
        size = _too_long(key)
        if size:
            raise _length_error(f"the key of template {_show(self.template)}", size)
        return key


def compile_key(template: str) -> KeyTemplate:
    """Compile a key template. Raises ValueError for bad braces, unknown placeholders,
    and placeholders whose values could not be told apart (see _escape)."""
    if not isinstance(template, str) or not template:
        raise ValueError("must be a non-empty string such as '{event_id}'")
    parts: list[tuple[str, str, str | Path | None]] = []
    text: list[str] = []
    pos = 0
    while pos < len(template):
        ch = template[pos]
        if template.startswith(("{{", "}}"), pos):
            text.append(ch)
            pos += 2
        elif ch == "}":
            raise ValueError(f"unmatched '}}' at position {pos}; write '}}}}' for a literal brace")
        elif ch == "{":
            end = template.find("}", pos + 1)
            if end < 0:
                raise ValueError(f"unclosed '{{' at position {pos}")
            if text:
                parts.append(("text", "".join(text), None))
                text = []
            parts.append(_placeholder(template[pos + 1 : end]))
            pos = end + 1
        else:
            text.append(ch)
            pos += 1
    if text:
        parts.append(("text", "".join(text), None))
    return KeyTemplate(template, _with_escapes(parts))


def _with_escapes(parts: list[tuple[str, str, str | Path | None]]) -> tuple[_Part, ...]:
    """Each part with the characters its value must escape; refuses templates whose
    values could run into each other."""
    holes = [i for i, (kind, _, _) in enumerate(parts) if kind != "text"]
    if not holes:
        literal = parts[0][1]
        if len(literal.encode()) > MAX_KEY_BYTES:
            raise ValueError(f"a fixed key is at most {MAX_KEY_BYTES} bytes")
    separators: set[str] = set()
    for here, after in itertools.pairwise(holes):
        name = parts[here][1]
        if after == here + 1:
            raise ValueError(
                f"{{{name}}} and {{{parts[after][1]}}} need text between them "
                "(such as ':'), or their values could run into each other"
            )
        first = parts[here + 1][1][0]
        if first == "%" or (first.isascii() and first.isalnum()):
            raise ValueError(
                f"the text after {{{name}}} must start with a separator such as ':', '-' or "
                f"'/', not {first!r}, so that where its value ends is never in doubt"
            )
        separators.add(first)
    # Typed (JSONPath) values use the %s mark, so % is always escaped in them; the
    # event id and headers are text, left as sent when there is no separator.
    typed = _escaper({"%", *separators})
    text_only = typed if separators else None
    out: list[_Part] = []
    for kind, text, ref in parts:
        escaper = None if kind == "text" else typed if kind == "path" else text_only
        out.append((kind, text, ref, escaper))  # type: ignore[arg-type]
    return tuple(out)


def _placeholder(inner: str) -> tuple[str, str, str | Path | None]:
    if inner == "event_id":
        return ("event_id", inner, None)
    if inner.startswith("header:"):
        name = inner[len("header:") :].strip()
        if not is_header_name(name):
            raise ValueError(f"{{{inner}}}: {name!r} is not a valid header name")
        return ("header", f"header:{name}", name)
    if inner.startswith("$"):
        return ("path", inner, compile_path(inner))
    raise ValueError(
        f"unknown placeholder {{{inner}}}; use {{event_id}}, {{header:Name}} or {{$.json.path}}"
    )


# --------------------------------------------------------------------------- params


ParamKind = Literal["path", "header", "literal"]


@dataclass(frozen=True, slots=True)
class ParamsSpec:
    """Compiled ``params`` in YAML order: (name, kind, Path | header name | literal)."""

    entries: tuple[tuple[str, ParamKind, object], ...] = ()

    def extract(self, headers: HeaderLookup, doc: object) -> dict[str, object]:
        """The params; a JSONPath or header with no value is left out (the schema decides)."""
        params: dict[str, object] = {}
        for name, kind, source in self.entries:
            if kind == "path":
                found, value = source.get(doc)  # type: ignore[attr-defined]
                if found:
                    params[name] = value
            elif kind == "header":
                raw = headers.get(source.lower())  # type: ignore[attr-defined]
                if raw is not None:
                    params[name] = raw
            else:
                # Copied so a caller mutating one run's params cannot change the next.
                params[name] = copy.deepcopy(source) if isinstance(source, list | dict) else source
        return params


def compile_params(spec: Mapping[str, object]) -> ParamsSpec:
    """Compile ``params``: a str starting with ``$`` is JSONPath, ``{header: Name}`` a
    header, any other JSON value a literal. Raises ``ParamError`` naming the entry.
    """
    entries: list[tuple[str, ParamKind, object]] = []
    for name, value in spec.items():
        try:
            if isinstance(value, str) and value.startswith("$"):
                entries.append((name, "path", compile_path(value)))
            elif isinstance(value, dict) and list(value) == ["header"]:
                header = value["header"]
                if not is_header_name(header):
                    raise ValueError(f"{header!r} is not a valid header name")
                entries.append((name, "header", header))
            elif _is_json(value):
                entries.append((name, "literal", value))
            else:
                raise ValueError(
                    f"{_show(value)} is not a JSONPath, {{header: Name}} or JSON value "
                    "(quote dates and times in YAML)"
                )
        except ValueError as exc:
            raise ParamError(name, str(exc)) from None
    return ParamsSpec(tuple(entries))


class ParamError(ValueError):
    """A bad ``params`` entry; ``name`` says which."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(reason)
        self.name = name
        self.reason = reason
