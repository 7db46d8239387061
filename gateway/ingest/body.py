"""A delivery's body, parsed: JSON, or a form (GitHub's form-encoded ``payload``, or
fields), with the hint when a form body was meant as JSON.

Pure code: no I/O. The body is untrusted input, so ``parse_body`` raises
``BodyError`` and nothing else.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl

import orjson

__all__ = ["FORM_LOOKS_LIKE_JSON", "BodyError", "FormFields", "parse_body"]

# A form body is attacker-sized; cap the field count so parsing stays cheap.
_MAX_FORM_FIELDS = 1000
FORM_LOOKS_LIKE_JSON = (
    "the body was sent as application/x-www-form-urlencoded but looks like JSON; "
    "send Content-Type: application/json"
)


class BodyError(ValueError):
    """The delivery body cannot be parsed (empty, not UTF-8, not JSON): a 400."""


class FormFields(dict[str, Any]):
    """A form body's fields. ``json_hint`` is set when the body has no ``payload``
    field but reads as JSON (what ``curl -d`` sends): the sender meant JSON."""

    json_hint: str | None = None


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
