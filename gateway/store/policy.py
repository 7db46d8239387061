"""The decision table of a start with a key, in Python: what a start with a key would do now.

``start_run.lua`` is the authority and decides atomically; this mirror answers
``realm triggers test`` (a dry run that writes nothing) and is the model the
property-based tests check the script against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Decision = Literal[
    "start",
    "rerun",
    "existing",
    "active",
    "used",
    "conflict",
    "queue",
    "queue_full",
    "schedule",
    "debounce",
]


@dataclass(frozen=True)
class KeyState:
    """What a key pointer holds: the run it names, that run's phase, its fingerprint."""

    run_id: str
    phase: str
    fingerprint: str
    live: int = 0  # under on_live_match queue: the key's live runs ('live' on the pointer)
    waiting: int = 0  # runs in the key's queue


@dataclass(frozen=True)
class FlowState:
    """What a start's flow adds to the decision (see gateway.store.runs.Flow)."""

    limit: int = 1
    queue_max: int = 0
    keep: str = "all"
    schedules: bool = False
    debounces: bool = False


def decide(
    current: KeyState | None,
    on_live_match: str,
    on_terminal_match: str,
    on_params_mismatch: str,
    fingerprint: str,
    flow: FlowState | None = None,
) -> Decision:
    started: Decision = "schedule" if flow is not None and flow.schedules else "start"
    if current is None:
        return started
    mismatch = current.fingerprint != fingerprint
    existing: Decision = "conflict" if mismatch and on_params_mismatch == "reject" else "existing"
    if current.phase == "scheduled":
        return "debounce" if flow is not None and flow.debounces else existing
    if on_live_match == "queue" and flow is not None:
        live = current.live or (1 if current.phase == "running" else 0)
        if live >= flow.limit:
            if flow.keep == "all" and current.waiting >= flow.queue_max:
                return "queue_full"
            return "queue"
        if live:
            return "start"
    if current.phase == "running":
        return {"use_existing": existing, "fail": "active"}.get(on_live_match, "rerun")
    if on_terminal_match == "reuse":
        return existing
    if on_terminal_match == "reject":
        return "used"
    if on_terminal_match == "rerun_if_failed" and current.phase == "completed":
        return existing
    return "schedule" if started == "schedule" else "rerun"
