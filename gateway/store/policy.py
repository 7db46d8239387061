"""The decision table of a start with a key, in Python: what a start with a key would do now.

``start_run.lua`` is the authority and decides atomically; this mirror answers
``realm triggers test`` (a dry run that writes nothing) and is the model the
property-based tests check the script against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Decision = Literal["start", "rerun", "existing", "active", "used", "conflict"]


@dataclass(frozen=True)
class KeyState:
    """What a key pointer holds: the run it names, that run's phase, its fingerprint."""

    run_id: str
    phase: str
    fingerprint: str


def decide(
    current: KeyState | None,
    on_live_match: str,
    on_terminal_match: str,
    on_params_mismatch: str,
    fingerprint: str,
) -> Decision:
    if current is None:
        return "start"
    mismatch = current.fingerprint != fingerprint
    existing: Decision = "conflict" if mismatch and on_params_mismatch == "reject" else "existing"
    if current.phase == "running":
        return {"use_existing": existing, "fail": "active"}.get(on_live_match, "rerun")
    if on_terminal_match == "reuse":
        return existing
    if on_terminal_match == "reject":
        return "used"
    if on_terminal_match == "rerun_if_failed" and current.phase == "completed":
        return existing
    return "rerun"
