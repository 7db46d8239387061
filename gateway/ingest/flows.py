"""A trigger's ``queue``, ``concurrency``, ``debounce`` and ``delay`` → one ``Flow``:
how its starts wait instead of starting at once (docs/triggers.md, "A queue per key"
and "Debounce and delay"). The claim decides with it (gateway/store/lua/_lib.lua).
"""

from __future__ import annotations

from typing import NoReturn, Protocol

from gateway.model.config import parse_retention
from gateway.model.words import shown_value, yaml_kind
from gateway.store.runs import DEFAULT_QUEUE_MAX, KEEP, Flow

_QUEUE_FIELDS = ("max", "keep")
_CONCURRENCY_FIELDS = ("limit",)
_DEBOUNCE_FIELDS = ("period", "max_wait")


class FieldChecks(Protocol):
    """What reports a trigger's config errors, naming the file, trigger and field."""

    def fail(self, field: str | None, message: str) -> NoReturn: ...

    def check_fields(
        self, raw: dict[object, object], allowed: tuple[str, ...], prefix: str
    ) -> None: ...


def compile_flow(checks: FieldChecks, raw: dict[object, object]) -> Flow | None:
    """The flow of the trigger ``raw``; None when its starts never wait."""
    queueing = raw.get("on_live_match") == "queue"
    for field in ("queue", "concurrency"):
        if field in raw and not queueing:
            checks.fail(field, "needs on_live_match: queue (runs wait behind their key's)")
    if "debounce" in raw and "delay" in raw:
        checks.fail("delay", "cannot be combined with debounce, which delays the run already")
    for field in ("debounce", "delay"):
        if field in raw and queueing:
            checks.fail(
                field,
                "cannot be combined with on_live_match: queue; a run either waits for "
                "its time or behind its key's runs",
            )
    if "debounce" in raw:
        debounce = _section(
            checks, raw, "debounce", _DEBOUNCE_FIELDS, "{period: 30s, max_wait: 5m}"
        )
        if "period" not in debounce:
            checks.fail("debounce.period", "is required: a duration like 30s or 5m")
        period = _duration(checks, debounce["period"], "debounce.period")
        max_wait = 0
        if "max_wait" in debounce:
            max_wait = _duration(checks, debounce["max_wait"], "debounce.max_wait")
            if max_wait < period:
                checks.fail("debounce.max_wait", "must be at least debounce.period")
        return Flow(debounce_ms=period, max_wait_ms=max_wait)
    if "delay" in raw:
        return Flow(delay_ms=_duration(checks, raw["delay"], "delay"))
    if not queueing:
        return None
    queue = _section(checks, raw, "queue", _QUEUE_FIELDS, "{max: 10, keep: newest}")
    limit = _section(checks, raw, "concurrency", _CONCURRENCY_FIELDS, "{limit: 2}")
    keep = queue.get("keep", KEEP[0])
    if not isinstance(keep, str) or keep not in KEEP:
        checks.fail("queue.keep", f"must be one of {', '.join(KEEP)}, not {shown_value(keep)}")
    return Flow(
        limit=_count(checks, limit.get("limit", 1), "concurrency.limit"),
        queue_max=_count(checks, queue.get("max", DEFAULT_QUEUE_MAX), "queue.max"),
        keep=keep,
    )


def _section(
    checks: FieldChecks,
    raw: dict[object, object],
    field: str,
    allowed: tuple[str, ...],
    example: str,
) -> dict[object, object]:
    value = raw.get(field, {})
    if not isinstance(value, dict):
        checks.fail(field, f"must be a mapping such as {example}, not {yaml_kind(value)}")
    checks.check_fields(value, allowed, prefix=f"{field}.")
    return value


def _count(checks: FieldChecks, value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        checks.fail(field, f"must be a whole number, 1 or more, not {shown_value(value)}")
    return value


def _duration(checks: FieldChecks, value: object, field: str) -> int:
    try:
        return parse_retention(value)
    except ValueError as exc:
        checks.fail(field, str(exc))
