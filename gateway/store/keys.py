"""Every Redis key name the gateway uses.

All keys of one workflow share the hash tag ``{<workflow>}``, so every script
runs in one cluster slot. Workflow names are restricted at config load to
characters that cannot open or close a tag (nor ``#``).

A busy workflow may be spread over N partitions (``partitions: N``): partition i
has the tag ``{<workflow>#i}``, so the partitions can live on different cluster
primaries. An idempotency key always lives in the partition its stable hash
names, so every decision about one key is still one script in one slot; a run's
id carries its partition in its last four hex digits, so a run is found from its
id alone.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from gateway.model.config import DEFAULT_PREFIX


@dataclass(frozen=True)
class Keys:
    """Key names for one workflow."""

    prefix: str
    workflow: str
    # None: the workflow is not partitioned (tag {wf}); else its partition (tag {wf#i}).
    partition: int | None = None
    # Built once: every run start names several keys.
    _base: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tag = self.workflow if self.partition is None else f"{self.workflow}#{self.partition}"
        object.__setattr__(self, "_base", f"{self.prefix}:{{{tag}}}")

    def meta(self) -> str:
        """Hash: the workflow's layout (``partitions``), written once; always under the
        unpartitioned tag, so every process finds it whatever it believes N is."""
        return f"{self.prefix}:{{{self.workflow}}}:meta"

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
        """String: the index score the shared sweep (gateway/store/sweep.py) goes on from."""
        return f"{self._base}:sweep"

    def key_index(self) -> str:
        """Sorted set: every idempotency key whose pointer or run set may exist, scored by
        the time it was last claimed (µs). Reconcile walks it; the sweep trims it."""
        return f"{self._base}:keys"

    def key_sweep(self) -> str:
        """String: the key-index score the shared sweep goes on from."""
        return f"{self._base}:keysweep"

    def stream_sweep(self) -> str:
        """String: the stream entry id the shared sweep's walk of old entries goes on from."""
        return f"{self._base}:streamsweep"

    def pointer(self, key: str) -> str:
        """Hash: the run an idempotency key points at, with its phase and step."""
        return f"{self._base}:key:{key}"

    def key_runs(self, key: str) -> str:
        """Sorted set: every run ever started under an idempotency key."""
        return f"{self._base}:keyruns:{key}"

    def queue(self, key: str) -> str:
        """The runs waiting behind the key's live runs (zset, by arrival)."""
        return f"{self._base}:queue:{key}"

    def queued(self) -> str:
        """Every run of the workflow waiting in a key's queue (zset, by arrival)."""
        return f"{self._base}:queued"

    def due(self) -> str:
        """The workflow's scheduled runs (debounce, delay), by due time in ms (zset)."""
        return f"{self._base}:due"

    def event(self, trigger: str, event_id: str) -> str:
        """String: the run one event of a trigger was given, so that its redelivery is
        deduplicated whatever the key's policy. The trigger's name is length-prefixed:
        no two (trigger, event id) pairs share a name."""
        return f"{self._base}:event:{len(trigger)}:{trigger}:{event_id}"

    def body(self, trigger: str, digest: str) -> str:
        """String: the run and event id a verified body was first seen with (replay guard)."""
        return f"{self._base}:body:{digest}:{trigger}"

    def order(self, entity: str) -> str:
        """String: the highest order value (number, rank and text) that started a run
        for an entity of an ordered trigger's workflow (kept for its retention)."""
        return f"{self._base}:order:{entity}"

    def rate(self, trigger: str, window: str) -> str:
        """Sorted set: the runs a trigger's rate limit let start in one window (a value
        of its key; '' the trigger's own), by start time (ms), for one period."""
        return f"{self._base}:rate:{len(trigger)}:{trigger}:{window}"

    def request(self, request_id: str) -> str:
        """String: the outcome of an API or MCP start with this request id, for its retry."""
        return f"{self._base}:request:{request_id}"

    def op(self, op_id: str) -> str:
        """String: the recorded reply of one mutating call, for its resend (short TTL)."""
        return f"{self._base}:op:{op_id}"


def keys_for(workflow: str, prefix: str = DEFAULT_PREFIX) -> Keys:
    return Keys(prefix, workflow)


def partition_keys(prefix: str, workflow: str, partitions: int) -> list[Keys]:
    """The Keys of each partition: one unpartitioned Keys when ``partitions`` is 1."""
    if partitions == 1:
        return [Keys(prefix, workflow)]
    return [Keys(prefix, workflow, i) for i in range(partitions)]


def partition_of(text: str, partitions: int) -> int:
    """The partition an idempotency key (or a request or batch id) lives in: CRC-32,
    the same in every process and every version (Python's hash() is salted)."""
    return zlib.crc32(text.encode()) % partitions if partitions > 1 else 0


def run_id_in(run_id: str, partition: int) -> str:
    """``run_id`` with its last four hex digits naming ``partition`` (a UUID still)."""
    return f"{run_id[:-4]}{partition:04x}"


def partition_of_run(run_id: str, partitions: int) -> int:
    """The partition a run of a partitioned workflow lives in, from its id."""
    if partitions == 1:
        return 0
    try:
        return int(run_id[-4:], 16) % partitions
    except ValueError:
        return 0
