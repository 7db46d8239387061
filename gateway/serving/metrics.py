"""Prometheus metrics served at ``/metrics``.

``realm listen`` runs its workers as separate processes, so it points
prometheus_client's multiprocess mode at a private folder before they start;
``/metrics`` then sums every worker, whichever one answers the scrape.

The listener's scrape also reads each workflow's step streams (``queue_text``):
how many ready steps wait and for how long, read from Redis at scrape time, so
every worker reports the same figures. A runner (``realm work --metrics-port``)
serves its own counters (``gateway.runners.metrics``). Each capability defines the
counters it updates in its own module; they all land in prometheus_client's one
registry, which ``render`` reads.
"""

from __future__ import annotations

import asyncio
import logging
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
    from gateway.store.keys import Keys
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


class _Figures:
    """One workflow's streams, summed over its partitions."""

    __slots__ = ("new", "oldest_ms", "taken")

    def __init__(self) -> None:
        self.new = 0
        self.taken = 0
        self.oldest_ms: int | None = None

    def saw(self, entry_id: Any) -> None:
        if entry_id is None:
            return
        ms = int(_text(entry_id).split("-", 1)[0])
        self.oldest_ms = ms if self.oldest_ms is None else min(self.oldest_ms, ms)


async def _read_partition(redis: Any, keys: Keys, figures: _Figures) -> None:
    """Three reads of one stream, none of which walks it: the group's counters,
    the pending summary, and the first entry not yet delivered."""
    stream = keys.stream()
    groups = await redis.xinfo_groups(stream) if await redis.exists(stream) else []
    group = next((g for g in groups if _text(g.get("name")) == GROUP), None)
    if group is None:
        # No runner has read this stream yet: every entry in it is undelivered.
        length = int(await redis.xlen(stream))  # awaited before the sum: partitions run at once
        figures.new += length
        first = await redis.xrange(stream, "-", "+", count=1)
        figures.saw(first[0][0] if first else None)
        return
    pending = await redis.xpending(stream, GROUP)
    figures.taken += int(pending["pending"])
    figures.saw(pending["min"] if pending["pending"] else None)
    last = _text(group["last-delivered-id"])
    lag = group.get("lag")
    following = await redis.xrange(stream, f"({last}", "+", count=1)
    if lag is None:
        # Redis cannot tell (entries deleted past the group's position): at least
        # one waits if one follows the group's position.
        lag = len(following)
    figures.new += int(lag)
    if int(lag):
        figures.saw(following[0][0] if following else None)


async def _read_workflow(store: RunStore, workflow: str) -> _Figures:
    figures = _Figures()
    # The partitions at once: on a cluster they live on different primaries.
    await asyncio.gather(
        *(_read_partition(store.redis, k, figures) for k in store.partitions(workflow))
    )
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
        age = 0.0 if figures.oldest_ms is None else max(0.0, (now_ms - figures.oldest_ms) / 1000)
        oldest.add_metric([wf], age)
    if failed:
        log.warning("/metrics: the streams of %s were not read in time", ", ".join(failed))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot([waiting, oldest, read_ok]))
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
