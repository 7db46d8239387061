"""The listener's pipelined claims on a real Redis Cluster (3 primaries, 3 replicas).

gateway/link/pipeline.py ClusterPipeline: each call goes to the primary owning its hash
slot, follows MOVED (a slot moved: the map is refreshed) and ASK (a slot migrating:
ASKING, then the call, on the target), and finds a killed primary's promoted replica.
The last test runs a real ``realm listen`` under load while a workflow's slot migrates.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from redis import exceptions as redis_errors

from gateway.link.cluster_pipeline import ClusterPipeline, pipeline_for
from gateway.link.connection import redis_client
from gateway.model.config import Durability
from gateway.model.errors import StoreUnavailable
from gateway.store.scripts import Scripts
from tests.cluster import Cluster, ClusterNode, key_slot
from tests.exactly_once import (
    DEPLOY,
    assert_exactly_once,
    figures,
    judge,
    listening,
    make_events,
    polled,
    redelivered,
    spool_drained,
)
from tests.senders import send_all

# A script that counts in its one key and says which node ran it.
INCR = "redis.call('INCR', KEYS[1]); return redis.call('GET', KEYS[1])"


def tagged_on(cluster: Cluster, node: ClusterNode, avoid: set[str] = frozenset()) -> str:
    """A hash tag whose slot ``node`` serves now."""
    for i in range(10_000):
        tag = f"t{i}"
        if tag not in avoid and cluster.primary_for_key(f"{{{tag}}}") is node:
            return tag
    raise LookupError(f"no tag on {node}")


@pytest.fixture
async def pipeline(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> AsyncIterator[tuple[ClusterPipeline, Scripts]]:
    client = redis_client(cluster.seeds_url, 5.0)
    pipe = pipeline_for(client, 5.0)
    assert isinstance(pipe, ClusterPipeline)
    scripts = Scripts(client)
    scripts.incr = client.register_script(INCR)  # type: ignore[attr-defined]
    try:
        yield pipe, scripts
    finally:
        pipe.close()
        await client.aclose()


async def test_each_call_goes_to_the_primary_owning_its_slot(
    cluster: Cluster, pipeline: tuple[ClusterPipeline, Scripts]
) -> None:
    pipe, scripts = pipeline
    tags = [tagged_on(cluster, node) for node in cluster.primaries()]
    replies = await asyncio.gather(
        *(pipe.evalsha(scripts.incr, [f"{{{t}}}:n"], []) for t in tags for _ in range(50))
    )
    assert replies == [str(i + 1).encode() for _ in tags for i in range(50)]
    for tag in tags:
        owner = cluster.primary_for_key(f"{{{tag}}}")
        assert owner.call("GET", f"{{{tag}}}:n") == "50"  # on its owner, not redirected there
    assert (pipe.moved, pipe.asked) == (0, 0)
    assert len({a for a in pipe._slots if a}) == 3


async def test_a_moved_slot_is_followed_and_the_map_refreshed(
    cluster: Cluster, pipeline: tuple[ClusterPipeline, Scripts]
) -> None:
    pipe, scripts = pipeline
    first, second = cluster.primaries()[:2]
    tag = tagged_on(cluster, first)
    key = f"{{{tag}}}:n"
    assert await pipe.evalsha(scripts.incr, [key], []) == b"1"
    slot = key_slot(key.encode())
    await asyncio.to_thread(cluster.migrate_slot, slot, second)

    assert await pipe.evalsha(scripts.incr, [key], []) == b"2"  # MOVED, then on `second`
    assert pipe.moved == 1
    assert second.call("GET", key) == "2"
    await polled(lambda: pipe._slots[slot] == ("127.0.0.1", second.port), "the map names it")
    assert await pipe.evalsha(scripts.incr, [key], []) == b"3"
    assert pipe.moved == 1  # the map knew by then: no second redirection


async def test_ask_during_a_migration_runs_on_the_target_without_changing_the_map(
    cluster: Cluster, pipeline: tuple[ClusterPipeline, Scripts]
) -> None:
    pipe, scripts = pipeline
    first, second = cluster.primaries()[:2]
    tag = tagged_on(cluster, first)
    key = f"{{{tag}}}:n"
    slot = key_slot(key.encode())
    assert await pipe.evalsha(scripts.incr, [key], []) == b"1"
    source = cluster.begin_migration(slot, second)
    try:
        while cluster.move_keys(slot, source, second):
            pass
        # The key is on `second` now, the slot still `first`'s: ASK, then ASKING + call.
        assert await pipe.evalsha(scripts.incr, [key], []) == b"2"
        assert pipe.asked == 1 and pipe.moved == 0
        assert pipe._slots[slot] == ("127.0.0.1", first.port)  # an ASK moves nothing
        # A script the target lost is loaded there, and the call goes again.
        second.call("SCRIPT", "FLUSH")
        assert await pipe.evalsha(scripts.incr, [key], []) == b"3"
        assert pipe.asked == 2
    finally:
        cluster.finish_migration(slot, source, second)
    assert second.call("GET", key) == "3"  # both calls ran there, once each


async def test_a_killed_primary_is_replaced_by_its_promoted_replica(
    cluster: Cluster, pipeline: tuple[ClusterPipeline, Scripts]
) -> None:
    pipe, scripts = pipeline
    victim = cluster.primaries()[0]
    key = f"{{{tagged_on(cluster, victim)}}}:n"
    assert await pipe.evalsha(scripts.incr, [key], []) == b"1"
    victim.call("WAIT", 1, 2000)  # its replica has the key
    refreshes = pipe.refreshes
    cluster.kill(victim)
    replies: list[object] = []
    async with asyncio.timeout(30):
        while True:
            try:
                replies.append(await pipe.evalsha(scripts.incr, [key], []))
                break
            except (redis_errors.ConnectionError, redis_errors.ClusterDownError) as exc:
                replies.append(type(exc).__name__)  # before the promotion: refused
    promoted = cluster.primary_for_key(key)
    assert promoted is not victim
    assert replies[-1] == b"2"  # the replica had the first call's write
    assert pipe.refreshes > refreshes
    assert pipe._slots[key_slot(key.encode())] == ("127.0.0.1", promoted.port)


async def test_durability_on_a_cluster_confirms_on_the_primarys_replica(
    cluster: Cluster, pipeline: tuple[ClusterPipeline, Scripts]
) -> None:
    _, scripts = pipeline
    client = redis_client(cluster.seeds_url, 5.0)
    durable = pipeline_for(client, 5.0, durability=Durability(replicas=1, timeout=1.0))
    strict = pipeline_for(client, 5.0, durability=Durability(replicas=2, timeout=0.05))
    assert durable is not None and strict is not None
    try:
        keys = [f"{{{tagged_on(cluster, n)}}}:n" for n in cluster.primaries()]
        assert (
            await asyncio.gather(*(durable.evalsha(scripts.incr, [k], []) for k in keys))
            == [b"1"] * 3
        )
        # Each primary has one replica: 2 are never confirmed.
        with pytest.raises(StoreUnavailable, match=r"not confirmed on 2 replicas within 0.05 s"):
            await strict.evalsha(scripts.incr, [keys[0]], [])
    finally:
        durable.close()
        strict.close()
        await client.aclose()


# -- a real listener while a workflow's slot migrates ---------------------------------


@pytest.mark.slow
async def test_listener_exactly_once_while_the_workflows_slot_migrates(
    tmp_path: Path, cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    slot = key_slot(DEPLOY.runs().encode())
    source = cluster.primary_for_slot(slot)
    target = next(n for n in cluster.primaries() if n is not source)
    events = make_events(800, seed=11)
    deliveries = redelivered(events, 2, seed=12)
    moved_keys = 0
    async with asyncio.timeout(120):
        with listening(tmp_path, cluster.seeds_url) as listener:
            async with httpx.AsyncClient(base_url=listener.base_url) as http:
                load = asyncio.create_task(
                    send_all(listener.base_url, deliveries, concurrency=24, seconds=40)
                )
                await polled(lambda: _started(cluster_db) >= 100, "100 runs before the migration")
                # As valkey-cli's reshard does, in small batches while the load goes on:
                # claims meet MIGRATING (TRYAGAIN while a claim's keys are split, ASK once
                # they are all on the target), then the new owner (MOVED).
                await asyncio.to_thread(cluster.begin_migration, slot, target)
                while n := await asyncio.to_thread(cluster.move_keys, slot, source, target, 20):
                    moved_keys += n
                    await asyncio.sleep(0.02)  # pacing: claims run between the batches
                # Every key is on the target: the slot is handed over once a claim was
                # sent there by ASK.
                await _until_async(
                    lambda: _redirects(http), lambda r: r["ask"] > 0 or load.done(), "an ASK"
                )
                await asyncio.to_thread(cluster.finish_migration, slot, source, target)
                outcomes = await load
                await spool_drained(listener)  # what was accepted meanwhile, claimed
                redirects = await _redirects(http)
    assert cluster.primary_for_slot(slot) is target
    verdict = judge(f"redis://127.0.0.1:{target.port}/0", events, outcomes)
    figures(
        "cluster-slot-migration",
        events=verdict.events, deliveries=verdict.deliveries, runs=verdict.runs,
        keys_migrated=moved_keys, moved=int(redirects["moved"]), ask=int(redirects["ask"]),
        tryagain=int(redirects["tryagain"]), non2xx=verdict.non2xx,
        statuses=dict(verdict.statuses),
    )  # fmt: skip
    assert_exactly_once(verdict)
    assert "500" not in verdict.statuses, verdict.statuses
    assert redirects["moved"] > 0 and redirects["ask"] > 0, redirects


async def _redirects(http: httpx.AsyncClient) -> dict[str, float]:
    """The listener's realm_redis_redirections_total by kind (every worker summed)."""
    text = (await http.get("/metrics")).text
    found = dict.fromkeys(("moved", "ask", "tryagain"), 0.0)
    for kind, value in re.findall(r'realm_redis_redirections_total\{kind="(\w+)"\} (\S+)', text):
        found[kind] = float(value)
    return found


async def _until_async(read, check, what: str, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check(value := await read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {value}")
        await asyncio.sleep(0.02)
    return value


def _started(db: redis_sync.RedisCluster) -> int:
    try:
        return int(db.zcard(DEPLOY.runs()))
    except redis_sync.RedisError:
        return 0
