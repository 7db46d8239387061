"""Writing the delivery log: each worker's ``DeliveryRecorder``, and ``write_records``.

Recording builds a delivery's record as soon as it is answered, while its objects
are still in the CPU's caches, and appends the stored string (records.pack_record) to
a list; the delivery's objects are let go at once. The recorder writes what gathered
every 100 ms, at most ``WRITE_CHUNK`` records per script call (record_deliveries.lua),
and each write also trims the log to ``settings.delivery_retention`` and
``settings.max_deliveries`` (the oldest ids read first: the script is told every key
it touches). The log is a record of what happened, not part of the
run-start promise: records still buffered when a worker dies, or past what a worker
buffers while Redis refuses them, are lost and counted
(``realm_delivery_log_dropped_total``).

Each flush is bounded by the store's deadline (``settings.redis_timeout``): a
connection that stops answering costs one flush, never the log. A record's id is
fixed before its first write, so a record sent again after a failure (the write may
have landed with its reply lost) overwrites itself instead of being logged twice.
While Redis refuses the log, a worker says so once, and once more when it recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, NamedTuple

from prometheus_client import Counter

from gateway.deliveries.records import LogKeys, build_record, id_floor, pack_record
from gateway.ingest.received import Received
from gateway.model.config import Settings
from gateway.store.runstore import RunStore

log = logging.getLogger("realm")

DELIVERY_LOG_DROPPED = Counter(
    "realm_delivery_log_dropped_total",
    "Delivery log records a worker dropped unwritten (Redis refused them for longer "
    "than its buffer lasts); the deliveries themselves were answered",
)

FLUSH_SECONDS = 0.1
WRITE_CHUNK = 32  # records per script call (~100 KB of 3 KB deliveries)
TRIM_SECONDS = 1.0  # an idle worker's trim of the log, without records to write
# Records one worker buffers while Redis does not take them; older ones are dropped.
MAX_BUFFERED = 10_000
# Old records one call may trim beyond those it adds: enough to keep up, never a
# walk of a large backlog in one call.
TRIM_SLACK = 100


@dataclass
class _Outage:
    """The delivery log failing in this worker: since when, and what it cost."""

    since: float  # time.monotonic()
    written: int = 0  # records written meanwhile (a flush that got part-way)
    dropped: int = 0


class Packed(NamedTuple):
    """One record ready to be written: its id, its index ('v' verified, 'r' refused)
    and its stored string."""

    id: bytes
    kind: str
    stored: bytes


def pack(item: Received, settings: Settings) -> Packed:
    """``item``'s record as the log stores it, under the item's id (a new one when it
    has none yet). Params nested deeper than JSON encoders go (a hostile body, read by
    a params JSONPath such as ``$.all``) are left out of the record, not its delivery."""
    try:
        delivery_id, values = build_record(item, settings)
    except TypeError:  # orjson: "Recursion limit reached"
        delivery_id, values = build_record(item, settings, with_params=False)
    return Packed(delivery_id.encode(), str(values[1]), pack_record(values))


class DeliveryRecorder:
    """One worker's writer of the delivery log: ``add`` on the hot path, one bounded
    flush per ``FLUSH_SECONDS`` for everything added meanwhile."""

    def __init__(self, store: RunStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings  # replaced on a reload (gateway/serving/reload.py)
        # The records that wait for the next flush, as stored: strings in tuples, which
        # the garbage collector does not track. Holding each delivery's objects (reply,
        # headers, body) until the flush instead cost about 20 us of CPU per delivery
        # and most of the p99, in the collector's passes over them.
        self._buffer: list[Packed] = []
        self._outage: _Outage | None = None

    def add(self, item: Received) -> None:
        settings = self.settings
        if not settings.delivery_log:
            return
        buffer = self._buffer
        # Its id is fixed now: sent again after a failure, the record overwrites itself.
        buffer.append(pack(item, settings))
        if len(buffer) > MAX_BUFFERED:
            self._drop(len(buffer) - MAX_BUFFERED)

    def _drop(self, n: int) -> None:
        """Drop the ``n`` oldest buffered records, counted."""
        del self._buffer[:n]
        DELIVERY_LOG_DROPPED.inc(n)
        if self._outage is not None:
            self._outage.dropped += n

    async def flush(self) -> None:
        """Write what is buffered, within one deadline. What was not written (the
        chunk that failed and those after it) stays buffered for the next flush."""
        records, self._buffer = self._buffer, []
        if not records:
            return
        written: list[str] = []
        try:
            async with self.store.deadline():
                await _write(self.store, self.settings, records, written)
        except BaseException as exc:
            # Redis down, full or silent: the deliveries were answered anyway. A
            # cancel (shutdown) keeps them too, for close() to write.
            self._buffer[:0] = records[len(written) :]
            if len(self._buffer) > MAX_BUFFERED:
                self._drop(len(self._buffer) - MAX_BUFFERED)
            if not isinstance(exc, Exception):
                raise
            self._failed(exc, len(written))
            return
        self._written(len(written))

    def _failed(self, exc: Exception, written: int) -> None:
        if self._outage is not None:
            self._outage.written += written
            return
        self._outage = _Outage(time.monotonic(), written)
        # The type only: a reply's text may quote the server.
        log.warning(
            '{"event":"delivery_log","level":"warning","state":"failing","error":"%s",'
            '"buffered":%d,"message":"the delivery log is not written: records are kept '
            '(up to %d) and written once Redis takes them"}',
            type(exc).__name__, len(self._buffer), MAX_BUFFERED,
        )  # fmt: skip

    def _written(self, written: int) -> None:
        outage, self._outage = self._outage, None
        if outage is None:
            return
        log.info(
            '{"event":"delivery_log","level":"info","state":"recovered","seconds":%.1f,'
            '"written":%d,"dropped":%d}',
            time.monotonic() - outage.since, outage.written + written, outage.dropped,
        )  # fmt: skip

    async def run(self) -> None:
        """Runs for the life of the app; a last flush happens at shutdown (``close``).
        While nothing is recorded it still trims every ``TRIM_SECONDS``, so the log
        empties once its retention has passed, with no delivery to trigger it."""
        idle = 0.0
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            if self._buffer:
                idle = 0.0
                await self.flush()
                continue
            idle += FLUSH_SECONDS
            if idle >= TRIM_SECONDS and self.settings.delivery_log:
                idle = 0.0
                with contextlib.suppress(Exception):  # the next flush or trim tries again
                    async with self.store.deadline():
                        await _write(self.store, self.settings, [], [])

    async def close(self) -> None:
        """The last flush; what it could not write is lost, and said so."""
        await self.flush()
        if self._buffer:
            lost = len(self._buffer)
            self._drop(lost)
            log.warning(
                '{"event":"delivery_log","level":"warning","state":"closed","dropped":%d}', lost
            )


async def write_records(
    store: RunStore, settings: Settings, items: Sequence[Received]
) -> list[str]:
    """Write ``items`` to the log now, within the store's deadline; their ids, in order."""
    packed = [pack(item, settings) for item in items]
    async with store.deadline():
        return await _write(store, settings, packed, [])


async def _write(
    store: RunStore, settings: Settings, records: Sequence[Packed], written: list[str]
) -> list[str]:
    """Write ``records`` in chunks, adding each chunk's ids to ``written`` once it is
    in: after a failure, ``written`` says how far it got. At most ``WRITE_CHUNK``
    records go in one script call: a script holds Redis while it runs, and the claims
    waiting behind one large call would see its whole length as latency. No records:
    a trim.

    What to trim is read once for the whole batch, and each chunk trims its share."""
    keys = LogKeys(store.prefix)
    # Ids sort by time as bytes: those below the floor are past retention.
    floor = id_floor(int(time.time() * 1000) - settings.delivery_retention_ms).encode()
    adding = (
        [r.id for r in records if r.kind == "v"],
        [r.id for r in records if r.kind == "r"],
    )
    trims = await _trim_candidates(store, keys, settings, adding, floor)
    for start in range(0, max(len(records), 1), WRITE_CHUNK):
        part = records[start : start + WRITE_CHUNK]
        shares = [
            trim.share([r.id for r in part if r.kind == kind])
            for trim, kind in zip(trims, "vr", strict=True)
        ]
        await _write_chunk(store, settings, keys, part, shares, floor)
        written += [r.id.decode() for r in part]
    return written


async def _write_chunk(
    store: RunStore,
    settings: Settings,
    keys: LogKeys,
    records: Sequence[Packed],
    trims: list[list[bytes]],
    floor: bytes,
) -> None:
    if not records and not any(trims):
        return
    # Every key the script touches is named here: the records written, then the
    # records it may trim (a cluster must know them all before it runs the script).
    # The script reads each record's id from its key.
    script_keys = [keys.index, keys.refused]
    script_keys += [keys.record(r.id) for r in records]
    script_keys += [keys.record(i) for ids in trims for i in ids]
    args: list[str | int | bytes] = [
        len(keys.base),
        settings.delivery_retention_ms,
        settings.max_deliveries,
        refused_cap(settings),
        len(records),
        len(trims[0]),
        sum(1 for i in trims[0] if i < floor),
        len(trims[1]),
        sum(1 for i in trims[1] if i < floor),
    ]
    for r in records:
        args += [r.kind, r.stored]  # the id is in the key
    await store.call_script(store.scripts.record_deliveries, script_keys, args)


@dataclass
class _Trim:
    """One index's trim while a batch is written chunk by chunk: its size and cap and its
    oldest ids as read (the first ``past`` of them past retention), and the ids the
    batch has written to it so far, which the cap drops too when they are older: ids
    of one millisecond, or of a worker whose clock is behind, do not arrive in order."""

    old: list[bytes]
    past: int
    size: int
    cap: int
    budget: int  # at most the records added + TRIM_SLACK: one call never walks a backlog
    floor: bytes
    new: list[bytes] = field(default_factory=list)

    def share(self, written: list[bytes]) -> list[bytes]:
        """What the chunk that writes ``written`` to this index trims, oldest first:
        the ids past retention, and as many as would leave the index over its cap. The
        script counts again, so a guess from a stale read never trims too much."""
        self.size += len(written)
        # A record written already past retention stays until the next write: the ids
        # a write returns are always there to be read right after it.
        self.new += [i for i in written if i >= self.floor]
        wanted = min(max(self.past, self.size - self.cap, 0), self.budget)
        if wanted <= 0:
            return []  # the usual flush: under the cap, nothing past retention
        self.new.sort()
        part = list(islice(heapq.merge(self.old, self.new), wanted))
        if part:
            gone = set(part)
            self.old = [i for i in self.old if i not in gone]
            self.new = [i for i in self.new if i not in gone]
            # Those past retention are the oldest: the first taken.
            self.past = max(self.past - len(part), 0)
            self.size -= len(part)
            self.budget -= len(part)
        return part


async def _trim_candidates(
    store: RunStore,
    keys: LogKeys,
    settings: Settings,
    adding: tuple[list[bytes], list[bytes]],
    floor: bytes,
) -> tuple[_Trim, _Trim]:
    """Each index's trim for a batch adding ``adding``: its size and its oldest ids,
    read in one round trip (those past retention, and as many as the batch would put
    over the cap).

    A batch reads only the indexes it adds to (the refused one seldom): an index is
    trimmed when records go in, and by the idle trim (no items: both indexes). The
    oldest ids are read as many as the batch adds, which covers those past retention
    unless every one read is past it: then those past it are read up to the budget."""
    indexes = (keys.index, keys.refused)
    caps = (settings.max_deliveries, refused_cap(settings))
    budgets = [len(new) + TRIM_SLACK for new in adding]
    idle = not any(adding)
    read = [idle or bool(new) for new in adding]

    async def read_old() -> list[Any]:
        # A fresh pipeline per try: a failed pipeline forgets its commands.
        async with store.redis.pipeline(transaction=False) as pipe:
            for index, new, wanted in zip(indexes, adding, read, strict=True):
                if wanted:
                    pipe.zcard(index)
                    # At the cap a write drops as many as it adds: the oldest so many
                    # (one at least: 0..-1 is all).
                    pipe.zrange(index, 0, max(len(new), 1) - 1)
            return await pipe.execute()

    replies = iter(await store.call(read_old))
    trims: list[_Trim] = []
    for which, index in enumerate(indexes):
        if not read[which]:
            trims.append(_Trim([], 0, 0, caps[which], 0, floor))
            continue
        size, oldest = next(replies), next(replies)
        n = min(int(size) + len(adding[which]) - caps[which], budgets[which])
        if oldest and oldest[-1] < floor:
            # Every id read is past retention: more may be.
            n = max(n, budgets[which])
        if n > len(oldest):
            # Further over its cap (it was lowered, say), or past retention: so many more.
            oldest = await store.call(lambda index=index, n=n: store.redis.zrange(index, 0, n - 1))
        old = sorted(oldest)
        past = sum(1 for i in old if i < floor)
        trims.append(_Trim(old, past, int(size), caps[which], budgets[which], floor))
    return trims[0], trims[1]


def refused_cap(settings: Settings) -> int:
    """Refused deliveries kept: a tenth of the cap, at least 100."""
    return max(100, settings.max_deliveries // 10)
