"""The sweep: keeps Redis memory proportional to the runs inside retention.

Ended runs expire on their own, but three things of a workflow would grow forever:
its run index (``realm:{wf}:runs``), whose ids outlive their runs, its key index
(``realm:{wf}:keys``, what reconcile walks), whose keys outlive their pointers and
run sets, and its ready stream (``realm:{wf}:stream``). ``sweep`` trims them in
bounded steps (``sweep.lua``): each index is walked from its oldest entries,
``INDEX_CHUNK`` members a call, up to those started (claimed) one ``retention`` ago
(no later one can have expired), removing those whose run hash (whose pointer and run
set) is gone; the stream loses entries older than the workflow's ``stream_retention``.

Each walk's position is kept in Redis (``realm:{wf}:sweep``, ``realm:{wf}:keysweep``),
and the script only writes the index when the position is still the one its caller
read: every gateway replica and worker can run the same sweep, they share one walk,
and none does more than bounded work per tick. ``Sweeper`` runs it in the background
of each ``realm listen`` worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster

from gateway.model.errors import StoreUnavailable
from gateway.store.keys import Keys
from gateway.store.runs import text_of
from gateway.store.runstore import RunStore

log = logging.getLogger("realm")

# Index members per script call: each one costs an EXISTS, and the call blocks Redis.
INDEX_CHUNK = 200
# Stream entries one approximate trim may remove (Redis's own default bound for `~`).
STREAM_TRIM_LIMIT = 10_000
# Script calls per index and partition per sweep() at most: a backlog (a burst of runs
# that just expired) is worked off at up to CALLS x INDEX_CHUNK members per tick, never more.
MAX_CALLS = 25
# Seconds between a worker's sweeps (each waits 0.5-1.5 times this: replicas
# started together drift apart).
INTERVAL = 1.0


@dataclass
class SweepReport:
    """What one ``sweep`` did."""

    workflow: str
    calls: int = 0  # script calls
    checked: int = 0  # run index ids looked at
    removed: int = 0  # run index ids removed: their runs had expired
    trimmed: int = 0  # stream entries removed: older than stream_retention
    moved: int = 0  # calls that found another sweeper had done the chunk first
    wrapped: bool = False  # the run index walk reached the ids inside retention: it starts over
    keys_checked: int = 0  # key index members looked at
    keys_removed: int = 0  # key index members removed: their pointer and run set had expired


@dataclass(frozen=True)
class _Walk:
    """One index a sweep walks, and how a member's keys are named."""

    runs: bool  # the run index (its calls also trim the stream), else the key index
    index: str
    position: str
    member_keys: Callable[[str], list[str]]  # the keys whose absence means it is gone
    per: int  # len(member_keys(m))


def _walks(keys: Keys) -> tuple[_Walk, _Walk]:
    runs = _Walk(True, keys.runs(), keys.sweep(), lambda r: [keys.run(r)], 1)
    # A key is gone when both are: a run set without a pointer (or the reverse) is a
    # group reconcile still has to see.
    by_key = _Walk(False, keys.key_index(), keys.key_sweep(),
                   lambda k: [keys.pointer(k), keys.key_runs(k)], 2)  # fmt: skip
    return runs, by_key


async def sweep(store: RunStore, workflow: str, *, max_calls: int = MAX_CALLS) -> SweepReport:
    """Trim one workflow's run index, key index and ready stream, in at most
    ``max_calls`` bounded script calls per index and partition; go on while a call
    found a backlog. Raises ``StoreUnavailable`` when Redis cannot be reached or is
    not ready; safe to run from many processes."""
    wf = store.config.workflow(workflow)
    stream_retention_ms = wf.stream_retention_ms or wf.retention_ms
    report = SweepReport(workflow)
    # A partitioned workflow has indexes, a stream and positions per partition; each
    # gets the same bound.
    for keys in store.partitions(workflow):
        for walk in _walks(keys):
            for _ in range(max_calls):
                # The store's own retry maps "not now" and a dropped connection to
                # StoreUnavailable; a step is safe to repeat (the position is compared).
                async with store.deadline():
                    more = await store._retrying(
                        lambda k=keys, w=walk: _step(
                            store, k, w, wf.retention_ms, stream_retention_ms, report
                        )
                    )
                if not more:
                    break
    return report


async def _step(
    store: RunStore,
    keys: Keys,
    walk: _Walk,
    retention_ms: int,
    stream_retention_ms: int,
    report: SweepReport,
) -> bool:
    """One script call (none when the walk has nothing to look at); True when there
    is more to do right away."""
    redis = store.redis
    if isinstance(redis, RedisCluster):
        # redis-py refuses TIME in a cluster pipeline: two calls, the clock of the
        # node that serves the workflow's slot.
        held = await redis.get(walk.position)
        node = redis.get_node_from_key(walk.position)
        seconds, micros = await redis.time(target_nodes=node)
    else:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.get(walk.position)
            pipe.time()
            held, (seconds, micros) = await pipe.execute()
    read_from = held.decode() if held else ""
    # A run expires `retention` after it ended, and a key's pointer and run set with
    # the run, so only a member scored (started, claimed) longer ago than that can have
    # expired: the walk stops there and starts over, and never spends its chunks on
    # what is inside retention (most of the index).
    cutoff = seconds * 1_000_000 + micros - retention_ms * 1000
    # Inclusive of the stored score: the last member of the previous chunk is read
    # again, so members sharing that score (a clock set back) are never skipped.
    entries = await redis.zrange(
        walk.index, read_from or "-inf", cutoff, byscore=True, offset=0, num=INDEX_CHUNK,
        withscores=True,
    )  # fmt: skip
    if not entries and not read_from and not walk.runs:
        return False  # nothing old enough, and no position to clear: no call
    members = [member.decode() for member, _ in entries]
    go_on_from = ""
    if len(entries) == INDEX_CHUNK:
        last = entries[-1][1]
        # A chunk that is all one score (never seen: scores are µs, strictly rising)
        # steps past it rather than reading the same chunk forever.
        go_on_from = _score_text(last if _score_text(last) != read_from else last + 1)
    reply = await store.scripts.sweep(
        [walk.index, keys.stream(), walk.position,
         *(k for m in members for k in walk.member_keys(m))],
        [read_from, go_on_from, stream_retention_ms if walk.runs else "",
         STREAM_TRIM_LIMIT, walk.per, *members],
    )  # fmt: skip
    outcome, removed, trimmed, exact = text_of(reply[0]), reply[1], reply[2], text_of(reply[3])
    report.calls += 1
    report.trimmed += trimmed
    if outcome == "moved":
        report.moved += 1
    elif walk.runs:
        report.checked += len(members)
        report.removed += removed
        report.wrapped = report.wrapped or go_on_from == ""
    else:
        report.keys_checked += len(members)
        report.keys_removed += removed
    backlog = outcome == "swept" and go_on_from != "" and removed > 0
    return backlog or (trimmed > 0 and exact == "0")


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
        self._failing: str | None = None  # the error being quiet about

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval * random.uniform(0.5, 1.5))
            # Read at each tick: a reload (gateway/serving/reload.py) may replace the store.
            await self.tick(sorted(self.store.config.workflows))

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
