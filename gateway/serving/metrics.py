"""Prometheus metrics served at ``/metrics``.

``realm listen`` runs its workers as separate processes, so it points
prometheus_client's multiprocess mode at a private folder before they start;
``/metrics`` then sums every worker, whichever one answers the scrape.

The listener's scrape also reads each workflow's step streams (``queue_text``):
how many ready steps wait and for how long, and how many runs wait (queued behind
their key, scheduled for later), read from Redis, so every worker reports
the same figures. A read costs a few commands per partition (some 1 300 for 5
workflows of 64 partitions), so a worker reads at most once a second and one read
at a time, whatever the number of scrapes (``QueueGauges``). A runner
(``realm work --metrics-port``) serves its own counters (``gateway.runners.metrics``).
Each capability defines the counters it updates in its own module; they all land in
prometheus_client's one registry, which ``render`` reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.store.runstore import RunStore

log = logging.getLogger("realm.metrics")


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


# -- the listener's view of the step streams (read at scrape time) -----------------

GROUP = "runners"  # the consumer group every runner reads with (RUNNERS_SPEC)
QUEUE_TIMEOUT = 1.0  # seconds a scrape waits for Redis, at most, before it answers
QUEUE_MAX_AGE = 1.0  # seconds a worker serves the figures it read before reading again


class QueueGauges:
    """One worker's step-stream gauges (``queue_text``): a scrape within
    ``QUEUE_MAX_AGE`` of the last read gets its figures; a scrape while a read is in
    flight waits for that read. So scrapes, however many and however often, cost Redis
    one read a second at most."""

    def __init__(self, max_age: float = QUEUE_MAX_AGE, timeout: float = QUEUE_TIMEOUT) -> None:
        self.max_age = max_age
        self.timeout = timeout
        self._text = b""
        self._read_at = -math.inf  # time.monotonic() when the last read ended
        self._read_of: object = None  # the config read (a reload may add workflows)
        self._reading: asyncio.Future[None] | None = None

    async def text(self, store: RunStore) -> bytes:
        fresh = time.monotonic() - self._read_at < self.max_age
        if self._reading is None and not (fresh and self._read_of is store.config):
            self._reading = asyncio.ensure_future(self._read(store))
        if self._reading is not None:
            # Shielded: a scrape that goes away does not cancel the read others wait for.
            await asyncio.shield(self._reading)
        return self._text

    async def _read(self, store: RunStore) -> None:
        try:
            self._text = await queue_text(store, self.timeout)
            self._read_of = store.config
        finally:
            self._read_at = time.monotonic()
            self._reading = None


class _Figures:
    """One workflow's streams, summed over its partitions."""

    __slots__ = ("new", "oldest_ms", "queued", "scheduled", "taken")

    def __init__(self) -> None:
        self.new = 0
        self.taken = 0
        self.queued = 0  # runs waiting in their key's queue
        self.scheduled = 0  # runs waiting for their due time
        self.oldest_ms: int | None = None

    def saw(self, entry_id: Any) -> None:
        if entry_id is None:
            return
        ms = int(_text(entry_id).split("-", 1)[0])
        self.oldest_ms = ms if self.oldest_ms is None else min(self.oldest_ms, ms)


async def _read_workflow(store: RunStore, workflow: str) -> _Figures:
    """Two pipelined round trips for all the workflow's partitions (on a cluster, one
    per node holding some), none of which walks a stream: each stream's groups; then
    per stream the runners' group's pending summary and the first entry it has not
    taken (before any runner read it: the stream's length and first entry)."""
    figures = _Figures()
    parts = store.partitions(workflow)
    streams = [keys.stream() for keys in parts]
    async with store.redis.pipeline(transaction=False) as pipe:
        for keys in parts:
            pipe.xinfo_groups(keys.stream())
            pipe.zcard(keys.queued())
            pipe.zcard(keys.due())
        read = await pipe.execute(raise_on_error=False)
    replies = read[0::3]
    for counted in (*read[1::3], *read[2::3]):
        if isinstance(counted, Exception):
            raise counted
    figures.queued = sum(read[1::3])
    figures.scheduled = sum(read[2::3])
    groups: list[dict[str, Any] | None] = []
    async with store.redis.pipeline(transaction=False) as pipe:
        for stream, reply in zip(streams, replies, strict=True):
            if isinstance(reply, Exception):
                if "no such key" not in str(reply).lower():
                    raise reply
                continue  # no stream: no step of this partition was ever ready
            group = next((g for g in reply if _text(g.get("name")) == GROUP), None)
            if group is None:
                pipe.xlen(stream)
                pipe.xrange(stream, "-", "+", count=1)
            else:
                pipe.xpending(stream, GROUP)
                last = _text(group["last-delivered-id"])
                pipe.xrange(stream, f"({last}", "+", count=1)
            groups.append(group)
        replies = await pipe.execute() if groups else []
    for i, group in enumerate(groups):
        counted, following = replies[2 * i], replies[2 * i + 1]
        first = following[0][0] if following else None
        if group is None:
            # No runner has read this stream yet: every entry in it is undelivered.
            figures.new += int(counted)
            figures.saw(first)
            continue
        figures.taken += int(counted["pending"])
        figures.saw(counted["min"] if counted["pending"] else None)
        lag = group.get("lag")
        if lag is None:
            # Redis cannot tell (entries deleted past the group's position): at least
            # one waits if one follows the group's position.
            lag = len(following)
        figures.new += int(lag)
        if int(lag):
            figures.saw(first)
    return figures


class _Snapshot(Collector):
    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self.families)


async def queue_text(store: RunStore, timeout: float = QUEUE_TIMEOUT) -> bytes:
    """The step-stream gauges of every workflow, as exposition text. Bounded: each
    workflow's reads get ``timeout`` seconds in all; a workflow that does not answer
    in time (or fails) is left out and counted in ``realm_queue_read_ok`` 0, and the
    scrape still answers."""
    workflows = sorted(store.config.workflows)
    tasks = {wf: asyncio.ensure_future(_read_workflow(store, wf)) for wf in workflows}
    done, late = await asyncio.wait(tasks.values(), timeout=timeout) if tasks else (set(), set())
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    waiting = GaugeMetricFamily(
        "realm_steps_waiting",
        "Ready steps in the streams, by state: new (not yet taken by a runner) or taken "
        "(delivered, not acknowledged: in a runner's hands or waiting for a retry)",
        labels=["workflow", "state"],
    )
    oldest = GaugeMetricFamily(
        "realm_steps_oldest_age_seconds",
        "Age of the oldest ready step not yet acknowledged (0 when none waits)",
        labels=["workflow"],
    )
    runs_waiting = GaugeMetricFamily(
        "realm_runs_waiting",
        "Runs that have not started, by phase: queued (behind their key's live runs) or "
        "scheduled (debounce, delay: waiting for their due time)",
        labels=["workflow", "phase"],
    )
    read_ok = GaugeMetricFamily(
        "realm_queue_read_ok",
        "1 if this scrape read the workflow's streams from Redis in time, else 0",
        labels=["workflow"],
    )
    now_ms = time.time() * 1000
    failed = []
    for wf, task in tasks.items():
        figures = _result(task, done)
        read_ok.add_metric([wf], 0 if figures is None else 1)
        if figures is None:
            failed.append(wf)
            continue
        waiting.add_metric([wf, "new"], figures.new)
        waiting.add_metric([wf, "taken"], figures.taken)
        runs_waiting.add_metric([wf, "queued"], figures.queued)
        runs_waiting.add_metric([wf, "scheduled"], figures.scheduled)
        age = 0.0 if figures.oldest_ms is None else max(0.0, (now_ms - figures.oldest_ms) / 1000)
        oldest.add_metric([wf], age)
    if failed:
        log.warning("/metrics: the streams of %s were not read in time", ", ".join(failed))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([waiting, oldest, runs_waiting, read_ok]))
    return generate_latest(registry)


def _result(task: asyncio.Future[_Figures], done: Iterable[asyncio.Future[Any]]) -> _Figures | None:
    if task not in done or task.cancelled():
        return None
    if task.exception() is not None:
        exc = task.exception()
        log.warning("/metrics: reading the streams failed: %s", type(exc).__name__)
        return None
    return task.result()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
