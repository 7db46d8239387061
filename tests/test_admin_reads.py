"""Admin reads wait for Redis, not for each other, on real Redis servers: a call queued
for one of the pool's connections is not timed as Redis (gateway/link/pool.py pauses the
store's deadline), the queue is bounded (503 OVERLOADED past it, never "Redis is
unavailable"), and a burst of heavy reads on a real `realm listen` all answer 200."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from gateway.faces.admission import Admission
from gateway.faces.api import error_response
from gateway.link.connection import redis_client
from gateway.link.pool import QueuedPool
from gateway.model.config import Config
from gateway.model.errors import Overloaded, RealmError
from gateway.store.runstore import RunStore
from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.servers import RedisServer

HOLD = 0.3  # seconds each call keeps its connection (a BLPOP that times out on the server)


async def hold(redis: Redis, key: str = "nothing") -> None:
    assert await redis.blpop([key], HOLD) is None


@pytest.fixture
async def two_connections(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """The gateway's client of the session's server, with a pool of two connections."""
    client = redis_client(redis_server.url, 5.0, max_connections=2)
    yield client
    await client.aclose()


async def test_waiting_for_a_connection_is_not_timed_as_redis(
    two_connections: Redis, config: Config
):
    """Eight operations, two connections, each call 0.3 s in Redis, a 0.5 s deadline:
    the last ones wait 0.9 s for a connection, and still answer."""
    store = RunStore(two_connections, config, timeout=0.5)

    async def operation() -> str:
        try:
            async with store.deadline():
                await store.call(lambda: hold(store.redis))
            return "ok"
        except RealmError as exc:
            return exc.code

    started = time.monotonic()
    outcomes = Counter(await asyncio.gather(*(operation() for _ in range(8))))
    assert outcomes == Counter({"ok": 8})
    assert time.monotonic() - started >= 4 * HOLD  # they did queue


async def test_calls_of_one_operation_that_wait_at_once_pause_its_deadline_once(
    two_connections: Redis, config: Config
):
    """One operation whose six calls go out at once (a listing of six partitions): 0.9 s
    in all, of which 0.3 s with nothing of it queued: within its 0.5 s."""
    store = RunStore(two_connections, config, timeout=0.5)
    started = time.monotonic()
    async with store.deadline():
        await asyncio.gather(*(store.call(lambda: hold(store.redis)) for _ in range(6)))
    assert time.monotonic() - started >= 3 * HOLD
    # While Redis itself is slow, the deadline still ends the operation.
    with pytest.raises(RealmError) as caught:
        async with store.deadline():
            await store.call(lambda: store.redis.blpop(["nothing"], 2))
    assert caught.value.code == "STORE_UNAVAILABLE"


async def test_past_the_bound_a_call_is_refused_at_once_as_overloaded(
    redis_server: RedisServer,
):
    pool = QueuedPool.from_url(redis_server.url, max_connections=2, max_waiting=3)
    client = Redis.from_pool(pool)
    finished: list[str] = []

    async def call() -> str:
        try:
            await hold(client)
            outcome = "ok"
        except Overloaded as exc:
            assert exc.code == "OVERLOADED" and exc.message == (
                "this worker already has 3 Redis calls waiting for one of its 2 connections; "
                "retry in a second"
            )
            outcome = "OVERLOADED"
        finished.append(outcome)
        return outcome

    try:
        outcomes = Counter(await asyncio.gather(*(call() for _ in range(10))))
    finally:
        await client.aclose()
    # Two held the connections, three waited their turn, five were refused first.
    assert outcomes == Counter({"ok": 5, "OVERLOADED": 5})
    assert finished[:5] == ["OVERLOADED"] * 5
    assert pool.waiting == 0


async def test_admission_takes_turns_and_refuses_past_its_queue():
    admission = Admission(slots=1, queue=1)
    order: list[str] = []

    async def read(name: str, hold_for: float) -> str:
        try:
            async with admission:
                order.append(f"{name} in")
                await asyncio.sleep(hold_for)
            return "ok"
        except Overloaded as exc:
            assert exc.message == (
                "this worker has 1 admin reads waiting for their turn already; retry in a second"
            )
            return "OVERLOADED"

    first = asyncio.ensure_future(read("a", 0.05))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(read("b", 0))
    await asyncio.sleep(0)
    assert await read("c", 0) == "OVERLOADED"
    assert await asyncio.gather(first, second) == ["ok", "ok"]
    assert order == ["a in", "b in"]
    assert admission.waiting == 0


def test_overloaded_is_a_503_with_retry_after():
    reply = error_response(Overloaded("too many waiting"))
    assert (reply.status_code, reply.headers["retry-after"]) == (503, "1")
    assert reply.body == b'{"status":"error","code":"OVERLOADED","message":"too many waiting"}'


@pytest.mark.slow
async def test_250_concurrent_reads_of_200_runs_all_answer(
    module_redis: RedisServer, tmp_path: Path
):
    """250 reads of a 200-run page at once on one worker: several seconds of this
    process's CPU. Each read's Redis calls are timed from when they are sent (1 s
    here), so all of them answer 200."""
    token = "admin-reads-token-3e1f"
    config = WORKFLOWS_YAML.replace("version: 1\n", "version: 1\nsettings: {redis_timeout: 1}\n")
    listener = Listener(
        tmp_path, config, redis_url=module_redis.url, env={"REALM_API_TOKEN": token}
    ).start()
    headers = {"Authorization": f"Bearer {token}"}
    try:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(
            base_url=listener.base_url, headers=headers, timeout=120, limits=limits
        ) as client:
            for batch in range(2):
                items = [{"idempotency_key": f"k{batch}-{i}"} for i in range(100)]
                reply = await client.post("/v1/workflows/sync/batch", json={"items": items})
                assert reply.status_code == 200, reply.text

            async def read() -> tuple[int, str]:
                reply = await client.get("/v1/workflows/sync/runs", params={"limit": 200})
                if reply.status_code == 200:
                    assert len(reply.json()["runs"]) == 200
                    return 200, ""
                return reply.status_code, reply.json()["code"]

            # 250 connections open first, so that the reads arrive at once.
            warm = await asyncio.gather(*(client.get("/healthz") for _ in range(250)))
            assert {reply.status_code for reply in warm} == {200}
            started = time.monotonic()
            statuses = Counter(await asyncio.gather(*(read() for _ in range(250))))
            elapsed = time.monotonic() - started
        print(f"FIGURES admin_reads_250x200: statuses={dict(statuses)} seconds={elapsed:.2f}")
        assert statuses == Counter({(200, ""): 250})
    finally:
        listener.stop()
