"""``when`` conditions, compiled: a header, a JSONPath or (for a ``respond`` rule) a
query parameter, and one test (equals, in, exists, matches), compared as JSON compares
(headers and query parameters as the text they are), with the reason when one does
not hold.

Pure code: no I/O. Conditions are compiled once at start-up (by
``gateway.ingest.triggers``); the request path only evaluates them.
``compile_condition`` takes already-typed values and raises ``ValueError`` with
the reason; turning YAML into those values, and reasons into ``ConfigError``
with a field name, is the caller's job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from gateway.ingest.jsonpath import Path
from gateway.ingest.values import HeaderLookup, is_json, show
from gateway.signatures.schemes import is_header_name

__all__ = ["TESTS", "Condition", "Test", "compile_condition"]

Test = Literal["equals", "in", "exists", "matches"]
TESTS: tuple[str, ...] = get_args(Test)


@dataclass(frozen=True, slots=True)
class Condition:
    """One ``when`` item: a source (header, JSONPath or query parameter) and one test."""

    header: str | None  # exactly one of header / path / query is set
    path: Path | None
    test: Test
    operand: object
    pattern: re.Pattern[str] | None = field(default=None, repr=False, compare=False)
    query: str | None = None

    @property
    def source(self) -> str:
        if self.query is not None:
            return f"query parameter {self.query}"
        return f"header {self.header}" if self.path is None else f"jsonpath {self.path.expr}"

    def check(
        self, headers: HeaderLookup, doc: object, query: Mapping[str, str] | None = None
    ) -> str | None:
        """None when the condition holds, else a reason fit for a log line or reply."""
        found: bool
        value: object
        if self.query is not None:
            got = (query or {}).get(self.query)
            found, value = got is not None, got
        elif self.header is not None:
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
        return f"{self.source} is {show(value)}, {self._expected()}"

    def _holds(self, value: object) -> bool:
        if self.test == "matches":
            assert self.pattern is not None
            return isinstance(value, str) and self.pattern.search(value) is not None
        if self.path is None:
            # Header and query operands were turned to strings at compile time.
            if self.test == "equals":
                return value == self.operand
            return value in self.operand  # type: ignore[operator]
        if self.test == "equals":
            return _json_equal(value, self.operand)
        return any(_json_equal(value, item) for item in self.operand)  # type: ignore[attr-defined]

    def _expected(self) -> str:
        if self.test == "equals":
            return f"expected {show(self.operand)}"
        if self.test == "in":
            shown = ", ".join(show(v) for v in self.operand)  # type: ignore[attr-defined]
            return f"expected one of [{shown}]"
        return f"expected to match {show(self.operand)}"


def compile_condition(
    *,
    header: str | None = None,
    path: Path | None = None,
    query: str | None = None,
    test: Test,
    operand: object,
) -> Condition:
    """Build a condition. Raises ValueError when the operand does not fit the test."""
    if sum(source is not None for source in (header, path, query)) != 1:
        raise ValueError("needs exactly one source: header or jsonpath")
    if header is not None and not is_header_name(header):
        raise ValueError(f"{header!r} is not a valid header name")
    if test == "exists":
        if not isinstance(operand, bool):
            raise ValueError("must be true or false")
        return Condition(header, path, test, operand, query=query)
    if test == "matches":
        if not isinstance(operand, str):
            raise ValueError("must be a regular expression string")
        try:
            pattern = re.compile(operand)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {operand!r}: {exc}") from None
        return Condition(header, path, test, operand, pattern, query=query)
    if test == "in":
        if not isinstance(operand, list) or not operand:
            raise ValueError("must be a non-empty list of values")
        values = tuple(_operand(v, path is None) for v in operand)
        return Condition(header, path, test, values, query=query)
    if test == "equals":
        return Condition(header, path, test, _operand(operand, path is None), query=query)
    raise ValueError(f"unknown test {test!r}; one of {', '.join(TESTS)}")


def _operand(value: object, for_header: bool) -> object:
    if not is_json(value):
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
