"""Metrics of the consumer side: the listener's step-stream gauges, read from a real
Redis at scrape time (gateway.serving.metrics.queue_text), and a runner's own counters
(step_done, lease_expired) served over HTTP as ``realm work --metrics-port`` does."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.runners import metrics
from gateway.serving import metrics as listener_metrics
from gateway.store.runstore import RunStore
from gateway.store.steps import RUNNERS_GROUP
from tests.cluster import Cluster
from tests.conftest import WORKFLOWS_YAML
from tests.servers import free_port

PARTITIONED_YAML = (
    WORKFLOWS_YAML
    + """
  spread:
    steps: [fetch, load]
    partitions: 4
"""
)


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from exposition text (labels as prometheus_client sorts them)."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}{{{re.escape(inner)}}} (\S+)$", text, re.M)
    assert found, f"{name}{{{inner}}} not in:\n{text}"
    return float(found.group(1))


async def gauges(store: RunStore, timeout: float = listener_metrics.QUEUE_TIMEOUT) -> str:
    return (await listener_metrics.queue_text(store, timeout)).decode()


def test_the_group_is_the_stores() -> None:
    assert listener_metrics.GROUP == RUNNERS_GROUP


async def test_waiting_and_taken_steps_and_the_oldest_age(store: RunStore, redis: Redis) -> None:
    text = await gauges(store)
    assert sample(text, "realm_steps_waiting", workflow="sync", state="new") == 0
    assert sample(text, "realm_steps_oldest_age_seconds", workflow="sync") == 0
    assert sample(text, "realm_queue_read_ok", workflow="sync") == 1

    for i in range(3):
        await store.start_run("sync", {}, f"order-{i}")
    # Before any runner: every entry of the stream is new.
    text = await gauges(store)
    assert sample(text, "realm_steps_waiting", workflow="sync", state="new") == 3
    assert sample(text, "realm_steps_waiting", workflow="sync", state="taken") == 0

    await store.ensure_groups("sync")
    taken = await store.take_steps("sync", "r1", count=2)
    assert len(taken) == 2
    first_ms = int(taken[0].entry_id.split("-")[0])
    before = time.time() * 1000
    text = await gauges(store)
    after = time.time() * 1000
    assert sample(text, "realm_steps_waiting", workflow="sync", state="new") == 1
    assert sample(text, "realm_steps_waiting", workflow="sync", state="taken") == 2
    # The oldest not acknowledged: the first taken entry, timed by its id.
    age = sample(text, "realm_steps_oldest_age_seconds", workflow="sync")
    assert (before - first_ms) / 1000 <= age <= (after - first_ms) / 1000

    # A completed step is acknowledged, and its next step is new.
    await store.complete_step(taken[0].run_id, "fetch", lease=taken[0].lease)
    text = await gauges(store)
    assert sample(text, "realm_steps_waiting", workflow="sync", state="new") == 2
    assert sample(text, "realm_steps_waiting", workflow="sync", state="taken") == 1
    assert sample(text, "realm_steps_waiting", workflow="deploy", state="new") == 0


async def test_a_partitioned_workflow_sums_its_streams(redis: Redis) -> None:
    store = RunStore(redis, parse_config(PARTITIONED_YAML, file="t.yaml", with_triggers=False))
    await _sums_its_streams(store, redis)


@pytest.mark.slow
async def test_a_partitioned_workflow_sums_its_streams_on_a_cluster(
    cluster: Cluster, cluster_db: object
) -> None:
    """The partitions live on several primaries: the gauges' pipelined reads go to each."""
    client = redis_client(cluster.seeds_url, 5.0)
    try:
        config = parse_config(PARTITIONED_YAML, file="t.yaml", with_triggers=False)
        await _sums_its_streams(RunStore(client, config, timeout=5.0), client)
    finally:
        await client.aclose()


async def _sums_its_streams(store: RunStore, redis: Redis) -> None:
    for i in range(20):
        await store.start_run("spread", {}, f"k{i}")
    streams = [keys.stream() for keys in store.partitions("spread")]
    assert sum([await redis.xlen(s) > 0 for s in streams]) > 1  # spread over partitions
    text = await gauges(store)  # no runner yet: the streams' lengths, summed
    assert sample(text, "realm_steps_waiting", workflow="spread", state="new") == 20
    taken = await store.take_steps("spread", "r1", count=5)
    assert len(taken) == 5
    before = time.time() * 1000
    text = await gauges(store)
    after = time.time() * 1000
    assert sample(text, "realm_steps_waiting", workflow="spread", state="new") == 15
    assert sample(text, "realm_steps_waiting", workflow="spread", state="taken") == 5
    # The oldest entry of any partition (none is acknowledged yet), timed by its id.
    firsts = [entries[0][0] for s in streams if (entries := await redis.xrange(s, count=1))]
    oldest_ms = min(int(entry_id.split(b"-")[0]) for entry_id in firsts)
    age = sample(text, "realm_steps_oldest_age_seconds", workflow="spread")
    assert (before - oldest_ms) / 1000 <= age <= (after - oldest_ms) / 1000


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung Redis)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


async def test_a_hung_or_gone_redis_never_fails_the_scrape(silent_server: int) -> None:
    config = parse_config(WORKFLOWS_YAML, file="t.yaml", with_triggers=False)
    hung = redis_client(f"redis://127.0.0.1:{silent_server}/0", 5.0)
    started = time.monotonic()
    text = await gauges(RunStore(hung, config, timeout=5.0), timeout=0.3)
    assert time.monotonic() - started < 2
    assert sample(text, "realm_queue_read_ok", workflow="sync") == 0
    assert "realm_steps_waiting{" not in text
    await hung.aclose()

    gone = redis_client(f"redis://127.0.0.1:{free_port()}/0", 5.0)
    text = await gauges(RunStore(gone, config, timeout=5.0), timeout=2)
    assert sample(text, "realm_queue_read_ok", workflow="deploy") == 0
    await gone.aclose()


def test_a_runners_counters_are_served() -> None:
    metrics.step_done("m-wf", "fetch", "ok", 0.02)
    metrics.step_done("m-wf", "fetch", "failed", 1.5)
    metrics.step_done("m-wf", "fetch", "ok", 0.03)
    metrics.step_done("m-wf", "load", "discarded", None)  # refused at once: no handler ran
    metrics.lease_expired("m-wf")
    port = free_port()
    metrics.serve_runner_metrics(port)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert sample(text, "realm_steps_total", workflow="m-wf", step="fetch",
                  outcome="ok") == 2  # fmt: skip
    assert sample(text, "realm_steps_total", workflow="m-wf", step="fetch", outcome="failed") == 1
    assert sample(text, "realm_steps_total", workflow="m-wf", step="load",
                  outcome="discarded") == 1  # fmt: skip
    assert sample(text, "realm_step_attempts_total", workflow="m-wf", step="fetch") == 3
    assert 'realm_step_attempts_total{step="load",workflow="m-wf"}' not in text
    assert sample(text, "realm_leases_expired_total", workflow="m-wf") == 1
    assert sample(text, "realm_handler_seconds_count", workflow="m-wf", step="fetch") == 3
    assert sample(text, "realm_handler_seconds_bucket", workflow="m-wf", step="fetch",
                  le="0.05") == 2  # fmt: skip
