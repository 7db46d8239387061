"""The ``triggers:`` part of ``triggers.yaml`` → compiled, frozen ``Trigger``s.

Every error is a ``ConfigError`` naming the file, the trigger and the dotted
field (``when[0].matches``, ``params.sha``); YAML of the wrong shape is an
error like any other, never a TypeError. The request path then only calls
``Trigger.match`` and ``Trigger.extract``.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import NoReturn

from gateway.ingest.body import BodyError, FormFields, parse_body
from gateway.ingest.conditions import TESTS, Condition, compile_condition
from gateway.ingest.flows import compile_flow
from gateway.ingest.handshakes import Respond, StripeRules, compile_handshakes
from gateway.ingest.idempotency import (
    MISSING,
    VALIDATION_EVENT_ID,
    EventIdSource,
    ExtractError,
    InexactNumber,
    KeyTemplate,
    compile_event_id,
    compile_key,
)
from gateway.ingest.jsonpath import Path, compile_path
from gateway.ingest.limits import RateLimitSpec
from gateway.ingest.ordering import TIES, OrderSpec, OrderValue, Rank
from gateway.ingest.params import ParamError, ParamsSpec, compile_params
from gateway.ingest.values import HeaderLookup
from gateway.model.config import parse_retention
from gateway.model.errors import ConfigError
from gateway.model.words import noun, plural, shown_value, yaml_kind
from gateway.signatures.parse import parse_verify
from gateway.signatures.schemes import is_header_name
from gateway.signatures.spec import VerifySpec
from gateway.store.runs import Flow

__all__ = [
    "ON_LIVE_MATCH",
    "ON_PARAMS_MISMATCH",
    "ON_TERMINAL_MATCH",
    "Extracted",
    "Trigger",
    "describe_event_id",
    "parse_triggers",
]

# The policies on a repeated key; the first value of each is the default.
ON_LIVE_MATCH = ("use_existing", "fail", "cancel_existing", "queue")
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
    "replay_guard",
    "order",
    "rate_limit",
    "queue",
    "concurrency",
    "debounce",
    "delay",
    "methods",
    "respond",
    "stripe",
)
_RATE_FIELDS = ("limit", "period", "key")
_ORDER_FIELDS = ("by", "key", "ties", "rank")
_RANK_FIELDS = ("by", "order")
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
    order: OrderValue | None = None
    rate_window: str | None = None  # the rate limit's window ('' the trigger's own)


@dataclass(frozen=True)
class Trigger:
    """One compiled trigger. Field meanings: docs/triggers.md."""

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
    # Deduplicate a verified body seen again under another event id (docs/triggers.md).
    replay_guard: bool = False
    # Refuse an event older than one already started for its entity (docs/triggers.md).
    order: OrderSpec | None = None
    # Start at most so many runs per period, per value of a key (docs/triggers.md).
    rate_limit: RateLimitSpec | None = None
    # How a start waits: behind its key's live runs (queue, concurrency), or until a due
    # time (debounce, delay); None: it starts at once or not at all (docs/triggers.md).
    flow: Flow | None = None
    # The methods it takes, its handshake reply, Stripe's mode (gateway/ingest/handshakes.py).
    methods: tuple[str, ...] = ("POST",)
    respond: Respond | None = None
    stripe: StripeRules | None = None

    @functools.cached_property
    def headers_read(self) -> frozenset[str]:
        """The lower-case names of the headers this trigger reads once a delivery is
        verified (its ``when``, event id, key and params, and the body's type): what
        the spool keeps of a delivery's headers, so that its drain decides as a live
        delivery would, with nothing that authenticates the sender on disk."""
        names = {"content-type"}
        names.update(c.header.lower() for c in self.when if c.header is not None)
        if self.event_id.header is not None:
            names.add(self.event_id.header.lower())
        names.update(str(ref).lower() for kind, _, ref, _ in self.key.parts if kind == "header")
        names.update(str(src).lower() for _, kind, src in self.params.entries if kind == "header")
        if self.order is not None:
            names.update(h.lower() for h in self._order_headers())
        if self.rate_limit is not None and self.rate_limit.key is not None:
            parts = self.rate_limit.key.parts
            names.update(str(ref).lower() for kind, _, ref, _ in parts if kind == "header")
        return frozenset(names)

    def _order_headers(self) -> Iterator[str]:
        assert self.order is not None
        if self.order.header is not None:
            yield self.order.header
        if self.order.rank is not None and self.order.rank.header is not None:
            yield self.order.rank.header
        if self.order.entity is not None:
            yield from (str(ref) for kind, _, ref, _ in self.order.entity.parts if kind == "header")

    def match(self, headers: HeaderLookup, doc: object) -> str | None:
        """None when every ``when`` condition holds, else the first failing reason."""
        if isinstance(doc, FormFields) and doc.json_hint and self.reads_json:
            # JSON sent as a form (`curl -d`): every JSONPath would find nothing,
            # and the reason should say why rather than name one of them.
            return doc.json_hint
        for condition in self.when:
            reason = condition.check(headers, doc)
            if reason is not None:
                return reason
        return None

    def extract(self, headers: HeaderLookup, doc: object, body: bytes) -> Extracted:
        """Event id, key and params. Raises ExtractError (VALIDATION_EVENT_ID)."""
        order: OrderValue | None = None
        window: str | None = None
        try:
            event_id = self.event_id.resolve(headers, doc, body)
            key = self.key.render(headers, doc, event_id)
            if self.order is not None:
                order = self.order.resolve(headers, doc, event_id, key)
            if self.rate_limit is not None:
                window = self.rate_limit.window(headers, doc, event_id)
        except InexactNumber:
            # An integer beyond 64 bits, rounded by the fast parse, would let two
            # neighbouring ids share a key: read the body again, exactly (rare).
            try:
                exact = parse_body(body, headers.get("content-type"), exact=True)
            except BodyError as exc:
                raise ExtractError(VALIDATION_EVENT_ID, str(exc)) from None
            event_id = self.event_id.resolve(headers, exact, body, exact=True)
            key = self.key.render(headers, exact, event_id, exact=True)
            if self.order is not None:
                order = self.order.resolve(headers, exact, event_id, key, exact=True)
            if self.rate_limit is not None:
                window = self.rate_limit.window(headers, exact, event_id, exact=True)
        return Extracted(event_id, key, self.params.extract(headers, doc), order, window)

    @functools.cached_property
    def reads_json(self) -> bool:
        """Whether any part of this trigger reads the body with a JSONPath."""
        return any(True for _ in self._paths())

    def _paths(self) -> Iterator[Path]:
        yield from (c.path for c in self.when if c.path is not None)
        if self.event_id.path is not None:
            yield self.event_id.path
        yield from (ref for kind, _, ref, _ in self.key.parts if kind == "path")  # type: ignore[misc]
        yield from (src for _, kind, src in self.params.entries if kind == "path")  # type: ignore[misc]
        if self.order is not None:
            order = self.order
            yield from (p for p in (order.path, order.rank and order.rank.path) if p is not None)
            if order.entity is not None:
                yield from (ref for kind, _, ref, _ in order.entity.parts if kind == "path")  # type: ignore[misc]
        if self.rate_limit is not None and self.rate_limit.key is not None:
            yield from (ref for kind, _, ref, _ in self.rate_limit.key.parts if kind == "path")  # type: ignore[misc]


def describe_event_id(t: Trigger) -> str:
    """E.g. ``header X-GitHub-Delivery`` or ``jsonpath $.id (else content hash)``."""
    return t.event_id.describe()


def parse_triggers(
    raw: object, *, file: str, workflows: Collection[str], env: Mapping[str, str]
) -> dict[str, Trigger]:
    """Compile the YAML value under ``triggers:``. Raises ConfigError on the first
    problem, except missing secrets: those are listed all at once, at the end."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            file,
            f"must be a mapping of trigger name → trigger, not {yaml_kind(raw)}",
            section="triggers",
        )
    triggers: dict[str, Trigger] = {}
    secrets = _SecretsSeen(env)
    for name, spec in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                file, f"trigger name {name!r} must be a non-empty string", section="triggers"
            )
        secrets.trigger = name
        triggers[name] = _TriggerParser(file, name, workflows, secrets).parse(spec)
    secrets.raise_missing(file)
    return triggers


class _SecretsSeen(Mapping[str, str]):
    """The environment as ``parse_verify`` sees it, noting every unset or empty
    variable (and who needs it) rather than stopping at the first: one run of
    ``realm triggers check`` then lists every secret still to set."""

    # Stands in for a missing secret so the rest of the file is still checked; a
    # Standard Webhooks secret, so that scheme's format check passes too. Never
    # used to verify anything: raise_missing refuses the file first.
    _STAND_IN = "whsec_c3RhbmQtaW4="

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.trigger = ""
        self.missing: dict[str, tuple[str, list[str]]] = {}  # var → (problem, triggers)

    def __getitem__(self, name: str) -> str:
        value = self.env.get(name)
        if value:
            return value
        problem = "is not set" if value is None else "is empty"
        users = self.missing.setdefault(name, (problem, []))[1]
        if self.trigger not in users:
            users.append(self.trigger)
        return self._STAND_IN

    def __iter__(self) -> Iterator[str]:
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)

    def raise_missing(self, file: str) -> None:
        if len(self.missing) == 1:
            ((name, (problem, users)),) = self.missing.items()
            if len(users) == 1:  # the usual one-line error, naming the trigger
                raise ConfigError(
                    file,
                    f"environment variable {name} {problem}",
                    section="trigger",
                    name=users[0],
                    field="verify.secret_env",
                )
        if self.missing:
            listed = "; ".join(
                f"{name} {problem} (trigger{'s' if len(users) > 1 else ''} {', '.join(users)})"
                for name, (problem, users) in self.missing.items()
            )
            raise ConfigError(
                file,
                f"{plural(len(self.missing), 'environment variable')} for secrets "
                f"{noun(len(self.missing), 'is', 'are')} missing: {listed}",
                section="triggers",
                field="verify.secret_env",
            )


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
                None, f"must be a mapping with fields {', '.join(_REQUIRED)}, not {yaml_kind(raw)}"
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
        # parse_verify names file, trigger and `verify.*` field itself.
        verify = parse_verify(raw["verify"], file=self.file, trigger=self.name, env=self.env)
        methods, respond, stripe = compile_handshakes(self, raw, verify.scheme)
        return Trigger(
            name=self.name,
            workflow=self.workflow(raw["workflow"]),
            path=self.path(raw["path"]),
            verify=verify,
            when=self.when(raw["when"]) if "when" in raw else (),
            event_id=self.event_id(raw["event_id"]),
            key=self.key(raw.get("key", _DEFAULT_KEY)),
            params=self.params(raw["params"]) if "params" in raw else ParamsSpec(),
            on_live_match=self.choice(raw, "on_live_match", ON_LIVE_MATCH),
            on_terminal_match=self.choice(raw, "on_terminal_match", ON_TERMINAL_MATCH),
            on_params_mismatch=self.choice(raw, "on_params_mismatch", ON_PARAMS_MISMATCH),
            replay_guard=self.replay_guard(raw),
            order=self.order(raw["order"]) if "order" in raw else None,
            rate_limit=self.rate_limit(raw["rate_limit"]) if "rate_limit" in raw else None,
            flow=compile_flow(self, raw),
            methods=methods,
            respond=respond,
            stripe=stripe,
        )

    def rate_limit(self, raw: object) -> RateLimitSpec:
        if not isinstance(raw, dict):
            self.fail(
                "rate_limit",
                "must be a mapping such as {limit: 100, period: 1m, key: "
                f"'{{$.repository.full_name}}'}}, not {yaml_kind(raw)}",
            )
        self.check_fields(raw, _RATE_FIELDS, prefix="rate_limit.")
        limit = raw.get("limit")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            self.fail(
                "rate_limit.limit",
                f"must be a whole number of runs, 1 or more, not {shown_value(limit)}",
            )
        if "period" not in raw:
            self.fail("rate_limit.period", "is required: a duration like 1m, 1h or 1d")
        try:
            period_ms = parse_retention(raw["period"])
        except ValueError as exc:
            self.fail("rate_limit.period", str(exc))
        key = self.key(raw["key"], "rate_limit.key") if "key" in raw else None
        return RateLimitSpec(limit, period_ms, key)

    def order(self, raw: object) -> OrderSpec:
        if not isinstance(raw, dict):
            self.fail(
                "order",
                "must be a mapping such as {by: $.created, key: '{$.data.object.id}'}, "
                f"not {yaml_kind(raw)}",
            )
        self.check_fields(raw, _ORDER_FIELDS, prefix="order.")
        if "by" not in raw:
            self.fail("order.by", "is required: the JSONPath or {header: Name} of the order value")
        header, path = self.value_source(raw["by"], "order.by")
        entity = self.key(raw["key"], "order.key") if "key" in raw else None
        ties = raw.get("ties", TIES[0])
        if ties not in TIES:
            self.fail("order.ties", f"must be one of {', '.join(TIES)}, not {shown_value(ties)}")
        rank = None
        if "rank" in raw:
            rank = self.rank(raw["rank"])
        return OrderSpec(header, path, entity, ties, rank)  # type: ignore[arg-type]

    def rank(self, raw: object) -> Rank:
        if not isinstance(raw, dict):
            self.fail(
                "order.rank",
                "must be a mapping such as {by: $.data.object.status, order: [active, "
                f"canceled]}}, not {yaml_kind(raw)}",
            )
        self.check_fields(raw, _RANK_FIELDS, prefix="order.rank.")
        for required in _RANK_FIELDS:
            if required not in raw:
                self.fail(f"order.rank.{required}", "is required")
        header, path = self.value_source(raw["by"], "order.rank.by")
        words = raw["order"]
        if (
            not isinstance(words, list)
            or not words
            or not all(isinstance(w, str) and w for w in words)
        ):
            self.fail(
                "order.rank.order",
                f"must be a list of words from oldest to newest, not {shown_value(words)}",
            )
        if len(set(words)) != len(words):
            self.fail("order.rank.order", "names a word twice")
        return Rank(header, path, tuple(words))

    def value_source(self, raw: object, field: str) -> tuple[str | None, Path | None]:
        """A JSONPath written as a string, or ``{header: Name}`` / ``{jsonpath: $.x}``."""
        if isinstance(raw, str):
            return None, self.jsonpath(raw, field)
        if isinstance(raw, dict):
            self.check_fields(raw, _SOURCES, prefix=f"{field}.")
            return self.source(raw, field)
        self.fail(
            field, f"must be a JSONPath such as $.created or {{header: Name}}, not {yaml_kind(raw)}"
        )

    def replay_guard(self, raw: dict[object, object]) -> bool:
        """On by default for `github` and `shopify`, which sign the body alone and send
        the event id in a header they do not sign (X-GitHub-Delivery,
        X-Shopify-Webhook-Id): a captured delivery sent again with a new id must not
        start new work. Off by default for `hmac` (with or without a timestamp: where
        its event id comes from is the trigger's choice), `token` and `none`, whose
        senders may send one body for several events (a cron ping), and for `gitlab`,
        whose token travels in every delivery: whoever can replay one can forge any,
        so the guard would buy nothing. `stripe`, `standard` and `slack` sign a
        timestamp and the event id (Stripe's and Slack's ids are in the signed body),
        so their replays are refused by verification already."""
        verify = raw.get("verify")
        scheme = verify.get("scheme") if isinstance(verify, dict) else None
        value = raw.get("replay_guard", scheme in ("github", "shopify"))
        if not isinstance(value, bool):
            self.fail("replay_guard", f"must be true or false, not {shown_value(value)}")
        if value and scheme in ("stripe", "standard", "slack"):
            self.fail(
                "replay_guard",
                f"is not needed with scheme {scheme}: it signs a timestamp and the event id",
            )
        return value

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
            self.fail("workflow", f"must be a workflow name, not {yaml_kind(raw)}")
        if raw not in self.workflows:
            known = ", ".join(sorted(self.workflows)) or "none are defined"
            self.fail("workflow", f"unknown workflow '{raw}'; known workflows: {known}")
        return raw

    def path(self, raw: object) -> str:
        if not isinstance(raw, str) or not raw.startswith("/"):
            self.fail("path", f"must be a URL path starting with '/', not {shown_value(raw)}")
        bad = sorted({c for c in raw if c in _PATH_FORBIDDEN})
        if bad:
            self.fail("path", f"must not contain {' '.join(repr(c) for c in bad)}")
        if "%" in raw:
            # Routes are matched against the decoded path: '/a%20b' would never match.
            self.fail(
                "path",
                "must not contain '%': requests are matched on the decoded path, so write "
                "it decoded (/hooks/café, not /hooks/caf%C3%A9)",
            )
        return raw

    def header(self, raw: object, field: str) -> str:
        if not isinstance(raw, str) or not raw:
            self.fail(field, f"must be a non-empty string (a header name), not {yaml_kind(raw)}")
        if not is_header_name(raw):
            self.fail(field, f"{raw!r} is not a valid header name")
        return raw

    def jsonpath(self, raw: object, field: str) -> Path:
        if not isinstance(raw, str) or not raw:
            self.fail(
                field, f"must be a non-empty string (a JSONPath such as $.id), not {yaml_kind(raw)}"
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
            self.fail("when", f"must be a list of conditions, not {yaml_kind(raw)}")
        return tuple(self.condition(item, f"when[{i}]") for i, item in enumerate(raw))

    def condition(self, raw: object, field: str) -> Condition:
        if not isinstance(raw, dict):
            self.fail(
                field,
                "must be a mapping such as {header: X-GitHub-Event, equals: push}, "
                f"not {yaml_kind(raw)}",
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
                f"must be a mapping such as {{header: X-GitHub-Delivery}}, not {yaml_kind(raw)}",
            )
        self.check_fields(raw, _EVENT_ID_FIELDS, prefix="event_id.")
        header, path = self.source(raw, "event_id")
        missing = raw.get("missing", MISSING[0])
        if missing not in MISSING:
            self.fail(
                "event_id.missing",
                f"must be one of {', '.join(MISSING)}, not {shown_value(missing)}",
            )
        try:
            return compile_event_id(header=header, path=path, missing=missing)
        except ValueError as exc:
            self.fail("event_id", str(exc))

    def key(self, raw: object, field: str = "key") -> KeyTemplate:
        if not isinstance(raw, str):
            self.fail(
                field, f"must be a template string such as '{{event_id}}', not {yaml_kind(raw)}"
            )
        try:
            return compile_key(raw)
        except ValueError as exc:
            self.fail(field, str(exc))

    def params(self, raw: object) -> ParamsSpec:
        if not isinstance(raw, dict):
            self.fail(
                "params",
                "must be a mapping of param name → JSONPath, header or value, not "
                f"{yaml_kind(raw)}",
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
            self.fail(field, f"must be one of {', '.join(allowed)}, not {shown_value(value)}")
        return value
