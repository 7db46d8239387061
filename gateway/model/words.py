"""Words every message uses the same way: a count with the noun that agrees with it
("1 trigger", "2 triggers", never "trigger(s)"), and an unknown field named with the
closest allowed one ("did you mean 'steps'?"), a value of the wrong type by its YAML
name ("a mapping", "an empty string")."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def noun(count: int, singular: str, plural_form: str | None = None) -> str:
    """The noun that agrees with ``count``: ``singular`` for 1, else ``plural_form``
    (default: ``singular`` + "s")."""
    if count == 1:
        return singular
    return plural_form if plural_form is not None else singular + "s"


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """``count`` and its noun: ``plural(1, "trigger")`` is "1 trigger",
    ``plural(0, "key group")`` is "0 key groups"."""
    return f"{count} {noun(count, singular, plural_form)}"


def did_you_mean(name: str, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the allowed name closest to ``name``, or "" when
    none is close: a typo is named with its fix."""
    close = difflib.get_close_matches(name, list(allowed), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_field(name: str, allowed: Iterable[str]) -> str:
    """The message for a field that is not one of ``allowed``, with the closest one."""
    names = sorted(allowed)
    return f"unknown field{did_you_mean(name, names)}; allowed fields: {', '.join(names)}"


def yaml_kind(value: object) -> str:
    """The YAML name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, str) and not value:
        return "an empty string"
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(value), type(value).__name__)


def shown_value(value: object) -> str:
    """A user's value for a message: short strings and numbers as written, else the type."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
    else:
        text = yaml_kind(value)
    return text if len(text) <= 60 else text[:57] + "..."
