"""Every Redis key name the gateway uses (DESIGN §7).

All keys of one workflow share the hash tag ``{<workflow>}``, so every script
runs in one cluster slot. Workflow names are restricted at config load to
characters that cannot open or close a tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PREFIX = "realm"


@dataclass(frozen=True)
class Keys:
    """Key names for one workflow."""

    prefix: str
    workflow: str
    # Built once: every run start names five keys.
    _base: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_base", f"{self.prefix}:{{{self.workflow}}}")

    def run(self, run_id: str) -> str:
        """Hash: one run's record."""
        return f"{self._base}:run:{run_id}"

    def runs(self) -> str:
        """Sorted set: every run id of the workflow, scored by start time (µs, strictly rising)."""
        return f"{self._base}:runs"

    def stream(self) -> str:
        """Stream: one entry per step that is ready for a runner."""
        return f"{self._base}:stream"

    def sweep(self) -> str:
        """String: the index score the shared sweep (gateway/sweep.py) goes on from."""
        return f"{self._base}:sweep"

    def pointer(self, key: str) -> str:
        """Hash: the run an idempotency key points at, with its phase and step."""
        return f"{self._base}:key:{key}"

    def key_runs(self, key: str) -> str:
        """Sorted set: every run ever started under an idempotency key."""
        return f"{self._base}:keyruns:{key}"

    def event(self, trigger: str, event_id: str) -> str:
        """Hash: the run one event of a trigger was given, so that its redelivery is
        deduplicated whatever the key's policy. The trigger's name is length-prefixed:
        no two (trigger, event id) pairs share a name."""
        return f"{self._base}:event:{len(trigger)}:{trigger}:{event_id}"

    def body(self, trigger: str, digest: str) -> str:
        """Hash: the run and event id a verified body was first seen with (replay guard)."""
        return f"{self._base}:body:{digest}:{trigger}"

    def request(self, request_id: str) -> str:
        """Hash: the outcome of an API or MCP start with this request id, for its retry."""
        return f"{self._base}:request:{request_id}"

    def op(self, op_id: str) -> str:
        """String: the recorded reply of one mutating call, for its resend (short TTL)."""
        return f"{self._base}:op:{op_id}"


def keys_for(workflow: str, prefix: str = DEFAULT_PREFIX) -> Keys:
    return Keys(prefix, workflow)
