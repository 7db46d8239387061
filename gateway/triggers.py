"""The ``triggers:`` part of ``triggers.yaml`` (DESIGN §5) → compiled, frozen ``Trigger``s.

Every error is a ``ConfigError`` naming the file, the trigger and the dotted
field (``when[0].matches``, ``params.sha``); YAML of the wrong shape is an
error like any other, never a TypeError. The request path then only calls
``Trigger.match`` and ``Trigger.extract``.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NoReturn

from gateway.errors import ConfigError
from gateway.extract import (
    MISSING,
    TESTS,
    Condition,
    EventIdSource,
    HeaderLookup,
    KeyTemplate,
    ParamError,
    ParamsSpec,
    Path,
    compile_condition,
    compile_event_id,
    compile_key,
    compile_params,
    compile_path,
    is_header_name,
)
from gateway.verify import VerifySpec, parse_verify

__all__ = [
    "ON_LIVE_MATCH",
    "ON_PARAMS_MISMATCH",
    "ON_TERMINAL_MATCH",
    "Extracted",
    "Trigger",
    "describe_event_id",
    "parse_triggers",
]

# DESIGN §3; the first value of each is the default.
ON_LIVE_MATCH = ("use_existing", "fail", "cancel_existing")
ON_TERMINAL_MATCH = ("reuse", "reject", "rerun_if_failed", "rerun")
ON_PARAMS_MISMATCH = ("flag", "reject")

FIELDS = (
    "workflow",
    "path",
    "verify",
    "when",
    "event_id",
    "key",
    "params",
    "on_live_match",
    "on_terminal_match",
    "on_params_mismatch",
)
_REQUIRED = ("workflow", "path", "verify", "event_id")
_SOURCES = ("header", "jsonpath")
_EVENT_ID_FIELDS = (*_SOURCES, "missing")
# Characters that would make a path mean something else to Starlette's router
# (`{name}` is a path parameter) or to an HTTP client (query, fragment).
_PATH_FORBIDDEN = frozenset("{}?# \t\r\n")
_DEFAULT_KEY = "{event_id}"


@dataclass(frozen=True, slots=True)
class Extracted:
    """What a matched delivery yields for the claim."""

    event_id: str
    key: str
    params: dict[str, object]


@dataclass(frozen=True)
class Trigger:
    """One compiled trigger. Field meanings: DESIGN §3 and §5."""

    name: str
    workflow: str
    path: str
    verify: VerifySpec
    when: tuple[Condition, ...]
    event_id: EventIdSource
    key: KeyTemplate
    params: ParamsSpec
    on_live_match: str = ON_LIVE_MATCH[0]
    on_terminal_match: str = ON_TERMINAL_MATCH[0]
    on_params_mismatch: str = ON_PARAMS_MISMATCH[0]

    def match(self, headers: HeaderLookup, doc: object) -> str | None:
        """None when every ``when`` condition holds, else the first failing reason."""
        for condition in self.when:
            reason = condition.check(headers, doc)
            if reason is not None:
                return reason
        return None

    def extract(self, headers: HeaderLookup, doc: object, body: bytes) -> Extracted:
        """Event id, key and params. Raises ExtractError (VALIDATION_EVENT_ID)."""
        event_id = self.event_id.resolve(headers, doc, body)
        key = self.key.render(headers, doc, event_id)
        return Extracted(event_id=event_id, key=key, params=self.params.extract(headers, doc))


def describe_event_id(t: Trigger) -> str:
    """E.g. ``header X-GitHub-Delivery`` or ``jsonpath $.id (else content hash)``."""
    return t.event_id.describe()


def parse_triggers(
    raw: object, *, file: str, workflows: Collection[str], env: Mapping[str, str]
) -> dict[str, Trigger]:
    """Compile the YAML value under ``triggers:``. Raises ConfigError on the first problem."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            file,
            f"must be a mapping of trigger name → trigger, not {_kind(raw)}",
            section="triggers",
        )
    triggers: dict[str, Trigger] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                file, f"trigger name {name!r} must be a non-empty string", section="triggers"
            )
        triggers[name] = _TriggerParser(file, name, workflows, env).parse(spec)
    return triggers


class _TriggerParser:
    """Holds file and trigger name so every error can name them without repeating them."""

    def __init__(
        self, file: str, name: str, workflows: Collection[str], env: Mapping[str, str]
    ) -> None:
        self.file = file
        self.name = name
        self.workflows = workflows
        self.env = env

    def fail(self, field: str | None, message: str) -> NoReturn:
        raise ConfigError(self.file, message, section="trigger", name=self.name, field=field)

    def parse(self, raw: object) -> Trigger:
        if not isinstance(raw, dict):
            self.fail(
                None, f"must be a mapping with fields {', '.join(_REQUIRED)}, not {_kind(raw)}"
            )
        self.check_fields(raw, FIELDS, prefix="")
        for required in _REQUIRED:
            if required not in raw:
                hint = (
                    "; write {scheme: none} to accept unsigned deliveries explicitly"
                    if required == "verify"
                    else ""
                )
                self.fail(required, f"is required{hint}")
        return Trigger(
            name=self.name,
            workflow=self.workflow(raw["workflow"]),
            path=self.path(raw["path"]),
            # parse_verify names file, trigger and `verify.*` field itself.
            verify=parse_verify(raw["verify"], file=self.file, trigger=self.name, env=self.env),
            when=self.when(raw["when"]) if "when" in raw else (),
            event_id=self.event_id(raw["event_id"]),
            key=self.key(raw.get("key", _DEFAULT_KEY)),
            params=self.params(raw["params"]) if "params" in raw else ParamsSpec(),
            on_live_match=self.choice(raw, "on_live_match", ON_LIVE_MATCH),
            on_terminal_match=self.choice(raw, "on_terminal_match", ON_TERMINAL_MATCH),
            on_params_mismatch=self.choice(raw, "on_params_mismatch", ON_PARAMS_MISMATCH),
        )

    def check_fields(
        self, raw: dict[object, object], allowed: tuple[str, ...], prefix: str
    ) -> None:
        for key in raw:
            if key not in allowed:
                text = str(key)
                close = difflib.get_close_matches(text, allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                self.fail(
                    prefix + text, f"unknown field{hint}; allowed fields: {', '.join(allowed)}"
                )

    def workflow(self, raw: object) -> str:
        if not isinstance(raw, str) or not raw:
            self.fail("workflow", f"must be a workflow name, not {_kind(raw)}")
        if raw not in self.workflows:
            known = ", ".join(sorted(self.workflows)) or "none are defined"
            self.fail("workflow", f"unknown workflow '{raw}'; known workflows: {known}")
        return raw

    def path(self, raw: object) -> str:
        if not isinstance(raw, str) or not raw.startswith("/"):
            self.fail("path", f"must be a URL path starting with '/', not {_show(raw)}")
        bad = sorted({c for c in raw if c in _PATH_FORBIDDEN})
        if bad:
            self.fail("path", f"must not contain {' '.join(repr(c) for c in bad)}")
        return raw

    def header(self, raw: object, field: str) -> str:
        if not isinstance(raw, str) or not raw:
            self.fail(field, f"must be a non-empty string (a header name), not {_kind(raw)}")
        if not is_header_name(raw):
            self.fail(field, f"{raw!r} is not a valid header name")
        return raw

    def jsonpath(self, raw: object, field: str) -> Path:
        if not isinstance(raw, str) or not raw:
            self.fail(
                field, f"must be a non-empty string (a JSONPath such as $.id), not {_kind(raw)}"
            )
        try:
            return compile_path(raw)
        except ValueError as exc:
            self.fail(field, str(exc))

    def source(self, raw: dict[object, object], field: str) -> tuple[str | None, Path | None]:
        present = [s for s in _SOURCES if s in raw]
        if len(present) != 1:
            got = f"got {' and '.join(present)}" if present else "got neither"
            self.fail(field, f"needs exactly one source, header or jsonpath ({got})")
        if present[0] == "header":
            return self.header(raw["header"], f"{field}.header"), None
        return None, self.jsonpath(raw["jsonpath"], f"{field}.jsonpath")

    def when(self, raw: object) -> tuple[Condition, ...]:
        if not isinstance(raw, list):
            self.fail("when", f"must be a list of conditions, not {_kind(raw)}")
        return tuple(self.condition(item, f"when[{i}]") for i, item in enumerate(raw))

    def condition(self, raw: object, field: str) -> Condition:
        if not isinstance(raw, dict):
            self.fail(
                field,
                "must be a mapping such as {header: X-GitHub-Event, equals: push}, "
                f"not {_kind(raw)}",
            )
        self.check_fields(raw, (*_SOURCES, *TESTS), prefix=f"{field}.")
        header, path = self.source(raw, field)
        tests = [t for t in TESTS if t in raw]
        if len(tests) != 1:
            got = f"got {', '.join(tests)}" if tests else "got none"
            self.fail(field, f"needs exactly one test of {', '.join(TESTS)} ({got})")
        test = tests[0]
        try:
            return compile_condition(
                header=header,
                path=path,
                test=test,  # type: ignore[arg-type]  # one of TESTS, checked above
                operand=raw[test],
            )
        except ValueError as exc:
            # The source was checked by self.source: what is left is the test's operand.
            self.fail(f"{field}.{test}", str(exc))

    def event_id(self, raw: object) -> EventIdSource:
        if not isinstance(raw, dict):
            self.fail(
                "event_id",
                f"must be a mapping such as {{header: X-GitHub-Delivery}}, not {_kind(raw)}",
            )
        self.check_fields(raw, _EVENT_ID_FIELDS, prefix="event_id.")
        header, path = self.source(raw, "event_id")
        missing = raw.get("missing", MISSING[0])
        if missing not in MISSING:
            self.fail(
                "event_id.missing", f"must be one of {', '.join(MISSING)}, not {_show(missing)}"
            )
        try:
            return compile_event_id(header=header, path=path, missing=missing)
        except ValueError as exc:
            self.fail("event_id", str(exc))

    def key(self, raw: object) -> KeyTemplate:
        if not isinstance(raw, str):
            self.fail("key", f"must be a template string such as '{{event_id}}', not {_kind(raw)}")
        try:
            return compile_key(raw)
        except ValueError as exc:
            self.fail("key", str(exc))

    def params(self, raw: object) -> ParamsSpec:
        if not isinstance(raw, dict):
            self.fail(
                "params",
                f"must be a mapping of param name → JSONPath, header or value, not {_kind(raw)}",
            )
        for name in raw:
            if not isinstance(name, str) or not name:
                self.fail(f"params.{name}", "param names must be non-empty strings")
        try:
            return compile_params(raw)
        except ParamError as exc:
            self.fail(f"params.{exc.name}", exc.reason)

    def choice(self, raw: dict[object, object], field: str, allowed: tuple[str, ...]) -> str:
        value = raw.get(field, allowed[0])
        if not isinstance(value, str) or value not in allowed:
            self.fail(field, f"must be one of {', '.join(allowed)}, not {_show(value)}")
        return value


def _kind(value: object) -> str:
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


def _show(value: object) -> str:
    """A user's value for a message: short strings and numbers as written, else the type."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
    else:
        text = _kind(value)
    return text if len(text) <= 60 else text[:57] + "..."
