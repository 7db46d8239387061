"""Promise 2 for every mutation: a resend after a lost reply reports what the first
attempt did; a batch is all-or-nothing and safe to retry; "not now" from Redis is
StoreUnavailable (503), never a crash.

Real servers of the tests' own; the lost reply is lost on the wire by tests/tcp_proxy.py
after Redis committed the script.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest
import redis as redis_sync

from gateway.link.connection import redis_client
from gateway.model.config import Config
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.runs import batch_run_id
from gateway.store.runstore import RunStore
from tests.servers import RedisServer
from tests.tcp_proxy import TcpProxy


@pytest.fixture
async def proxied(start_redis, config: Config) -> AsyncIterator[tuple[RunStore, TcpProxy]]:
    """A store whose connection to a fresh server goes through the reply-dropping proxy."""
    server: RedisServer = start_redis()
    proxy = TcpProxy(server.port).start()
    client = redis_client(proxy.url, 5.0)
    store = RunStore(client, config, timeout=5.0)
    # Scripts loaded up front: a dropped NOSCRIPT reply would prove nothing.
    await store.load_scripts()
    try:
        yield store, proxy
    finally:
        await client.aclose()
        proxy.stop()


def lose_the_next_script_reply(proxy: TcpProxy) -> None:
    proxy.drop_next_reply(b"EVALSHA")


def assert_one_reply_was_lost(proxy: TcpProxy) -> None:
    assert not proxy.armed, "the call never went through the proxy"
    assert len(proxy.dropped) == 1


async def test_a_lost_complete_step_reply_reports_the_step_as_done(proxied) -> None:
    store, proxy = proxied
    run = await store.start_run("sync", {})
    lose_the_next_script_reply(proxy)
    result = await store.complete_step(run.run_id, "fetch")  # was: STATE_STEP_NOT_CURRENT
    assert_one_reply_was_lost(proxy)
    assert (result.phase, result.next_step) == ("running", "transform")
    entries = await store.redis.xrange(store.keys("sync").stream())
    assert [e[1][b"step"] for e in entries] == [b"fetch", b"transform"], "a step was queued twice"


async def test_a_lost_reply_of_the_last_step_reports_the_run_completed(proxied) -> None:
    store, proxy = proxied
    run = await store.start_run("single", {})
    lose_the_next_script_reply(proxy)
    result = await store.complete_step(run.run_id, "only")
    assert_one_reply_was_lost(proxy)
    assert (result.phase, result.next_step) == ("completed", None)


async def test_a_lost_fail_reply_reports_the_run_failed(proxied) -> None:
    store, proxy = proxied
    run = await store.start_run("sync", {})
    lose_the_next_script_reply(proxy)
    failed = await store.fail_run(run.run_id, "boom")  # was: STATE_RUN_NOT_LIVE
    assert_one_reply_was_lost(proxy)
    assert (failed.phase, failed.error) == ("failed", "boom")


async def test_a_lost_cancel_reply_reports_one_cancelled(proxied) -> None:
    store, proxy = proxied
    run = await store.start_run("sync", {})
    lose_the_next_script_reply(proxy)
    assert await store.cancel_run(run.run_id) == 1  # was: 0
    assert_one_reply_was_lost(proxy)
    assert (await store.get_run(run.run_id)).phase == "cancelled"


async def test_a_lost_cancel_key_reply_reports_one_cancelled(proxied) -> None:
    store, proxy = proxied
    run = await store.start_run("sync", {}, "k1")
    lose_the_next_script_reply(proxy)
    assert await store.cancel_key("sync", "k1") == 1  # was: 0
    assert_one_reply_was_lost(proxy)
    assert (await store.get_run(run.run_id)).phase == "cancelled"


async def test_a_caller_retrying_with_its_op_id_learns_what_the_first_call_did(
    store: RunStore,
) -> None:
    run = await store.start_run("sync", {})
    first = await store.complete_step(run.run_id, "fetch", op_id="op-1")
    again = await store.complete_step(run.run_id, "fetch", op_id="op-1")
    assert again == first
    # A different call is a new decision: the step is no longer current.
    with pytest.raises(RealmError) as refused:
        await store.complete_step(run.run_id, "fetch", op_id="op-2")
    assert refused.value.code == "STATE_STEP_NOT_CURRENT"


# ------------------------------------------------------------------ batches


@pytest.mark.slow
async def test_a_lost_start_reply_reports_the_run_the_first_try_started(proxied) -> None:
    """A first try skips the caller-id check (a fresh run id cannot be in Redis); the
    store's resend of a call whose reply was lost makes it, and finds its own run."""
    store, proxy = proxied
    lose_the_next_script_reply(proxy)
    started = await store.start_run("sync", {}, "k")
    assert_one_reply_was_lost(proxy)
    assert (started.deduped, started.rerun_of) == (False, None)
    assert started.run_id == proxy.dropped[0].script_argv[0].decode()
    assert await store.redis.zcard("realm:{sync}:runs") == 1


async def test_a_lost_batch_reply_without_a_batch_id_starts_every_item_once(proxied) -> None:
    store, proxy = proxied
    lose_the_next_script_reply(proxy)
    entries = await store.start_run_batch("sync", [{"params": {"n": n}} for n in range(5)])
    assert_one_reply_was_lost(proxy)
    assert all(e.result and not e.result.deduped for e in entries)
    assert await store.redis.zcard("realm:{sync}:runs") == 5


async def test_a_batch_retried_after_an_unknown_outcome_starts_every_item_once(
    start_redis, config: Config
) -> None:
    """2 500 keyless items (more than one call used to hold): Redis pauses writes, the
    call times out (503, outcome unknown), the caller retries with the same batch id.
    Before: the first 1 000 were stored, the retry started all 2 500 again (4 500 runs)."""
    server: RedisServer = start_redis()
    items = [{"params": {"n": n}} for n in range(2500)]
    client = redis_client(server.url, 5.0)
    admin = redis_sync.Redis.from_url(server.url)
    try:
        store = RunStore(client, config, timeout=5.0)
        await store.load_scripts()
        hasty = RunStore(client, config, timeout=0.5)
        admin.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
        with pytest.raises(StoreUnavailable):
            await hasty.start_run_batch("sync", items, batch_id="batch-7")
        # All or nothing, never a part of the batch.
        assert admin.zcard("realm:{sync}:runs") in (0, len(items))
        admin.execute_command("CLIENT", "UNPAUSE")
        entries = await store.start_run_batch("sync", items, batch_id="batch-7")
        assert [e.result.run_id for e in entries if e.result] == [
            batch_run_id("sync", "batch-7", i) for i in range(len(items))
        ]
        assert all(e.result and not e.result.deduped for e in entries)
        assert admin.zcard("realm:{sync}:runs") == len(items)
        assert admin.xlen("realm:{sync}:stream") == len(items)
    finally:
        await client.aclose()
        admin.close()


async def test_a_batch_is_one_atomic_call(store: RunStore) -> None:
    """Whatever its size: nothing else runs in Redis between its items."""
    items = [{"params": {"n": n}} for n in range(1500)]
    await store.load_scripts()  # no NOSCRIPT round to count
    calls_before = await _script_calls(store)
    entries = await store.start_run_batch("sync", items)
    assert len(entries) == 1500
    assert await _script_calls(store) - calls_before == 1


async def _script_calls(store: RunStore) -> int:
    stats = await store.redis.info("commandstats")
    return sum(stats.get(name, {}).get("calls", 0) for name in ("cmdstat_evalsha", "cmdstat_eval"))


# ------------------------------------------------------------------ "not now"


async def test_busy_redis_is_store_unavailable_not_a_crash(start_redis, config: Config) -> None:
    """BUSY (a script running past its time limit) means the call did not run: 503."""
    server: RedisServer = start_redis("--busy-reply-threshold", "50")
    client = redis_client(server.url, 5.0)
    store = RunStore(client, config, timeout=5.0)
    await store.load_scripts()
    hog = redis_sync.Redis.from_url(server.url)
    probe = redis_sync.Redis.from_url(server.url)
    # A script that keeps the server for 1.5 s of its own clock.
    spin = (
        "local t = redis.call('TIME') "
        "repeat local n = redis.call('TIME') "
        "until (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 1500000"
    )
    thread = threading.Thread(target=hog.eval, args=(spin, 0))
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while True:  # until the server answers BUSY
            try:
                probe.ping()
            except redis_sync.ResponseError as exc:
                assert str(exc).startswith("BUSY"), exc
                break
            assert time.monotonic() < deadline, "the server never became busy"
        with pytest.raises(StoreUnavailable) as unavailable:
            await store.start_run("sync", {}, "k")
        assert "BUSY" in unavailable.value.message
    finally:
        thread.join()
        hog.close()
        probe.close()
    # Once the script is done, the same start goes through.
    assert not (await store.start_run("sync", {}, "k")).deduped
    await client.aclose()


async def test_readonly_replica_is_store_unavailable(start_redis, config: Config) -> None:
    primary: RedisServer = start_redis()
    replica: RedisServer = start_redis("--replicaof", "127.0.0.1", str(primary.port))
    client = redis_client(replica.url, 5.0)
    store = RunStore(client, config, timeout=5.0)
    try:
        with pytest.raises(StoreUnavailable) as unavailable:
            await store.start_run("sync", {}, "k")
        assert "read only replica" in unavailable.value.message
    finally:
        await client.aclose()


async def test_a_start_whose_key_keeps_moving_is_bounded(store: RunStore) -> None:
    """50 concurrent cancel_existing starts on one key all finish, each within the
    bounded number of calls, and leave one live run."""
    results = await asyncio.gather(
        *(store.start_run("sync", {"n": n}, "hot", "cancel_existing") for n in range(50))
    )
    live = [r for r in results if (await store.get_run(r.run_id)).phase == "running"]
    assert len(live) == 1
