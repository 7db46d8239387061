"""A delivery's event id and idempotency key: where each comes from (a header or a
JSONPath), the key template, and how each value becomes key text that names one
event only.

Pure code: no I/O. Sources and templates are compiled once at start-up (by
``gateway.ingest.triggers``); the request path only evaluates them. The compile
functions raise ``ValueError`` with the reason; turning it into a ``ConfigError``
with a field name is the caller's job.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

import orjson

from gateway.ingest.jsonpath import Path, compile_path
from gateway.ingest.values import HeaderLookup, show
from gateway.model.errors import RealmError
from gateway.signatures.schemes import is_header_name
from gateway.store.runs import MAX_KEY_BYTES

__all__ = [
    "MISSING",
    "VALIDATION_EVENT_ID",
    "EventIdSource",
    "ExtractError",
    "InexactNumber",
    "KeyTemplate",
    "Missing",
    "compile_event_id",
    "compile_key",
]

VALIDATION_EVENT_ID = "VALIDATION_EVENT_ID"

Missing = Literal["reject", "content_hash"]
MISSING: tuple[str, ...] = get_args(Missing)

# orjson keeps integers in [-2**63, 2**64) exact and turns larger ones into the
# nearest double; a double this large in an id or key part may be such an integer.
_INEXACT_FROM = 2.0**63


class ExtractError(RealmError):
    """A matched delivery lacks what its trigger needs (event id, key part): a 422."""


class InexactNumber(Exception):
    """A number an id or key part needs may have lost digits in the fast parse:
    ``Trigger.extract`` parses the body again with exact integers."""


# Key and event id text must name one event only (docs/triggers.md, "Keys and event
# ids name one event"): two different values must never give the same text. Each
# substituted value is encoded on its own, keeping plain strings as they are:
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
            raise _length_error(f"the key of template {show(self.template)}", size)
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
