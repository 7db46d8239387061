"""``params``, compiled: each run parameter from a JSONPath, a header or a literal,
in YAML order; what a delivery gives is extracted per request.

Pure code: no I/O. ``compile_params`` raises ``ParamError`` naming the entry;
turning it into a ``ConfigError`` with a field name is the caller's job.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.ingest.jsonpath import compile_path
from gateway.ingest.values import HeaderLookup, is_json, show
from gateway.signatures.schemes import is_header_name

__all__ = ["ParamError", "ParamKind", "ParamsSpec", "compile_params"]

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
            elif is_json(value):
                entries.append((name, "literal", value))
            else:
                raise ValueError(
                    f"{show(value)} is not a JSONPath, {{header: Name}} or JSON value "
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
