"""One webhook delivery, top to bottom: verify → parse → match → extract → claim → reply.

No HTTP here: ``handle`` takes the raw body and headers of a delivery to one
path and returns the status and JSON body to answer with.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.ingest import handshakes, replies, sns_certs
from gateway.ingest.body import BodyError, parse_body
from gateway.ingest.idempotency import ExtractError
from gateway.ingest.ordering import OrderValue
from gateway.ingest.triggers import Extracted, Trigger
from gateway.ingest.values import HeaderLookup
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.signatures.sns import Certificates
from gateway.signatures.spec import VerifySpec
from gateway.signatures.verify import verify
from gateway.store.runs import WAITING, StartResult, canonical_params, check_key, fingerprint_of
from gateway.store.runstore import RunStore
from gateway.store.start_results import STATE_EVENT_STALE, STATE_RATE_LIMITED
from gateway.store.starts import Marker

RETRY_AFTER_SECONDS = 5


@dataclass
class TriggerResult:
    """What happened for one trigger of the path; one entry of the reply's ``results``."""

    trigger: str
    workflow: str
    # started | queued | scheduled | deduplicated | stale | rate_limited | refused |
    # ignored; in the walk only: unverified (its
    # signature failed), and for a dry run previewed or unknown (Redis did not answer).
    outcome: str
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
    due_ms: int | None = None  # a scheduled run's due time (server ms)
    # Each step's word on this trigger, for the views that say why (the delivery
    # log, the inspector page, `realm triggers test`): the signature ("ok", the
    # reason it failed, or None when not checked: a replay), whether `when` held
    # (None: not reached) and why not, the key and params extracted, and for a dry
    # run what a claim would decide now.
    signature: str | None = None
    matched: bool | None = None
    why_not: str | None = None
    key: str | None = None
    params: Any = None
    decision: str | None = None
    # Whether this trigger may take the delivery: its signature verified now, or (a
    # replay) verified on arrival under the verify spec it has now. The delivery log
    # keeps it per trigger, and a replay starts runs for these triggers only.
    verified: bool = False

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
        if self.due_ms is not None:
            out["due_ms"] = self.due_ms
        return out


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    results: list[TriggerResult] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    # A handshake's answer is sent as the sender asked for it (``raw``, of
    # ``content_type``); ``body`` then says what it was, for the delivery log.
    raw: bytes | None = None
    content_type: str = "application/json"
    # Whether the delivery's signature passed (the delivery log keeps the headers
    # and body of a verified delivery only).
    verified: bool = False
    # Every trigger of the path, each with every step's word on it (``results`` holds
    # the verified ones, which the sender sees); empty when the walk never began.
    walk: list[TriggerResult] = field(default_factory=list)


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
    on_arrival: Mapping[str, str | None] | None = None,
    rerun: bool = False,
    dry_run: bool = False,
    signatures: Mapping[str, str | None] | None = None,
    query: Mapping[str, str] | None = None,
) -> Reply:
    """The reply to one delivery. ``bounded=False``: the caller bounds the whole
    call with its own timer, so the store's per-claim deadline is skipped.

    A replay from the delivery log (gateway/deliveries/log.py) passes ``on_arrival``: per
    trigger name, None when that trigger verified the delivery on arrival under the
    verify spec it has now, else why not (the log keeps no signature to check again).
    Only the triggers it clears may take the replay; every other one (and one it does
    not name) is ``unverified``. ``rerun``: each matched trigger starts a new run
    whatever its policies say (the old one, if live, is cancelled), and no event or
    body marker is consulted. ``dry_run``: the same walk, but the claim only asks what
    it would decide (``realm triggers test``); nothing is written. ``signatures``:
    what ``check_signatures`` said of this delivery, when the caller has asked already.

    ``Reply.results`` holds every trigger of the path with each step's word on it,
    whatever the reply: the one walk that every view of a delivery renders."""
    # 1. Verify: nothing unverified touches Redis. Triggers of one path usually
    #    share one scheme; each distinct spec is checked once.
    walk = [TriggerResult(t.name, t.workflow, "ignored", 200) for t in triggers]
    passed: list[tuple[TriggerResult, Trigger]] = []
    if on_arrival is not None:
        for result, trigger in zip(walk, triggers, strict=True):
            # The signature stays None for a cleared trigger: not checked now.
            why = on_arrival.get(trigger.name, "not a trigger of this path when it arrived")
            if why is None:
                result.verified = True
                passed.append((result, trigger))
            else:
                result.signature, result.outcome, result.status = why, "unverified", 401
    else:
        if signatures is None:
            certificates = await sns_certs.prepare_delivery([t.verify for t in triggers], body)
            signatures = check_signatures(triggers, headers, body, certificates)
        for result, trigger in zip(walk, triggers, strict=True):
            reason = signatures[trigger.name]
            if reason is None:
                result.signature, result.verified = "ok", True
                passed.append((result, trigger))
            else:
                result.signature, result.outcome, result.status = reason, "unverified", 401
    if not passed:
        if on_arrival is None:
            message = f"signature did not verify: {walk[0].signature}"
        else:
            whys = "; ".join(f"{r.trigger}: {r.signature}" for r in walk)
            message = f"no trigger of the path verified this delivery on arrival ({whys})"
        reply = error_reply(401, "AUTH_REQUIRED", message)
        reply.walk = walk
        return reply

    # 2. Parse, once. A sender's handshake (an endpoint check) is answered now,
    #    writing nothing; some have no body to parse (Microsoft Graph's validationToken).
    try:
        doc, unparsed = parse_body(body, content_type), None
    except BodyError as exc:
        doc, unparsed = None, exc
    shaken = await _handshake(passed, walk, headers, doc, query or {}, dry_run)
    if shaken is not None:
        return shaken
    if unparsed is not None:
        exc = unparsed
        reply = error_reply(400, "VALIDATION_BODY", f"body is not parseable: {exc}")
        for result, _ in passed:  # no trigger can match a body that does not parse
            result.outcome, result.status = "refused", 400
            result.code, result.message = "VALIDATION_BODY", reply.body["message"]
        reply.walk = walk
        reply.verified = True
        return reply

    # 3-4. Match and extract, per trigger.
    claims: list[tuple[TriggerResult, Trigger, Any]] = []
    for result, trigger in passed:
        why_not = trigger.match(headers, doc)
        result.matched = why_not is None
        if why_not is not None:
            result.why_not = why_not
            result.message = f"not matched: {why_not}"
            continue
        wrong_mode = trigger.stripe.refusal(doc) if trigger.stripe is not None else None
        if wrong_mode is not None:
            _refuse(result, wrong_mode)
            continue
        try:
            extracted = trigger.extract(headers, doc, body)
        except ExtractError as exc:
            _refuse(result, exc)
            continue
        result.event_id = extracted.event_id
        result.key = extracted.key
        result.params = extracted.params
        claims.append((result, trigger, extracted))
    results = [result for result, _ in passed]

    if dry_run:
        # The claim step as a question: what would start_run decide now? Nothing
        # is written (gateway/ingest/dryrun.py renders the answers).
        if claims:
            body_digest = hashlib.sha256(body).hexdigest()
            for result, trigger, extracted in claims:
                await _preview(store, result, trigger, extracted, body_digest)
        return Reply(200, {"status": "ok", "dry_run": True}, results, verified=True, walk=walk)

    # 5. Claim, all matched triggers at once (each is its own workflow's key). The
    #    store checks the params against params_schema before any Redis call.
    if claims:
        body_digest = hashlib.sha256(body).hexdigest()
        starts = [
            store.start_run(
                trigger.workflow,
                extracted.params,
                extracted.key,
                "cancel_existing" if rerun else trigger.on_live_match,
                "rerun" if rerun else trigger.on_terminal_match,
                trigger.on_params_mismatch,
                fingerprint=fingerprint_for(trigger, body_digest),
                bounded=bounded,
                markers=_markers(store, trigger, extracted, body_digest, rerun),
                # A replay from the inspector starts now, whatever the trigger waits for.
                flow=None if rerun else trigger.flow,
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
                reply = unavailable_reply(outcome.message)
                reply.walk, reply.verified = walk, True
                return reply
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
        verified=True,
        walk=walk,
    )


def check_signatures(
    triggers: Sequence[Trigger],
    headers: HeaderLookup,
    body: bytes,
    certificates: Certificates | None = None,
) -> dict[str, str | None]:
    """Per trigger name: None when the delivery's signature verifies under that
    trigger's spec, else why not. Triggers of one path usually share one scheme;
    each distinct spec is checked once. ``certificates``: what an ``sns`` trigger's
    check needs, fetched before (``gateway.ingest.sns_certs.prepare_delivery``)."""
    now = time.time()
    checked: dict[int, str | None] = {}
    out: dict[str, str | None] = {}
    for trigger in triggers:
        spec: VerifySpec = trigger.verify
        if id(spec) not in checked:
            checked[id(spec)] = verify(spec, headers, body, now, certificates)
        out[trigger.name] = checked[id(spec)]
    return out


def accepted_reply(
    triggers: Sequence[Trigger],
    signatures: Mapping[str, str | None],
    delivery_id: str,
    why: str,
) -> Reply:
    """202 for a verified delivery kept in the spool: Redis could not take its claims
    (``why``), so there is no run id yet. The triggers that verified it are
    ``accepted``; it is matched and claimed when the spool drains."""
    walk = []
    for trigger in triggers:
        reason = signatures[trigger.name]
        result = TriggerResult(trigger.name, trigger.workflow, "accepted", 202)
        if reason is None:
            result.signature, result.verified = "ok", True
            result.message = "kept in the spool; matched and claimed once Redis answers"
        else:
            result.signature, result.outcome, result.status = reason, "unverified", 401
        walk.append(result)
    results = [r for r in walk if r.verified]
    message = (
        f"{why.removesuffix('; retry').removesuffix(', retry')}. The delivery is kept in this "
        "gateway's spool and its runs start once Redis answers: no run id yet; "
        "the delivery log shows the outcome under this delivery_id"
    )
    body = {
        "status": "ok",
        "outcome": "accepted",
        "delivery_id": delivery_id,
        "message": message,
        "results": [r.as_dict() for r in results],
    }
    return Reply(202, body, results, verified=True, walk=walk)


DECISIONS = {
    "start": "start a new run",
    "rerun": "start a new run that supersedes run {run}",
    "existing": "return run {run} (deduplicated, phase '{phase}')",
    "active": "refuse: STATE_RUN_ALREADY_ACTIVE (run {run} is live)",
    "used": "refuse: STATE_IDEMPOTENCY_KEY_USED (run {run} ended as '{phase}')",
    "conflict": "refuse: STATE_IDEMPOTENCY_KEY_CONFLICT (run {run} has other params)",
    "queue": "queue a new run behind the live runs of its key (run {run} is live)",
    "queue_full": "refuse: STATE_QUEUE_FULL (the queue behind run {run} is full)",
    "schedule": "schedule a new run (debounce, delay)",
    "debounce": "give run {run} (scheduled) these params and push its due time (debounce)",
}
# The status a live claim's reply would carry for each decision (refusal_status's).
DECISION_STATUS = {"start": 202, "rerun": 202, "conflict": 409, "queue": 202, "schedule": 202,
                   "debounce": 202}  # fmt: skip


async def _preview(
    store: RunStore, result: TriggerResult, trigger: Trigger, extracted: Any, body_digest: str
) -> None:
    """A dry run's claim: the checks start_run applies before its claim, then what the
    claim would decide (``result.decision``), or the refusal as a live one says it."""
    try:
        # extract already bounds the key's length; check_key is the store's own word.
        check_key(extracted.key)
        store.config.workflow(trigger.workflow).check_params(extracted.params)
        decision, state = await store.preview_start(
            trigger.workflow, extracted.key, trigger.on_live_match, trigger.on_terminal_match,
            trigger.on_params_mismatch,
            fingerprint_for(trigger, body_digest)
            or fingerprint_of(canonical_params(extracted.params)),
            markers=markers_for(
                store, trigger, extracted.event_id, body_digest, extracted.order,
                extracted.rate_window,
            ),
            flow=trigger.flow,
        )  # fmt: skip
    except StoreUnavailable as exc:
        result.outcome, result.code, result.message = "unknown", exc.code, exc.message
        return
    except RealmError as exc:
        _refuse(result, exc)
        return
    run = state.run_id if state else None
    phase = state.phase if state else None
    result.outcome = "previewed"
    result.decision = DECISIONS[decision].format(run=run, phase=phase)
    result.status = DECISION_STATUS.get(decision, 200)


def markers_for(
    store: RunStore,
    trigger: Trigger,
    event_id: str,
    body_digest: str,
    order: OrderValue | None = None,
    window: str | None = None,
) -> list[Marker]:
    """What this delivery's claim must also answer for (one piece of work, one run).

    A key built from something other than the event id (a fixed key, a template) is
    shared by several events on purpose, and its policies (cancel_existing, rerun,
    fail) are for *different* events meeting on it: a redelivery of one event must
    get the run that event got, not a new decision. A key that is the event id needs
    no marker: the key's own policies say what a redelivery does (rerun_if_failed
    lets GitHub's "Redeliver" retry a failed run). An event id that is only the
    body's hash (``missing: content_hash``) is no sender's id: one body may be sent
    for several events (a nightly cron), and a singleton may rerun on
    exactly the same body, so it gets no marker either.

    The replay guard (a body seen again under another event id) is for an event id
    the signature does not cover, a header's: an id read from the body is the same
    whenever the body is, so the guard could never find anything there.

    An ordered trigger's event always has its marker (its redelivery gets the run it
    got, before the order is looked at: an event that started a run is never stale
    later), and the order's own, last: the entity's mark, which the claim compares.
    A rate-limited trigger's window comes last of all (``window``: its name).
    """
    markers: list[Marker] = []
    sender_id = not (trigger.event_id.missing == "content_hash" and event_id == body_digest)
    if (trigger.key.template != "{event_id}" or order is not None) and sender_id:
        markers.append(store.event_marker(trigger.workflow, trigger.name, event_id))
    if trigger.replay_guard and trigger.event_id.header is not None:
        markers.append(store.replay_marker(trigger.workflow, trigger.name, body_digest, event_id))
    if order is not None:
        assert trigger.order is not None
        markers.append(
            store.order_marker(
                order.entity, order.number, order.rank, trigger.order.ties, order.text
            )
        )
    if window is not None:
        assert trigger.rate_limit is not None
        limit = trigger.rate_limit
        markers.append(store.rate_marker(trigger.name, window, limit.limit, limit.period_ms))
    return markers


def _markers(
    store: RunStore, trigger: Trigger, extracted: Extracted, body_digest: str, rerun: bool
) -> list[Marker]:
    # A rerun starts a new run whatever a marker, the order or a rate limit would say.
    if rerun:
        return []
    return markers_for(
        store, trigger, extracted.event_id, body_digest, extracted.order, extracted.rate_window
    )


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
    result.due_ms = started.due_ms
    result.message = replies.start_sentence(started)
    if started.debounced:
        # It moved the key's scheduled run: this delivery's params are the ones it runs with.
        result.outcome, result.status = "scheduled", 202
    elif started.deduped:
        result.outcome, result.status = "deduplicated", 200
    elif started.phase in WAITING:
        result.outcome, result.status = started.phase, 202
    else:
        result.outcome, result.status = "started", 202


async def _handshake(
    passed: list[tuple[TriggerResult, Trigger]],
    walk: list[TriggerResult],
    headers: HeaderLookup,
    doc: object,
    query: Mapping[str, str],
    dry_run: bool,
) -> Reply | None:
    """The reply when this verified delivery is a sender's handshake for one of the
    triggers that verified it (the first, in the file's order), else None."""
    for result, trigger in passed:
        answer = handshakes.answer_post(trigger, headers, doc, query)
        if answer is None and handshakes.is_sns_confirmation(trigger, doc):
            answer = await _confirm_subscription(trigger, doc, dry_run)
        if answer is not None:
            return handshake_reply(answer, result, walk)
    return None


async def _confirm_subscription(trigger: Trigger, doc: Any, dry_run: bool) -> handshakes.Answer:
    """A verified SNS SubscriptionConfirmation: its SubscribeURL visited (not in a dry
    run). When SNS does not confirm it, 502: SNS sends the confirmation again."""
    what = "sns subscription confirmation"
    if dry_run:
        return handshakes.Answer(200, b'{"status":"ok"}', "application/json", what)
    why = await sns_certs.visit_subscribe_url(trigger.verify, doc.get("SubscribeURL"))
    if why is None:
        return handshakes.Answer(200, b'{"status":"ok"}', "application/json", what)
    body = {"status": "error", "code": "SNS_CONFIRMATION_FAILED",
            "message": f"the subscription could not be confirmed: {why}"}  # fmt: skip
    return handshakes.Answer(502, orjson.dumps(body), "application/json", what)


def handshake_reply(
    answer: handshakes.Answer, result: TriggerResult, walk: list[TriggerResult]
) -> Reply:
    """A handshake's answer as a reply: sent as the sender asked for it, recorded as
    ``outcome: handshake`` (the other triggers of the path: ignored)."""
    result.outcome, result.status = "handshake", answer.status
    result.message = f"answered the sender's handshake ({answer.what}); nothing was started"
    body = {"status": "ok", "outcome": "handshake", "handshake": answer.what}
    return Reply(
        answer.status, body, [result], verified=True, walk=walk, raw=answer.body,
        content_type=answer.content_type,
    )  # fmt: skip


_OUTCOMES_OF = {STATE_EVENT_STALE: "stale", STATE_RATE_LIMITED: "rate_limited"}


def _refuse(result: TriggerResult, error: RealmError) -> None:
    # A stale or rate-limited event is its own outcome: nothing is wrong with it, it
    # came too late, or too soon.
    result.outcome = _OUTCOMES_OF.get(error.code, "refused")
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
