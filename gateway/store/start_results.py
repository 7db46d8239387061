"""What a start's script call replied, as the store's caller sees it: a ``StartResult``
for a run started, queued, scheduled or deduplicated, and a ``RealmError`` with a
stable code for a refusal (stale, rate limited, a full queue, the key's policies).

Apart from the starts themselves (gateway/store/starts.py) because these are the
words: each refusal's message, and the preview's comparison of an order mark.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.model.errors import RealmError, StoreUnavailable
from gateway.model.words import plural
from gateway.store.runs import StartResult

# A delivery older than one that already started a run for its entity (an ordered
# trigger's refusal, stored as nothing: the entity's mark only moves forward).
STATE_EVENT_STALE = "STATE_EVENT_STALE"
# A start a trigger's rate limit turned away (nothing stored: a later delivery may start).
STATE_RATE_LIMITED = "STATE_RATE_LIMITED"
# A start that would queue behind its key's live runs, whose queue holds its max already.
STATE_QUEUE_FULL = "STATE_QUEUE_FULL"


def stale_against(tag: str, held: str) -> bool:
    """start_run.lua's comparison: is the delivery ``tag`` (``number rank ties text``)
    stale against the entity's mark ``held`` (``number rank text``)?"""
    number, rank, ties, _ = tag.split(" ", 3)
    held_number, held_rank, _ = held.split(" ", 2)
    mine, theirs = (float(number), int(rank)), (float(held_number), int(held_rank))
    return mine < theirs or (mine == theirs and ties == "refuse")


def stale_error(workflow: str, tag: str, newest: str) -> RealmError:
    """The refusal of the delivery ``tag`` (an order marker's), ``newest`` being the
    text of the entity's mark."""
    text = tag.split(" ", 3)[3]
    return RealmError(
        STATE_EVENT_STALE,
        f"Stale event for workflow '{workflow}': its order value {text} is not after "
        f"{newest}, of an event that already started a run for the same entity; "
        "nothing was started.",
    )


def rate_error(workflow: str, tag: str, wait_ms: int) -> RealmError:
    limit, period_ms = tag.split(" ")
    return RealmError(
        STATE_RATE_LIMITED,
        f"Rate limit for workflow '{workflow}': {plural(int(limit), 'run')} per "
        f"{_duration(int(period_ms))} already started for this key; the next may start in "
        f"{max(wait_ms / 1000, 0.001):g} s. Nothing was started.",
    )


def _duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms} ms"


def start_result(
    workflow: str,
    key: str | None,
    on_live_match: str,
    on_terminal_match: str,
    reply: list[Any],
    tags: Mapping[str, str] | None = None,
    new_id: str | None = None,
) -> StartResult:
    # Every element is a Lua string, so bytes; a scheduled run's due time comes last.
    outcome, run_id, phase, step, rerun_of, mismatch = (x.decode() for x in reply[:6])
    due_ms = int(reply[6]) if len(reply) > 6 and reply[6] else None
    if outcome == "stale":
        # `phase` holds the text of the entity's mark as the script read it.
        raise stale_error(workflow, (tags or {})["order"], phase)
    if outcome == "rate_limited":
        # `phase` holds the ms until the window has room.
        raise rate_error(workflow, (tags or {})["rate"], int(float(phase)))
    if outcome == "queue_full":
        raise RealmError(
            STATE_QUEUE_FULL,
            f"Queue full for workflow '{workflow}': {plural(int(phase), 'run')} already "
            "wait behind the live runs of this idempotency key; nothing was queued.",
        )
    if outcome in ("queued", "scheduled") and (new_id is None or run_id == new_id):
        return StartResult(
            run_id=run_id,
            workflow=workflow,
            deduped=False,
            phase=phase,
            next_step=None,
            rerun_of=rerun_of or None,
            superseded_by="on_terminal_match" if rerun_of else None,
            due_ms=due_ms,
        )
    if outcome == "scheduled":
        return StartResult(
            run_id=run_id,
            workflow=workflow,
            deduped=True,
            phase=phase,
            next_step=None,
            due_ms=due_ms,
            debounced=True,
        )
    if outcome == "created":
        superseded_by = None
        if rerun_of:
            superseded_by = (
                "on_live_match" if on_live_match == "cancel_existing" else "on_terminal_match"
            )
        return StartResult(
            run_id=run_id,
            workflow=workflow,
            deduped=False,
            phase=phase,
            next_step=step if phase == "running" else None,
            rerun_of=rerun_of or None,
            superseded_by=superseded_by,
        )
    if outcome == "existing":
        return StartResult(
            run_id=run_id,
            workflow=workflow,
            deduped=True,
            phase=phase,
            next_step=step if phase == "running" else None,
            params_mismatch=mismatch == "1",
            due_ms=due_ms if phase == "scheduled" else None,
        )
    if outcome == "active":
        raise RealmError(
            "STATE_RUN_ALREADY_ACTIVE",
            f"Idempotency key for workflow '{workflow}' is owned by an active run "
            f"'{run_id}' (phase '{phase}').",
        )
    if outcome == "used":
        raise RealmError(
            "STATE_IDEMPOTENCY_KEY_USED",
            f"Idempotency key for workflow '{workflow}' was already used by run '{run_id}' "
            f"(phase '{phase}'); on_terminal_match is '{on_terminal_match}'.",
        )
    if outcome == "conflict":
        raise RealmError(
            "STATE_IDEMPOTENCY_KEY_CONFLICT",
            f"Idempotency key for workflow '{workflow}' is owned by run '{run_id}' "
            f"(phase '{phase}'), which was started with different params; "
            "on_params_mismatch is 'reject'.",
        )
    raise StoreUnavailable(f"unexpected reply from start_run for key {key!r}: {outcome}")
