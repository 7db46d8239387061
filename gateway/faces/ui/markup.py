"""HTML built from strings, escaped by default: every value that is not already
``Html`` is escaped on its way into a template, so a payload (headers, bodies, keys,
params: all of it the sender's) is shown as text, never read as markup."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any


class Html(str):
    """Markup that is safe to send as it is: built by ``fill`` or ``join``, or a literal."""

    __slots__ = ()

    # Concatenation stays markup, and escapes a plain string on either side.
    def __add__(self, other: object) -> Html:
        return Html(str.__add__(self, esc(other)))

    def __radd__(self, other: object) -> Html:
        return Html(str.__add__(esc(other), self))


def esc(value: object) -> Html:
    """``value`` as HTML text (None is shown as nothing)."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def fill(template: str, **values: object) -> Html:
    """``template`` (a literal of ours, ``str.format`` fields) with each value escaped."""
    return Html(template.format(**{name: esc(value) for name, value in values.items()}))


def join(parts: Iterable[object], sep: str = "") -> Html:
    return Html(sep.join(esc(part) for part in parts))


def when(ms: int | None) -> Html:
    """A server time in ms as UTC, to the second, with the exact instant for machines."""
    if not ms:
        return Html("")
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    return fill(
        '<time datetime="{iso}">{shown}</time>',
        iso=moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        shown=moment.strftime("%Y-%m-%d %H:%M:%S") + "Z",
    )


def pretty_json(text: str) -> str | None:
    """``text`` re-indented if it is JSON; None if it is not (then it is shown as sent).
    The standard library's parser: it keeps integers of any size, and a body nested
    too deep for it is shown as sent rather than failing the page."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


def pretty_value(value: Any) -> str:
    """A stored JSON value (params, a step's output) for reading."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
