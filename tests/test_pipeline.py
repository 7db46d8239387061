"""gateway/link/pipeline.py against real servers: the handshake, errors, and connection trouble.

The listener's behaviour under faults (kill -9, SIGSTOP, lost replies) is in
test_faults.py; these tests pin down the connection's own contract.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis as redis_sync
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.link.pipeline import Pipeline
from gateway.model.config import Config
from gateway.model.errors import StoreUnavailable
from gateway.store.runstore import RunStore

ECHO_FIRST_ARG = "return ARGV[1]"


@asynccontextmanager
async def opened(url: str, timeout: float = 5.0) -> AsyncIterator[tuple[Redis, Pipeline]]:
    """A redis-py client and the pipeline to its server, both closed afterwards."""
    client = redis_client(url, timeout)
    pipeline = Pipeline.for_client(client, timeout)
    assert pipeline is not None
    try:
        yield client, pipeline
    finally:
        pipeline.close()
        await client.aclose()


async def test_replies_reach_their_own_callers_in_order(redis_server) -> None:
    async with opened(redis_server.url) as (client, pipeline):
        script = client.register_script(ECHO_FIRST_ARG)
        replies = await asyncio.gather(*(pipeline.evalsha(script, [], [i]) for i in range(500)))
        assert replies == [str(i).encode() for i in range(500)]


async def _with_password(start_redis, password: str):
    # Set after start: the fixture's readiness probe speaks without a password.
    server = start_redis()
    plain = Redis.from_url(server.url)
    await plain.config_set("requirepass", password)
    await plain.aclose()
    return server


async def test_password_and_database_from_the_url(start_redis) -> None:
    server = await _with_password(start_redis, "s3cret")
    async with opened(f"redis://:s3cret@127.0.0.1:{server.port}/3") as (client, pipeline):
        assert await pipeline.execute(b"SET", "where", "db3") == b"OK"
        assert await client.get("where") == b"db3"  # redis-py, same URL: database 3
        await client.select(0)
        assert await client.get("where") is None


async def test_a_wrong_password_is_an_authentication_error(start_redis) -> None:
    server = await _with_password(start_redis, "s3cret")
    async with opened(f"redis://:wrong@127.0.0.1:{server.port}/0") as (_, pipeline):
        with pytest.raises(redis_errors.AuthenticationError):
            await pipeline.execute(b"PING")


async def test_an_error_reply_is_raised_to_its_caller_only(redis_server) -> None:
    async with opened(redis_server.url) as (client, pipeline):
        failing = client.register_script("return redis.error_reply('ERR nope')")
        echo = client.register_script(ECHO_FIRST_ARG)
        results = await asyncio.gather(
            pipeline.evalsha(echo, [], ["a"]),
            pipeline.evalsha(failing, [], []),
            pipeline.evalsha(echo, [], ["b"]),
            return_exceptions=True,
        )
        assert results[0] == b"a" and results[2] == b"b"
        assert isinstance(results[1], redis_errors.ResponseError)
        assert "nope" in str(results[1])


async def test_a_flushed_script_cache_is_reloaded_and_the_call_runs_once(redis_server) -> None:
    async with opened(redis_server.url) as (client, pipeline):
        incr = client.register_script("return redis.call('INCR', KEYS[1])")
        await client.delete("pipeline:count")
        await client.script_flush()
        assert await pipeline.evalsha(incr, ["pipeline:count"], []) == 1
        assert await client.get("pipeline:count") == b"1"


async def test_nothing_listening_is_a_connection_error(start_redis) -> None:
    server = start_redis()
    port = server.port
    server.stop()
    async with opened(f"redis://127.0.0.1:{port}/0") as (_, pipeline):
        with pytest.raises(redis_errors.ConnectionError, match="cannot connect"):
            await pipeline.execute(b"PING")


async def test_a_frozen_server_fails_the_calls_within_the_timeout(start_redis) -> None:
    server = start_redis()
    async with opened(server.url, timeout=0.5) as (_, pipeline):
        assert await pipeline.execute(b"PING") == b"PONG"
        server.pause()
        try:
            started = time.monotonic()
            results = await asyncio.gather(
                *(pipeline.execute(b"PING") for _ in range(20)), return_exceptions=True
            )
            waited = time.monotonic() - started
        finally:
            server.resume()
        assert all(isinstance(r, redis_errors.TimeoutError) for r in results), results
        assert 0.5 <= waited < 2.0
        # The late connection was dropped; the next call opens a new one.
        assert await pipeline.execute(b"PING") == b"PONG"


async def test_a_killed_server_fails_the_calls_and_a_restarted_one_serves_again(
    start_redis,
) -> None:
    server = start_redis()
    async with opened(server.url) as (_, pipeline):
        assert await pipeline.execute(b"PING") == b"PONG"
        server.kill()
        with pytest.raises(redis_errors.ConnectionError):
            await pipeline.execute(b"PING")
        server.start()  # the same port
        assert await pipeline.execute(b"PING") == b"PONG"


async def test_a_store_on_a_dead_server_answers_store_unavailable(
    start_redis, config: Config
) -> None:
    server = start_redis()
    client = redis_client(server.url, 1.0)
    store = RunStore(client, config, timeout=1.0, pipelined=True)
    try:
        first = await store.start_run("sync", {}, "k")
        server.kill()
        with pytest.raises(StoreUnavailable):
            await store.start_run("sync", {}, "k")
        server.start()
        again = await store.start_run("sync", {}, "k")
        assert again.deduped is False  # the server kept nothing (no persistence)
        assert again.run_id != first.run_id
    finally:
        store.close()
        await client.aclose()


def test_tls_connections_are_left_to_redis_py() -> None:
    client = Redis.from_url("rediss://127.0.0.1:6380/0")
    assert Pipeline.for_client(client, 1.0) is None


async def test_the_resolver_is_asked_on_every_connect(start_redis) -> None:
    """Where a pipeline connects can move (Sentinel): each (re)connect asks again."""
    first, second = start_redis(), start_redis()
    where = [first]
    asked = 0

    async def resolve() -> dict[str, object]:
        nonlocal asked
        asked += 1
        return {"host": "127.0.0.1", "port": where[0].port}

    pipeline = Pipeline({"host": "127.0.0.1", "port": 1}, 2.0, 2.0, resolver=resolve)
    try:
        assert await pipeline.execute(b"SET", "on", "first") == b"OK"
        where[0] = second
        first.kill()
        with pytest.raises(redis_errors.ConnectionError):
            await pipeline.execute(b"GET", "on")  # the old connection drops
        assert await pipeline.execute(b"SET", "on", "second") == b"OK"
        assert asked == 2
        check = Redis.from_url(second.url)
        assert await check.get("on") == b"second"
        await check.aclose()
    finally:
        pipeline.close()


async def test_a_connect_closed_under_its_callers_is_a_connection_error(start_redis) -> None:
    """close() while callers wait for a connection being made (a node that left a
    cluster's map): each caller gets a connection error (503), not a CancelledError,
    which escaped as a 500 during a cluster failover."""
    server = start_redis()
    with redis_sync.Redis(port=server.port) as admin:
        admin.config_set("requirepass", "pw")
    server.pause()  # the connect succeeds (the kernel accepts); AUTH waits for a reply
    pipeline = Pipeline({"host": "127.0.0.1", "port": server.port, "password": "pw"}, 5.0, 5.0)
    try:
        callers = [asyncio.ensure_future(pipeline.execute(b"PING")) for _ in range(5)]
        while pipeline._connecting is None:  # the connect has begun
            await asyncio.sleep(0)
        pipeline.close()
        results = await asyncio.gather(*callers, return_exceptions=True)
    finally:
        server.resume()
    assert all(isinstance(r, redis_errors.ConnectionError) for r in results), results


# -- writes: what goes out together ------------------------------------------------------


def _count_writes(pipeline: Pipeline) -> list[bytes]:
    """Every write the pipeline's (open) connection makes from now on, as written."""
    conn = pipeline._conn
    assert conn is not None and conn._transport is not None
    transport = conn._transport
    written: list[bytes] = []
    write = transport.write

    def counting(data: bytes) -> None:
        written.append(bytes(data))
        write(data)

    transport.write = counting  # type: ignore[method-assign]
    return written


async def test_the_calls_of_one_loop_turn_go_out_in_one_write(redis_server) -> None:
    async with opened(redis_server.url) as (_, pipeline):
        await pipeline.execute(b"PING")  # connected
        written = _count_writes(pipeline)
        replies = await asyncio.gather(*(pipeline.execute(b"ECHO", i) for i in range(100)))
        assert replies == [str(i).encode() for i in range(100)]
        assert len(written) == 1
        assert written[0].count(b"ECHO") == 100


async def test_a_lone_call_is_written_in_its_own_turn_not_later(redis_server) -> None:
    """No timer between a call and its write: it goes out on the loop's next pass."""
    async with opened(redis_server.url) as (_, pipeline):
        await pipeline.execute(b"PING")
        written = _count_writes(pipeline)
        call = asyncio.ensure_future(pipeline.execute(b"ECHO", "alone"))
        await asyncio.sleep(0)  # the call runs and queues its command
        await asyncio.sleep(0)  # the loop's next pass: the write
        assert written == [b"*2\r\n$4\r\nECHO\r\n$5\r\nalone\r\n"]
        assert await call == b"alone"


async def test_calls_made_while_redis_is_behind_go_out_together(start_redis) -> None:
    """While two writes' replies are due, the calls of later turns are held and go out
    in one write when the oldest is answered, each still getting its own reply."""
    server = start_redis()
    async with opened(server.url) as (_, pipeline):
        await pipeline.execute(b"PING")
        written = _count_writes(pipeline)
        server.pause()  # no reply can come back until resumed
        try:
            first = [asyncio.ensure_future(pipeline.execute(b"ECHO", "first"))]
            while len(written) < 1:  # its write (the loop's next pass)
                await asyncio.sleep(0)
            first.append(asyncio.ensure_future(pipeline.execute(b"ECHO", "second")))
            while len(written) < 2:  # a second write: Redis has the next one queued
                await asyncio.sleep(0)
            later = []
            for turn in range(10):  # ten turns, five calls each
                later += [
                    asyncio.ensure_future(pipeline.execute(b"ECHO", f"{turn}.{i}"))
                    for i in range(5)
                ]
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            assert len(written) == 2  # all fifty held
        finally:
            server.resume()
        assert await asyncio.gather(*first) == [b"first", b"second"]
        replies = await asyncio.gather(*later)
        assert replies == [f"{t}.{i}".encode() for t in range(10) for i in range(5)]
        assert len(written) == 3
        assert written[2].count(b"ECHO") == 50


async def test_the_pipeline_speaks_a_unix_socket(start_redis, config: Config) -> None:
    """unix:// URLs (Redis on the same host, as the embedded server): the listener's
    claims go over the pipeline there too, with the URL's database."""
    where = Path(tempfile.mkdtemp(prefix="realm-sock-"))  # a socket path must be short
    sock = where / "redis.sock"
    try:
        start_redis("--unixsocket", str(sock), "--unixsocketperm", "700")
        url = f"unix://{sock}?db=2"
        async with opened(url) as (client, pipeline):
            assert await pipeline.execute(b"SET", "where", "db2") == b"OK"
            assert await client.get("where") == b"db2"
        client = redis_client(url, 5.0)
        store = RunStore(client, config, timeout=5.0, pipelined=True)
        try:
            assert isinstance(store._pipeline, Pipeline)
            started = await store.start_run("sync", {}, "k")
            assert store._pipeline._conn is not None  # the claim went over the pipeline
            again = await store.start_run("sync", {}, "k")
            assert (again.deduped, again.run_id) == (True, started.run_id)
        finally:
            store.close()
            await client.aclose()
    finally:
        shutil.rmtree(where, ignore_errors=True)
