"""An idle runner's wait on a real Redis Cluster (3 primaries) and under Sentinel.

On a cluster the streams of a partitioned workflow live in several slots, and one
blocking read names the streams of one slot only: the runner reads one slot at a
time, on a connection of its own to that slot's node, and still takes every step of
every partition. Under Sentinel its own connection goes to the primary the
sentinels name, as the store's do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis as redis_sync
from redis.asyncio.cluster import RedisCluster

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.runners.runner import Runner
from gateway.store.runs import TakenStep
from gateway.store.runstore import RunStore
from tests.cluster import Cluster
from tests.sentinel import SentinelDeployment

pytestmark = pytest.mark.slow

YAML = """
version: 1
workflows:
  wide:
    steps: [one, two]
    partitions: 3
"""


@pytest.fixture
async def store(cluster: Cluster, cluster_db: redis_sync.RedisCluster) -> AsyncIterator[RunStore]:
    client = redis_client(cluster.seeds_url, 5.0)
    yield RunStore(client, parse_config(YAML, file="wide.yaml", with_triggers=False), timeout=5.0)
    await client.aclose()


async def test_a_runner_waiting_on_a_cluster_takes_the_steps_of_every_partition(
    store: RunStore, cluster: Cluster
) -> None:
    done: list[tuple[str, str]] = []

    async def handle(step: TakenStep) -> dict[str, str]:
        done.append((step.run_id, step.step))
        return {"by": step.step}

    runner = Runner(store, "wide", {"one": handle, "two": handle}, concurrency=4)
    task = asyncio.create_task(runner.run())
    try:
        runs = [(await store.start_run("wide", {"n": n})).run_id for n in range(12)]
        deadline = time.monotonic() + 20
        while len(done) < 2 * len(runs):
            assert time.monotonic() < deadline, f"{len(done)} of {2 * len(runs)} steps done"
            await asyncio.sleep(0.05)
        runner.stop()
        await asyncio.wait_for(task, 5.0)
    finally:
        runner.abandon()
        await asyncio.gather(task, return_exceptions=True)
    assert sorted(done) == sorted((r, s) for r in runs for s in ("one", "two"))
    assert {(await store.get_run(r)).phase for r in runs} == {"completed"}
    assert runner.counts["ok"] == 2 * len(runs)


async def test_a_wait_on_a_cluster_wakes_for_a_new_step_of_its_slot(store: RunStore) -> None:
    await store.ensure_groups("wide")
    wait = asyncio.create_task(store.wait_for_steps(["wide"], "r1", wait_ms=30_000))

    async def blocked() -> bool:
        found = await store.redis.client_list(target_nodes=RedisCluster.ALL_NODES)
        clients = [c for node in found.values() for c in node]
        return any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in clients)

    deadline = time.monotonic() + 10
    while not await blocked():
        assert time.monotonic() < deadline, "the wait never blocked on a node"
        await asyncio.sleep(0.01)
    # One run per partition: whichever slot the read names gets one.
    runs: set[str] = set()
    while len({r[-4:] for r in runs}) < 3:
        runs.add((await store.start_run("wide", {"n": len(runs)})).run_id)
    got = await asyncio.wait_for(wait, 10.0)
    assert len(got) == 1 and got[0].run_id in runs
    await store.end_waits("r1")


async def test_a_runner_waits_on_the_primary_sentinel_names(
    sentinel: SentinelDeployment, sentinel_db: redis_sync.Redis
) -> None:
    client = redis_client(sentinel.url(), 5.0)
    store = RunStore(client, parse_config(YAML, file="wide.yaml", with_triggers=False),
                     timeout=5.0)  # fmt: skip
    done: list[str] = []

    async def handle(step: TakenStep) -> None:
        done.append(step.step)

    runner = Runner(store, "wide", {"one": handle, "two": handle})
    task = asyncio.create_task(runner.run())
    try:
        deadline = time.monotonic() + 10
        while not any(
            c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
            for c in sentinel_db.client_list()
        ):
            assert time.monotonic() < deadline, "the runner never waited on the primary"
            await asyncio.sleep(0.01)
        await store.start_run("wide", {})
        while len(done) < 2:
            assert time.monotonic() < deadline, f"steps done: {done}"
            await asyncio.sleep(0.01)
        runner.stop()
        await asyncio.wait_for(task, 5.0)
    finally:
        runner.abandon()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
    assert done == ["one", "two"]
