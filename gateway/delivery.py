"""One webhook delivery, top to bottom: verify → parse → match → extract → claim → reply.

No HTTP here: ``handle`` takes the raw body and headers of a delivery to one
path and returns the status and JSON body to answer with (DESIGN §6).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway import replies
from gateway.errors import RealmError, StoreUnavailable
from gateway.extract import BodyError, ExtractError, HeaderLookup, parse_body
from gateway.runs import StartResult
from gateway.store import Marker, RunStore
from gateway.triggers import Trigger
from gateway.verify import VerifySpec, verify

RETRY_AFTER_SECONDS = 5


@dataclass
class TriggerResult:
    """What happened for one trigger of the path; one entry of the reply's ``results``."""

    trigger: str
    workflow: str
    outcome: str  # started | deduplicated | refused | ignored
    status: int
    run_id: str | None = None
    deduped: bool | None = None
    code: str | None = None
    message: str | None = None
    event_id: str | None = None
    params_mismatch: bool = False
    rerun_of: str | None = None
    phase: str | None = None
    next_step: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {
            "trigger": self.trigger,
            "workflow": self.workflow,
            "outcome": self.outcome,
            "run_id": self.run_id,
            "deduped": self.deduped,
            "rerun_of": self.rerun_of,
            "phase": self.phase,
            "next_step": self.next_step,
            "code": self.code,
            "message": self.message,
        }
        if self.params_mismatch:
            out["params_mismatch"] = True
        return out


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    results: list[TriggerResult] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)


def error_reply(status: int, code: str, message: str, **headers: str) -> Reply:
    return Reply(status, {"status": "error", "code": code, "message": message}, headers=headers)


def unavailable_reply(message: str) -> Reply:
    return error_reply(
        503, "STORE_UNAVAILABLE", message, **{"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


async def handle(
    store: RunStore,
    triggers: Sequence[Trigger],
    headers: HeaderLookup,
    content_type: str | None,
    body: bytes,
    *,
    bounded: bool = True,
) -> Reply:
    """The reply to one delivery. ``bounded=False``: the caller bounds the whole
    call with its own timer, so the store's per-claim deadline is skipped."""
    # 1. Verify: nothing unverified touches Redis. Triggers of one path usually
    #    share one scheme; each distinct spec is checked once.
    now = time.time()
    checked: dict[int, str | None] = {}
    verified: list[Trigger] = []
    reasons: list[str] = []
    for trigger in triggers:
        spec: VerifySpec = trigger.verify
        if id(spec) not in checked:
            checked[id(spec)] = verify(spec, headers, body, now)
        reason = checked[id(spec)]
        if reason is None:
            verified.append(trigger)
        else:
            reasons.append(reason)
    if not verified:
        return error_reply(401, "AUTH_REQUIRED", f"signature did not verify: {reasons[0]}")

    # 2. Parse, once.
    try:
        doc = parse_body(body, content_type)
    except BodyError as exc:
        return error_reply(400, "VALIDATION_BODY", f"body is not parseable: {exc}")

    # 3-4. Match and extract, per trigger.
    results: list[TriggerResult] = []
    claims: list[tuple[TriggerResult, Trigger, Any]] = []
    for trigger in verified:
        result = TriggerResult(trigger.name, trigger.workflow, "ignored", 200)
        results.append(result)
        why_not = trigger.match(headers, doc)
        if why_not is not None:
            result.message = f"not matched: {why_not}"
            continue
        try:
            extracted = trigger.extract(headers, doc, body)
        except ExtractError as exc:
            _refuse(result, exc)
            continue
        result.event_id = extracted.event_id
        claims.append((result, trigger, extracted))

    # 5. Claim, all matched triggers at once (each is its own workflow's key). The
    #    store checks the params against params_schema before any Redis call.
    if claims:
        body_digest = hashlib.sha256(body).hexdigest()
        starts = [
            store.start_run(
                trigger.workflow,
                extracted.params,
                extracted.key,
                trigger.on_live_match,
                trigger.on_terminal_match,
                trigger.on_params_mismatch,
                fingerprint=fingerprint_for(trigger, body_digest),
                bounded=bounded,
                markers=markers_for(store, trigger, extracted.event_id, body_digest),
            )
            for _, trigger, extracted in claims
        ]
        outcomes: list[StartResult | BaseException]
        if len(starts) == 1:
            # The usual case: no task to create and gather.
            try:
                outcomes = [await starts[0]]
            except RealmError as exc:
                outcomes = [exc]
        else:
            outcomes = await asyncio.gather(*starts, return_exceptions=True)
        for (result, _, _), outcome in zip(claims, outcomes, strict=True):
            if isinstance(outcome, StoreUnavailable):
                # Some claims may have been stored: the sender's retry deduplicates them.
                return unavailable_reply(outcome.message)
            if isinstance(outcome, RealmError):
                _refuse(result, outcome)
            elif isinstance(outcome, StartResult):
                _claimed(result, outcome)
            else:
                raise outcome

    # 6. Reply: a refusal the sender must see wins over a start; a start (202)
    #    over a deduplication or a non-match (200).
    status = max((r.status for r in results), key=_status_rank)
    return Reply(
        status,
        {"status": "ok" if status < 400 else "error", "results": [r.as_dict() for r in results]},
        results,
    )


def markers_for(store: RunStore, trigger: Trigger, event_id: str, body_digest: str) -> list[Marker]:
    """What this delivery's claim must also answer for (DESIGN §1, promise 1).

    A key built from something other than the event id (a fixed key, a template) is
    shared by several events on purpose, and its policies (cancel_existing, rerun,
    fail) are for *different* events meeting on it: a redelivery of one event must
    get the run that event got, not a new decision. A key that is the event id needs
    no marker: the key's own policies say what a redelivery does (rerun_if_failed
    lets GitHub's "Redeliver" retry a failed run). An event id that is only the
    body's hash (``missing: content_hash``) is no sender's id: one body may be sent
    for several events (a nightly cron), and DESIGN §3 lets a singleton rerun on
    exactly the same body, so it gets no marker either.
    """
    markers: list[Marker] = []
    sender_id = not (trigger.event_id.missing == "content_hash" and event_id == body_digest)
    if trigger.key.template != "{event_id}" and sender_id:
        markers.append(store.event_marker(trigger.workflow, trigger.name, event_id))
    if trigger.replay_guard:
        markers.append(store.replay_marker(trigger.workflow, trigger.name, body_digest, event_id))
    return markers


def fingerprint_for(trigger: Trigger, body_digest: str) -> str | None:
    """What a repeat is compared with. A key that is the event id names one event,
    so its body must not change: compare bodies. A key built from the payload
    (a pull request and its head sha, say) is shared by several events on
    purpose: compare the params they yield (None: the store's default)."""
    return body_digest if trigger.key.template == "{event_id}" else None


def _status_rank(status: int) -> int:
    return {200: 0, 202: 1}.get(status, status)


def _claimed(result: TriggerResult, started: StartResult) -> None:
    result.run_id = started.run_id
    result.deduped = started.deduped
    result.params_mismatch = started.params_mismatch
    result.rerun_of = started.rerun_of
    result.phase = started.phase
    result.next_step = started.next_step
    result.message = replies.start_sentence(started)
    if started.deduped:
        result.outcome, result.status = "deduplicated", 200
    else:
        result.outcome, result.status = "started", 202


def _refuse(result: TriggerResult, error: RealmError) -> None:
    result.outcome = "refused"
    result.code = error.code
    result.message = error.message
    result.status = refusal_status(error.code)


def refusal_status(code: str) -> int:
    """A refusal by policy is a stored decision the sender should not retry (200),
    except a body that differs under a used event id (409); bad input is 422."""
    if code == "STATE_IDEMPOTENCY_KEY_CONFLICT":
        return 409
    if code.startswith("STATE_"):
        return 200
    return 422
