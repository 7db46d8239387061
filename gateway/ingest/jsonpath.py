"""JSONPath, compiled once: simple paths become direct look-ups, anything else goes
through ``jsonpath_ng``; ``Path.get`` returns the first match.

Pure code: no I/O. ``compile_path`` raises ``ValueError`` with the reason; turning
it into a ``ConfigError`` with a field name is the caller's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jsonpath_ng import JSONPath
from jsonpath_ng.ext import parse as jsonpath_parse

__all__ = ["Path", "compile_path"]

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
