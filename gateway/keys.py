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

    def pointer(self, key: str) -> str:
        """Hash: the run an idempotency key points at, with its phase and step."""
        return f"{self._base}:key:{key}"

    def key_runs(self, key: str) -> str:
        """Sorted set: every run ever started under an idempotency key."""
        return f"{self._base}:keyruns:{key}"


def keys_for(workflow: str, prefix: str = DEFAULT_PREFIX) -> Keys:
    return Keys(prefix, workflow)
