"""The sweep: keeps Redis memory proportional to the runs inside retention (DESIGN §7).

Ended runs expire on their own, but two things of a workflow would grow forever:
its run index (``realm:{wf}:runs``), whose ids outlive their runs, and its ready
stream (``realm:{wf}:stream``). ``sweep`` trims both in bounded steps
(``sweep.lua``): the index is walked from its oldest entries, ``INDEX_CHUNK`` ids a
call, up to the ids started one ``retention`` ago (no later one can have expired),
removing those whose run hash is gone; the stream loses entries older than the
workflow's ``stream_retention``.

The walk's position is kept in Redis (``realm:{wf}:sweep``), and the script only
writes the index when the position is still the one its caller read: every
gateway replica and worker can run the same sweep, they share one walk, and none
does more than bounded work per tick. ``Sweeper`` runs it in the background of
each ``realm listen`` worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster

from gateway.errors import StoreUnavailable
from gateway.keys import Keys
from gateway.runs import text_of
from gateway.store import RunStore

log = logging.getLogger("realm")

# Index ids per script call: each one costs an EXISTS, and the call blocks Redis.
INDEX_CHUNK = 200
# Stream entries one approximate trim may remove (Redis's own default bound for `~`).
STREAM_TRIM_LIMIT = 10_000
# Script calls per sweep() at most: a backlog (a burst of runs that just expired)
# is worked off at up to CALLS x INDEX_CHUNK ids per tick, never more.
MAX_CALLS = 25
# Seconds between a worker's sweeps (each waits 0.5-1.5 times this: replicas
# started together drift apart).
INTERVAL = 1.0


@dataclass
class SweepReport:
    """What one ``sweep`` did."""

    workflow: str
    calls: int = 0  # script calls
    checked: int = 0  # index ids looked at
    removed: int = 0  # index ids removed: their runs had expired
    trimmed: int = 0  # stream entries removed: older than stream_retention
    moved: int = 0  # calls that found another sweeper had done the chunk first
    wrapped: bool = False  # the walk reached the ids inside retention: it starts over


async def sweep(store: RunStore, workflow: str, *, max_calls: int = MAX_CALLS) -> SweepReport:
    """Trim one workflow's run index and ready stream, in at most ``max_calls`` bounded
    script calls; go on while a call found a backlog. Raises ``StoreUnavailable``
    when Redis cannot be reached or is not ready; safe to run from many processes."""
    wf = store.config.workflow(workflow)
    stream_retention_ms = wf.stream_retention_ms or wf.retention_ms
    report = SweepReport(workflow)
    # A partitioned workflow has an index, a stream and a position per partition;
    # each gets the same bound.
    for keys in store.partitions(workflow):
        for _ in range(max_calls):
            # The store's own retry maps "not now" and a dropped connection to
            # StoreUnavailable; a step is safe to repeat (the position is compared).
            async with store.deadline():
                more = await store._retrying(
                    lambda k=keys: _step(store, k, wf.retention_ms, stream_retention_ms, report)
                )
            if not more:
                break
    return report


async def _step(
    store: RunStore,
    keys: Keys,
    retention_ms: int,
    stream_retention_ms: int,
    report: SweepReport,
) -> bool:
    """One script call; True when there is more to do right away."""
    redis = store.redis
    if isinstance(redis, RedisCluster):
        # redis-py refuses TIME in a cluster pipeline: two calls, the clock of the
        # node that serves the workflow's slot.
        held = await redis.get(keys.sweep())
        node = redis.get_node_from_key(keys.sweep())
        seconds, micros = await redis.time(target_nodes=node)
    else:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.get(keys.sweep())
            pipe.time()
            held, (seconds, micros) = await pipe.execute()
    read_from = held.decode() if held else ""
    # A run expires `retention` after it ended, so only an id that started longer
    # ago than that can have expired: the walk stops there and starts over, and
    # never spends its chunks on the runs inside retention (most of the index).
    cutoff = seconds * 1_000_000 + micros - retention_ms * 1000
    # Inclusive of the stored score: the last id of the previous chunk is read again,
    # so ids sharing that score (a clock set back) are never skipped.
    entries = await redis.zrange(
        keys.runs(), read_from or "-inf", cutoff, byscore=True, offset=0, num=INDEX_CHUNK,
        withscores=True,
    )  # fmt: skip
    ids = [member.decode() for member, _ in entries]
    go_on_from = ""
    if len(entries) == INDEX_CHUNK:
        last = entries[-1][1]
        # A chunk that is all one score (never seen: scores are µs, strictly rising)
        # steps past it rather than reading the same chunk forever.
        go_on_from = _score_text(last if _score_text(last) != read_from else last + 1)
    reply = await store.scripts.sweep(
        [keys.runs(), keys.stream(), keys.sweep(), *(keys.run(i) for i in ids)],
        [read_from, go_on_from, stream_retention_ms, STREAM_TRIM_LIMIT, *ids],
    )
    outcome, removed, trimmed, exact = text_of(reply[0]), reply[1], reply[2], text_of(reply[3])
    report.calls += 1
    report.trimmed += trimmed
    if outcome == "moved":
        report.moved += 1
    else:
        report.checked += len(ids)
        report.removed += removed
        report.wrapped = report.wrapped or go_on_from == ""
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
        workflows = sorted(self.store.config.workflows)
        while True:
            await asyncio.sleep(self.interval * random.uniform(0.5, 1.5))
            await self.tick(workflows)

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
