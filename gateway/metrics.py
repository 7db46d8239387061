"""Prometheus metrics served at ``/metrics``.

``realm listen`` runs its workers as separate processes, so it points
prometheus_client's multiprocess mode at a private folder before they start;
``/metrics`` then sums every worker, whichever one answers the scrape.

The listener's scrape also reads each workflow's step streams (``queue_text``):
how many ready steps wait and for how long, read from Redis at scrape time, so
every worker reports the same figures. A runner (``realm work --metrics-port``)
serves its own counters (``step_done``, ``lease_expired``, ``serve_runner_metrics``).
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
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.keys import Keys
    from gateway.store import RunStore

log = logging.getLogger("realm.metrics")

DELIVERIES = Counter(
    "realm_deliveries_total", "Webhook deliveries answered, by path and HTTP status",
    ["path", "status"],
)  # fmt: skip
OUTCOMES = Counter(
    "realm_trigger_outcomes_total",
    "Per trigger of a delivery: started, deduplicated, refused or ignored",
    ["trigger", "workflow", "outcome"],
)
LATENCY = Histogram(
    "realm_delivery_seconds", "Time from request to reply, body read included", ["path"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)  # fmt: skip
DELIVERY_LOG_DROPPED = Counter(
    "realm_delivery_log_dropped_total",
    "Delivery log records a worker dropped unwritten (Redis refused them for longer "
    "than its buffer lasts); the deliveries themselves were answered",
)
CONFIG_RELOADS = Counter(
    "realm_config_reloads_total",
    "triggers.yaml reloads by a worker: applied, or refused (the old one kept)",
    ["result"],
)

REDIRECTIONS = Counter(
    "realm_redis_redirections_total",
    "Redis Cluster replies the listener's claims followed: moved (the slot has a new "
    "owner), ask (the slot is migrating), tryagain (its keys are split by a migration)",
    ["kind"],
)


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


# -- a runner's own metrics (``realm work --metrics-port``) ----------------------------

STEPS = Counter(
    "realm_steps_total",
    "Steps a runner finished with, by outcome (gateway/runner.py's words): ok (recorded), "
    "failed (recorded as a failure: retried later, or the run failed), discarded (the "
    "run had ended or moved on: the result was refused), unrecorded (the store stayed "
    "unavailable, or a stop cut the handler short: the step is taken again after its lease)",
    ["workflow", "step", "outcome"],
)
ATTEMPTS = Counter(
    "realm_step_attempts_total",
    "Handler runs (every attempt of a step, the first one included)",
    ["workflow", "step"],
)
LEASES_LOST = Counter(
    "realm_leases_expired_total",
    "Leases this runner held that lapsed before it reported: another runner may run the step",
    ["workflow"],
)
HANDLER = Histogram(
    "realm_handler_seconds", "Time from taking a step to its result recorded (mostly its handler)",
    ["workflow", "step"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)  # fmt: skip


def step_done(workflow: str, step: str, outcome: str, seconds: float | None) -> None:
    """One step a runner finished with: ``outcome`` as ``realm_steps_total`` lists;
    ``seconds`` from taking the step to its result, None when no handler ran (a step
    refused at once, or given back unrun at a stop): then no attempt is counted."""
    STEPS.labels(workflow, step, outcome).inc()
    if seconds is not None:
        ATTEMPTS.labels(workflow, step).inc()
        HANDLER.labels(workflow, step).observe(seconds)


def lease_expired(workflow: str) -> None:
    """A lease this runner held lapsed (extending it was refused, or its result was
    discarded as STATE_STEP_NOT_CURRENT while the run was still live)."""
    LEASES_LOST.labels(workflow).inc()


def serve_runner_metrics(port: int, addr: str = "127.0.0.1") -> None:
    """Serve this process's metrics at http://addr:port/metrics (a daemon thread)."""
    start_http_server(port, addr)


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
