"""Whether an event a sender kept is here: its payload walked through the triggers of
one path (``delivery.handle``), first as a dry run that only asks what a claim would
decide, and for Stripe then for real.

The payload comes from the sender's API, fetched with our own credentials, so it is
trusted as a delivery that verified on arrival would be: the triggers of the path that
use the sender's signature scheme are cleared (``on_arrival``), no signature is checked
and no webhook secret is needed. Triggers of another scheme on the same path are left
out (``unverified``).

A claim that would start a run means the event never arrived. Everything else means
it did (the key has a run: deduplicated, refused by a stored decision, or its body
differs from the bytes the sender sent, which our re-serialised payload always does),
or that no trigger wants it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.ingest.delivery import DECISIONS, Reply, TriggerResult, handle
from gateway.ingest.served import triggers_by_path
from gateway.ingest.triggers import Trigger
from gateway.ingest.webhooks import RequestHeaders
from gateway.model.config import Config
from gateway.recover.summary import FAILED, HERE, NOT_MATCHED, REFUSED, STARTED
from gateway.store.runstore import RunStore

MISSING = "missing"  # a claim would start a run: the event never arrived
JSON = "application/json"
_EVENT_ID_KEY = "{event_id}"


class PathError(Exception):
    """The path to check cannot be chosen; the message says why and what there is."""


@dataclass(frozen=True)
class Route:
    """The triggers of one path, and those of them the sender's scheme clears."""

    path: str
    triggers: Sequence[Trigger]
    trusted: Mapping[str, str | None]


def pick_route(config: Config, scheme: str, path: str | None) -> Route:
    """The triggers of ``path``, or of the one path with triggers of ``scheme``."""
    by_path = triggers_by_path(config)
    ours = [p for p, triggers in by_path.items() if any(_uses(t, scheme) for t in triggers)]
    if path is None:
        if not ours:
            raise PathError(f"no trigger uses verify scheme {scheme!r}; nothing to recover")
        if len(ours) > 1:
            raise PathError(
                f"several paths have triggers of verify scheme {scheme!r} "
                f"({', '.join(sorted(ours))}): choose one with --path"
            )
        path = ours[0]
    elif path not in ours:
        found = ", ".join(sorted(ours)) or "none"
        raise PathError(
            f"no trigger of path {path} uses verify scheme {scheme!r} "
            f"(paths with such triggers: {found})"
        )
    triggers = by_path[path]
    return Route(path, triggers, {t.name: None for t in triggers if _uses(t, scheme)})


def _uses(trigger: Trigger, scheme: str) -> bool:
    return trigger.verify.scheme == scheme


def headers_of(pairs: Iterable[tuple[str, str]]) -> RequestHeaders:
    """A delivery's headers as the request path looks them up (lower-case names)."""
    return RequestHeaders([(name.lower().encode(), value.encode()) for name, value in pairs])


@dataclass(frozen=True)
class Verdict:
    outcome: str  # MISSING, or one of the summary's outcomes
    why: str


async def look(store: RunStore, route: Route, headers: RequestHeaders, body: bytes) -> Verdict:
    """What a claim of this delivery would decide now; nothing is written."""
    reply = await handle(
        store, route.triggers, headers, JSON, body, on_arrival=route.trusted, dry_run=True
    )
    return preview_verdict(reply, route.triggers)


async def claim(store: RunStore, route: Route, headers: RequestHeaders, body: bytes) -> Verdict:
    """The delivery claimed here, as the listener would claim it had it arrived."""
    reply = await handle(store, route.triggers, headers, JSON, body, on_arrival=route.trusted)
    return claim_verdict(reply)


def preview_verdict(reply: Reply, triggers: Sequence[Trigger]) -> Verdict:
    """A dry run's reply as one verdict: MISSING when any trigger's claim would start a
    run of its own event, else why not."""
    walked = _walked(reply)
    if isinstance(walked, Verdict):
        return walked
    by_name = {t.name: t for t in triggers}
    starts = [r for r in walked if _would_start(r, by_name[r.trigger])]
    if starts:
        return Verdict(MISSING, "; ".join(f"{r.trigger}: would start a new run" for r in starts))
    unknown = [r for r in walked if r.outcome == "unknown"]
    if unknown:
        return Verdict(FAILED, f"{unknown[0].trigger}: {unknown[0].code}: {unknown[0].message}")
    here = [r for r in walked if r.outcome == "previewed" or _stored_refusal(r)]
    if here:
        return Verdict(HERE, "; ".join(_here_why(r) for r in here))
    return _unclaimed(walked)


def claim_verdict(reply: Reply) -> Verdict:
    """A real claim's reply as one verdict: STARTED when any trigger started a run."""
    if reply.status == 503:
        return Verdict(FAILED, f"{reply.body.get('code')}: {reply.body.get('message')}")
    walked = _walked(reply)
    if isinstance(walked, Verdict):
        return walked
    started = [r for r in walked if r.outcome == "started"]
    if started:
        return Verdict(STARTED, "; ".join(f"{r.trigger}: run {r.run_id}" for r in started))
    here = [r for r in walked if r.outcome == "deduplicated" or _stored_refusal(r)]
    if here:
        return Verdict(HERE, "; ".join(_here_why(r) for r in here))
    return _unclaimed(walked)


def _walked(reply: Reply) -> list[TriggerResult] | Verdict:
    """The cleared triggers' results; a verdict already when the walk stopped early."""
    if reply.status in (400, 401):  # a body that does not parse; no trigger cleared
        return Verdict(REFUSED, f"{reply.body.get('code')}: {reply.body.get('message')}")
    return [r for r in reply.walk if r.verified]


def _would_start(result: TriggerResult, trigger: Trigger) -> bool:
    if result.outcome != "previewed" or result.status != 202:
        return False
    # A key that is the event id names this very event: a run under it means the event
    # arrived, even when the key's policy (on_terminal_match: rerun) would start
    # another. A key shared by several events has an event marker that answers for
    # this one, so there "rerun" does mean this event is missing.
    return trigger.key.template != _EVENT_ID_KEY or result.decision == DECISIONS["start"]


def _stored_refusal(result: TriggerResult) -> bool:
    # STATE_* refusals are decisions about the key's run (active, used, conflict,
    # stale): the key has been claimed before.
    return result.outcome in ("refused", "stale") and (result.code or "").startswith("STATE_")


def _here_why(result: TriggerResult) -> str:
    if result.outcome == "previewed":
        return f"{result.trigger}: a claim would {result.decision}"
    if result.outcome == "deduplicated":
        return f"{result.trigger}: run {result.run_id} (deduplicated)"
    return f"{result.trigger}: {result.code}"


def _unclaimed(walked: list[TriggerResult]) -> Verdict:
    refused = [r for r in walked if r.outcome == "refused"]
    if refused:
        return Verdict(REFUSED, "; ".join(f"{r.trigger}: {r.code}: {r.message}" for r in refused))
    if not walked:
        return Verdict(NOT_MATCHED, "no trigger of the path uses this sender's scheme")
    first = walked[0]
    return Verdict(NOT_MATCHED, f"no trigger matched ({first.trigger}: {first.why_not})")
