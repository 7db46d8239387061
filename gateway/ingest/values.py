"""What the extractors share: the header look-up they read from, the checks of a
header name and of a JSON value, and how a sender's value is quoted in a reason.

Pure code: no I/O.
"""

from __future__ import annotations

from typing import Protocol

import orjson

__all__ = ["HeaderLookup", "is_json", "show"]

# Values quoted in reasons are the sender's data: keep log lines and replies short.
_MAX_SHOWN = 80


class HeaderLookup(Protocol):
    """What extractors need from request headers: ``starlette.datastructures.Headers``.

    Names are looked up lower-cased, so a plain dict with lower-case keys works too.
    """

    def get(self, key: str, default: None = None) -> str | None: ...


def is_json(value: object, depth: int = 0) -> bool:
    """True for a JSON value: what YAML also reads as dates, NaN, infinities or
    non-string keys is not one, nor anything nested over 100 levels deep."""
    if depth > 100:
        return False
    if value is None or isinstance(value, str | bool | int):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(is_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v, depth + 1) for k, v in value.items())
    return False


def show(value: object) -> str:
    """``value`` as a reason quotes it: a string in quotes, anything else as JSON,
    cut to a length fit for a log line or a reply."""
    if isinstance(value, str):
        text = f"'{value}'"
    else:
        try:
            text = orjson.dumps(value).decode()
        except TypeError:
            text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
