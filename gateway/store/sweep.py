"""The sweep: keeps Redis memory proportional to the runs inside retention.

Ended runs expire on their own, but three things of a workflow would grow forever:
its run index (``realm:{wf}:runs``), whose ids outlive their runs, its key index
(``realm:{wf}:keys``, what reconcile walks), whose keys outlive their pointers and
run sets, and its ready stream (``realm:{wf}:stream``). ``sweep`` trims them in
bounded steps (``sweep.lua``): each index is walked from its oldest entries,
``INDEX_CHUNK`` members a call, up to those started (claimed) one ``retention`` ago
(no later one can have expired), removing those whose run hash (whose pointer and run
set) is gone. The stream loses entries older than the workflow's ``stream_retention``,
but never one a runner has not read while its run still needs it: the trim stops
below the runners' first undelivered (and oldest pending) entry, and a third walk,
over the entries older than that, deletes the unread ones whose run ended or moved on.
Runners read through their consumer group, so the group has to exist before any
trim: ``Sweeper.create_groups`` makes it on every stream when the listener starts and
when a reload brings another config, and the script makes it on a stream that lost it.
The stream's calls also delete the group's consumers that left (``CONSUMER_IDLE_MS``
idle, nothing pending), a bounded number per call.

Each walk's position is kept in Redis (``realm:{wf}:sweep``, ``realm:{wf}:keysweep``,
``realm:{wf}:streamsweep``), and the script only removes members when the position is
still the one its caller read: every gateway replica and worker can run the same
sweep, they share one walk, and none does more than bounded work per tick.
``Sweeper`` runs it in the background of each ``realm listen`` worker.

The same worker starts scheduled runs (debounce, delay) once they are due
(``start_due``): it reads the workflow's due index (``realm:{wf}:due``) about twice a
second and calls ``start_due.lua`` for each run whose time has come, which checks the
run's phase, so a run is started once however many workers see it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.model.errors import StoreUnavailable
from gateway.store.keys import Keys
from gateway.store.runs import text_of
from gateway.store.runstore import RunStore

log = logging.getLogger("realm")

# Index members (stream entries) per script call: each one costs an EXISTS (an HMGET),
# and the call blocks Redis.
INDEX_CHUNK = 200
STREAM_CHUNK = 200
# Stream entries one approximate trim may remove (Redis's own default bound for `~`).
STREAM_TRIM_LIMIT = 10_000
# Script calls per walk and partition per sweep() at most: a backlog (a burst of runs
# that just expired) is worked off at up to CALLS x CHUNK members per tick, never more.
MAX_CALLS = 25
# A consumer of the runners' group idle this long with nothing pending has left (a
# runner reads at least every second or so while it runs); deleting one loses
# nothing, and a runner still there gets it back with its next read. At most
# CONSUMER_LIMIT are deleted per call.
CONSUMER_IDLE_MS = 3_600_000
CONSUMER_LIMIT = 100
# Seconds between a worker's sweeps (each waits 0.5-1.5 times this: replicas
# started together drift apart).
INTERVAL = 1.0
# Seconds between a worker's looks at the due index: a scheduled run starts within
# about a second of its time, from whichever worker looks first.
DUE_INTERVAL = 0.5
# Due runs read (and started, one script call each) per read of the due index.
DUE_CHUNK = 100
# A run due within this many ms by this machine's clock is read: the script decides by
# the server's, so a clock a little behind the server's delays no start.
DUE_SLACK_MS = 1_000


@dataclass
class SweepReport:
    """What one ``sweep`` did."""

    workflow: str
    calls: int = 0  # script calls
    checked: int = 0  # run index ids looked at
    removed: int = 0  # run index ids removed: their runs had expired
    trimmed: int = 0  # stream entries removed from its head: older than stream_retention
    moved: int = 0  # calls that found another sweeper had done the chunk first
    wrapped: bool = False  # the run index walk reached the ids inside retention: it starts over
    keys_checked: int = 0  # key index members looked at
    keys_removed: int = 0  # key index members removed: their pointer and run set had expired
    entries_checked: int = 0  # stream entries older than stream_retention looked at
    entries_removed: int = 0  # of those, unread ones deleted: their run no longer needed them
    consumers_removed: int = 0  # consumers of the runners' group deleted: they had left
    started: int = 0  # scheduled runs started: they were due


Kind = Literal["runs", "keys", "stream"]


@dataclass(frozen=True)
class _Walk:
    """One thing a sweep walks, and how a member's keys are named."""

    kind: Kind
    walked: str  # the index, or the stream
    position: str
    # The keys a member is checked against, from what names them: the member itself
    # (a run id, an idempotency key), or the run id of a stream entry.
    member_keys: Callable[[str], list[str]]
    per: int  # len(member_keys(m))


Members = list[tuple[str, list[str]]]  # each member, with the keys it is checked against


@dataclass(frozen=True)
class _Ages:
    """The ages that decide what a sweep may look at, and when a consumer has left."""

    retention_ms: int
    stream_retention_ms: int
    consumer_idle_ms: int


async def start_due(store: RunStore, workflow: str, *, max_calls: int = MAX_CALLS) -> int:
    """Start the workflow's scheduled runs whose due time has come; how many this call
    started. Safe to run from many processes: each run starts once."""
    started = 0
    for keys in store.partitions(workflow):
        for _ in range(max_calls):
            async with store.deadline():
                count, more = await store._retrying(lambda k=keys: _start_due_chunk(store, k))
            started += count
            if not more:
                break
    return started


async def _start_due_chunk(store: RunStore, keys: Keys) -> tuple[int, bool]:
    horizon = int(time.time() * 1000) + DUE_SLACK_MS
    due = await store.redis.zrangebyscore(keys.due(), "-inf", horizon, start=0, num=DUE_CHUNK)
    started = 0
    for member in due:
        run_id = text_of(member)
        script_keys = [keys.due(), keys.run(run_id), keys.stream()]
        reply = await store.scripts.start_due(script_keys, [run_id])
        if text_of(reply[0]) == "need_key":
            # A keyed run: again, with its pointer, which then says it runs.
            script_keys.append(keys.pointer(text_of(reply[1])))
            reply = await store.scripts.start_due(script_keys, [run_id])
        started += text_of(reply[0]) == "started"
    return started, len(due) == DUE_CHUNK and started > 0


def _walks(keys: Keys) -> tuple[_Walk, ...]:
    runs = _Walk("runs", keys.runs(), keys.sweep(), lambda r: [keys.run(r)], 1)
    # A key is gone when both are: a run set without a pointer (or the reverse) is a
    # group reconcile still has to see.
    by_key = _Walk("keys", keys.key_index(), keys.key_sweep(),
                   lambda k: [keys.pointer(k), keys.key_runs(k)], 2)  # fmt: skip
    stream = _Walk("stream", keys.stream(), keys.stream_sweep(), lambda r: [keys.run(r)], 1)
    return runs, by_key, stream


async def sweep(
    store: RunStore,
    workflow: str,
    *,
    max_calls: int = MAX_CALLS,
    consumer_idle_ms: int = CONSUMER_IDLE_MS,
) -> SweepReport:
    """Trim one workflow's run index, key index and ready stream, in at most
    ``max_calls`` bounded script calls per walk and partition; go on while a call
    found a backlog. Raises ``StoreUnavailable`` when Redis cannot be reached or is
    not ready; safe to run from many processes."""
    wf = store.config.workflow(workflow)
    ages = _Ages(wf.retention_ms, wf.stream_retention_ms or wf.retention_ms, consumer_idle_ms)
    report = SweepReport(workflow)
    # A partitioned workflow has indexes, a stream and positions per partition; each
    # gets the same bound.
    for keys in store.partitions(workflow):
        for walk in _walks(keys):
            for _ in range(max_calls):
                # The store's own retry maps "not now" and a dropped connection to
                # StoreUnavailable; a step is safe to repeat (the position is compared).
                async with store.deadline():
                    more = await store._retrying(lambda w=walk: _step(store, w, ages, report))
                if not more:
                    break
    return report


async def _step(store: RunStore, walk: _Walk, ages: _Ages, report: SweepReport) -> bool:
    """One script call (none when an index walk has nothing to look at); True when
    there is more to do right away."""
    redis = store.redis
    held, now_us = await _position_and_time(redis, walk.position)
    read_from = held.decode() if held else ""
    if walk.kind == "stream":
        members, go_on_from = await _old_entries(
            redis, walk, read_from, now_us // 1000 - ages.stream_retention_ms
        )
        limits = [ages.stream_retention_ms, STREAM_TRIM_LIMIT, ages.consumer_idle_ms,
                  CONSUMER_LIMIT]  # fmt: skip
    else:
        # A run expires `retention` after it ended, and a key's pointer and run set
        # with the run, so only a member scored (started, claimed) longer ago than that
        # can have expired: the walk stops there and starts over, and never spends its
        # chunks on what is inside retention (most of the index).
        members, go_on_from = await _old_members(
            redis, walk, read_from, now_us - ages.retention_ms * 1000
        )
        if not members and not read_from:
            return False  # nothing old enough, and no position to clear: no call
        limits = ["", "", "", ""]
    reply = await store.scripts.sweep(
        [walk.walked, walk.position, *(k for _, keys in members for k in keys)],
        [read_from, go_on_from, "stream" if walk.kind == "stream" else "index", walk.per,
         *limits, *(m for m, _ in members)],
    )  # fmt: skip
    outcome, exact = text_of(reply[0]), text_of(reply[3])
    removed, trimmed, consumers = reply[1], reply[2], reply[4]
    report.calls += 1
    if outcome == "moved":
        report.moved += 1
    elif walk.kind == "runs":
        report.checked += len(members)
        report.removed += removed
        report.wrapped = report.wrapped or go_on_from == ""
    elif walk.kind == "keys":
        report.keys_checked += len(members)
        report.keys_removed += removed
    else:
        report.entries_checked += len(members)
        report.entries_removed += removed
    report.trimmed += trimmed
    report.consumers_removed += consumers
    backlog = outcome == "swept" and go_on_from != "" and removed > 0
    return backlog or (trimmed > 0 and exact == "0")


async def _position_and_time(
    redis: Redis | RedisCluster, position: str
) -> tuple[bytes | None, int]:
    """The walk's stored position, and the server's clock in microseconds."""
    if isinstance(redis, RedisCluster):
        # redis-py refuses TIME in a cluster pipeline: two calls, the clock of the
        # node that serves the workflow's slot.
        held = await redis.get(position)
        node = redis.get_node_from_key(position)
        seconds, micros = await redis.time(target_nodes=node)
    else:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.get(position)
            pipe.time()
            held, (seconds, micros) = await pipe.execute()
    return held, seconds * 1_000_000 + micros


async def _old_members(
    redis: Redis | RedisCluster, walk: _Walk, read_from: str, cutoff: int
) -> tuple[Members, str]:
    """An index chunk from ``read_from`` up to the score ``cutoff``; where the walk goes on."""
    # Inclusive of the stored score: the last member of the previous chunk is read
    # again, so members sharing that score (a clock set back) are never skipped.
    entries = await redis.zrange(
        walk.walked, read_from or "-inf", cutoff, byscore=True, offset=0, num=INDEX_CHUNK,
        withscores=True,
    )  # fmt: skip
    members = [(m.decode(), walk.member_keys(m.decode())) for m, _ in entries]
    if len(entries) < INDEX_CHUNK:
        return members, ""
    last = entries[-1][1]
    # A chunk that is all one score (never seen: scores are µs, strictly rising)
    # steps past it rather than reading the same chunk forever.
    return members, _score_text(last if _score_text(last) != read_from else last + 1)


async def _old_entries(
    redis: Redis | RedisCluster, walk: _Walk, read_from: str, threshold_ms: int
) -> tuple[Members, str]:
    """Stream entries after ``read_from`` older than ``threshold_ms``, each with the run
    hash it names; where the walk goes on."""
    if threshold_ms <= 0:
        return [], ""
    entries = await redis.xrange(
        walk.walked, f"({read_from}" if read_from else "-", str(threshold_ms - 1),
        count=STREAM_CHUNK,
    )  # fmt: skip
    members = [
        (text_of(entry_id), walk.member_keys(text_of(fields.get(b"run_id", b""))))
        for entry_id, fields in entries
    ]
    return members, members[-1][0] if len(members) == STREAM_CHUNK else ""


def _score_text(score: float) -> str:
    # Scores are whole microseconds: below 2^53, so exact as floats.
    return str(int(score)) if score.is_integer() else repr(score)


class Sweeper:
    """Sweeps every workflow of a store about every ``interval`` seconds, for the life
    of a ``realm listen`` worker. It never raises: a Redis outage is logged once
    when it starts and once when it ends, not on every tick."""

    def __init__(self, store: RunStore, interval: float = INTERVAL) -> None:
        self.store = store
        self.interval = interval
        self.ticks = 0  # sweeps of all workflows tried (for tests and metrics)
        self.due_started = 0  # scheduled runs this worker started
        self._failing: str | None = None  # the error being quiet about

    async def create_groups(self) -> None:
        """The runners' consumer group on every stream of every workflow of the store
        (``RunStore.ensure_groups``), within one ``redis_timeout``: the listener makes
        them as it starts, so a step waits in its stream until a runner reads it, however
        late the first runner comes. Logged, not raised, when Redis cannot be asked (as
        an outage of the sweep: the same trouble): the sweep's script makes a missing
        group before it trims that stream."""
        store = self.store
        try:
            async with store.deadline():
                for name in sorted(store.config.workflows):
                    await store.ensure_groups(name)
        except StoreUnavailable as exc:
            self._trouble("unavailable", f"sweep: {exc.message}; trying again every tick")
        except Exception as exc:  # the type only: a reply may quote anything
            self._trouble(type(exc).__name__, f"runner groups not made: {type(exc).__name__}")

    async def follow(self, store: RunStore) -> None:
        """Sweep ``store`` (a reload's, serving another config) from the next tick on,
        after making the runners' groups of its workflows and partitions."""
        self.store = store
        await self.create_groups()

    async def run(self) -> None:
        await self.create_groups()
        await asyncio.gather(self._sweeps(), self._due_starts())

    async def _sweeps(self) -> None:
        while True:
            await asyncio.sleep(self.interval * random.uniform(0.5, 1.5))
            # Read at each tick: a reload (gateway/serving/reload.py) may replace the store.
            await self.tick(sorted(self.store.config.workflows))

    async def _due_starts(self) -> None:
        while True:
            await asyncio.sleep(min(self.interval, DUE_INTERVAL) * random.uniform(0.5, 1.5))
            try:
                for name in sorted(self.store.config.workflows):
                    self.due_started += await start_due(self.store, name)
            except StoreUnavailable as exc:
                self._trouble("unavailable", f"sweep: {exc.message}; trying again every tick")
            except Exception as exc:  # a bug must not stop a worker serving deliveries
                self._trouble(type(exc).__name__, f"due runs not started: {type(exc).__name__}")

    async def tick(self, workflows: list[str]) -> None:
        try:
            for name in workflows:
                await sweep(self.store, name)
        except StoreUnavailable as exc:
            self._trouble("unavailable", f"sweep: {exc.message}; trying again every tick")
        except Exception as exc:  # a bug must not stop a worker serving deliveries
            self._trouble(type(exc).__name__, f"sweep failed: {type(exc).__name__}: {exc}")
        else:
            if self._failing is not None:
                log.info("sweep: trimming resumed")
                self._failing = None
        finally:
            self.ticks += 1

    def _trouble(self, kind: str, message: str) -> None:
        # Keyed on the kind of trouble, not its text: an outage's messages differ
        # from try to try (refused, timed out, loading).
        if self._failing != kind:
            log.warning(message)
            self._failing = kind
