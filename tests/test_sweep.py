"""The sweep (gateway/store/sweep.py, sweep.lua) against a real server: expired runs leave the
index, live ones never do, the stream is trimmed by age back to empty, work per call
is bounded, replicas share one walk, and the background loop never crashes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.store.runstore import RunStore
from gateway.store.sweep import INDEX_CHUNK, Sweeper, sweep
from tests.servers import free_port

YAML = """
version: 1
workflows:
  w:
    steps: [a, b]
    retention: 1s
    stream_retention: 30s
  other:
    steps: [a]
"""
INDEX = "realm:{w}:runs"
STREAM = "realm:{w}:stream"
POSITION = "realm:{w}:sweep"


@pytest.fixture
def sweep_config() -> Config:
    return parse_config(YAML, file="sweep.yaml", with_triggers=False)


@pytest.fixture
async def wstore(redis: Redis, sweep_config: Config) -> RunStore:
    return RunStore(redis, sweep_config, timeout=5.0)


async def _start(store: RunStore, n: int, *, keyed_every: int = 2) -> list[str]:
    """n runs of workflow w, every ``keyed_every``-th with a key."""
    ids = []
    for i in range(n):
        key = f"k{i}" if i % keyed_every == 0 else None
        ids.append((await store.start_run("w", {"i": i}, key)).run_id)
    return ids


async def _expire(redis: Redis, store: RunStore, run_ids: list[str]) -> None:
    """End the runs and wait for the server to expire them (retention 1 s)."""
    for run_id in run_ids:
        await store.cancel_run(run_id)
    await _until(lambda: _none_exist(redis, store, run_ids))


async def _none_exist(redis: Redis, store: RunStore, run_ids: list[str]) -> bool:
    return await redis.exists(*(store.keys("w").run(r) for r in run_ids)) == 0


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_expired_runs_leave_the_index_and_live_ones_stay(wstore: RunStore, redis: Redis):
    ids = await _start(wstore, 30)
    gone, kept = ids[:20], ids[20:]
    await _expire(redis, wstore, gone)
    await wstore.complete_step(kept[0], "a")
    await wstore.complete_step(kept[0], "b")  # ended, not yet expired
    fresh = await _start(wstore, 5)  # inside retention: none can have expired

    report = await sweep(wstore, "w")

    # The walk stops at the ids started one retention ago: the fresh are not checked.
    assert (report.checked, report.removed, report.wrapped) == (30, 20, True)
    members = {m.decode() for m in await redis.zrange(INDEX, 0, -1)}
    assert members == {*kept, *fresh}
    assert await redis.exists(POSITION) == 0  # the walk wrapped: it starts over
    # A second sweep finds nothing more to do.
    again = await sweep(wstore, "w")
    assert (again.removed, again.trimmed) == (0, 0)


async def test_a_call_checks_at_most_one_chunk_and_the_walk_goes_on_from_there(
    wstore: RunStore, redis: Redis
):
    n = 2 * INDEX_CHUNK + 50
    ids = await _start(wstore, n, keyed_every=3)
    # The last id of the first chunk is live: the next chunk reads it again (it
    # starts at that score, inclusive, so ids sharing a score are never skipped).
    live = {ids[0], ids[INDEX_CHUNK - 1], ids[-1]}
    await _expire(redis, wstore, [r for r in ids if r not in live])

    first = await sweep(wstore, "w", max_calls=1)
    # One call per index: the run index's first chunk, and the key index (150 keys,
    # one chunk), whose keys are all gone but k0's (its run, ids[0], is live).
    assert (first.calls, first.checked, first.removed) == (2, INDEX_CHUNK, INDEX_CHUNK - 2)
    assert (first.keys_checked, first.keys_removed) == (150, 149)
    assert await redis.exists(POSITION) == 1

    rest = await sweep(wstore, "w")
    assert (rest.calls, rest.checked, rest.wrapped) == (3, n - INDEX_CHUNK + 1, True)
    assert (rest.keys_checked, rest.keys_removed) == (1, 0)
    assert {m.decode() for m in await redis.zrange(INDEX, 0, -1)} == live
    assert first.removed + rest.removed == n - len(live)


async def test_replicas_share_one_walk(wstore: RunStore, redis: Redis):
    """Two sweepers that read the same position: the second finds it moved and leaves
    the index alone, so the chunk is done once."""
    ids = await _start(wstore, INDEX_CHUNK + 10, keyed_every=5)
    await _expire(redis, wstore, ids)
    keys = wstore.keys("w")
    chunk = [m.decode() for m in await redis.zrange(INDEX, 0, INDEX_CHUNK - 1)]
    call = wstore.scripts.sweep
    script_keys = [keys.runs(), keys.stream(), keys.sweep(), *(keys.run(r) for r in chunk)]

    one = await call(script_keys, ["", "123", 30_000, 10_000, 1, *chunk])
    two = await call(script_keys, ["", "456", 30_000, 10_000, 1, *chunk])

    assert one[:2] == [b"swept", INDEX_CHUNK]
    assert two[:2] == [b"moved", 0]
    assert await redis.get(POSITION) == b"123"
    assert await redis.zcard(INDEX) == 10


async def test_concurrent_sweeps_remove_every_expired_id_once(wstore: RunStore, redis: Redis):
    ids = await _start(wstore, 3 * INDEX_CHUNK, keyed_every=4)
    live = set(ids[::50])
    await _expire(redis, wstore, [r for r in ids if r not in live])

    reports = await asyncio.gather(*(sweep(wstore, "w") for _ in range(4)))

    assert sum(r.removed for r in reports) == len(ids) - len(live)
    assert {m.decode() for m in await redis.zrange(INDEX, 0, -1)} == live


KEY_INDEX = "realm:{w}:keys"
KEY_POSITION = "realm:{w}:keysweep"


async def _key_index(redis: Redis) -> set[str]:
    return {m.decode() for m in await redis.zrange(KEY_INDEX, 0, -1)}


async def test_keys_whose_pointer_and_run_set_expired_leave_the_key_index(
    wstore: RunStore, redis: Redis
):
    keys = wstore.keys("w")
    gone = [(await wstore.start_run("w", {}, f"gone{i}")).run_id for i in range(20)]
    live = await wstore.start_run("w", {}, "live")
    # Half a group is still a group (reconcile has to see it): a run set whose pointer
    # was lost, and a pointer whose run set was.
    await wstore.start_run("w", {}, "set-only")
    await redis.delete(keys.pointer("set-only"))
    await wstore.start_run("w", {}, "pointer-only")
    await redis.delete(keys.key_runs("pointer-only"))
    await _expire(redis, wstore, gone)

    async def groups_gone() -> bool:
        names = [
            n for i in range(20) for n in (keys.pointer(f"gone{i}"), keys.key_runs(f"gone{i}"))
        ]
        return await redis.exists(*names) == 0

    await _until(groups_gone)
    assert len(await _key_index(redis)) == 23

    report = await sweep(wstore, "w")

    assert (report.keys_checked, report.keys_removed) == (23, 20)
    assert await _key_index(redis) == {"live", "set-only", "pointer-only"}
    assert await redis.exists(KEY_POSITION) == 0  # the walk reached the end: it starts over
    again = await sweep(wstore, "w")
    assert (again.keys_checked, again.keys_removed) == (3, 0)
    # A key is indexed again when it is claimed again.
    assert (await wstore.start_run("w", {}, "gone0")).run_id != gone[0]
    assert "gone0" in await _key_index(redis)
    assert (await redis.hget(keys.pointer("live"), "run")).decode() == live.run_id


async def test_a_key_claimed_again_after_the_sweep_read_it_stays_in_the_key_index(
    wstore: RunStore, redis: Redis
):
    """The sweep reads a chunk, then a claim writes one of its keys again, then the
    sweep's call arrives: the call checks the keys as they are, so the key stays."""
    keys = wstore.keys("w")
    ids = [(await wstore.start_run("w", {}, f"k{i}")).run_id for i in range(5)]
    await _expire(redis, wstore, ids)
    chunk = [m.decode() for m in await redis.zrange(KEY_INDEX, 0, -1)]
    assert chunk == [f"k{i}" for i in range(5)]
    again = await wstore.start_run("w", {}, "k2")
    script_keys = [KEY_INDEX, STREAM, KEY_POSITION,
                   *(n for k in chunk for n in (keys.pointer(k), keys.key_runs(k)))]  # fmt: skip

    reply = await wstore.scripts.sweep(script_keys, ["", "", "", 10_000, 2, *chunk])

    assert reply == [b"swept", 4, 0, b"0"]  # and the stream was left alone ('')
    assert await _key_index(redis) == {"k2"}
    assert (await redis.hget(keys.pointer("k2"), "run")).decode() == again.run_id


async def test_concurrent_sweeps_remove_every_gone_key_once(wstore: RunStore, redis: Redis):
    ids = await _start(wstore, 3 * INDEX_CHUNK, keyed_every=1)
    live = set(ids[::50])
    await _expire(redis, wstore, [r for r in ids if r not in live])
    keys = wstore.keys("w")

    async def groups_gone() -> bool:
        names = [keys.pointer(f"k{i}") for i, r in enumerate(ids) if r not in live]
        return await redis.exists(*names) == 0

    await _until(groups_gone)

    reports = await asyncio.gather(*(sweep(wstore, "w") for _ in range(4)))

    assert sum(r.keys_removed for r in reports) == len(ids) - len(live)
    assert await _key_index(redis) == {f"k{i}" for i, r in enumerate(ids) if r in live}


async def test_the_stream_is_trimmed_by_age_back_to_empty(wstore: RunStore, redis: Redis):
    """Entries older than stream_retention (30 s here) go, whole macro nodes first,
    then exactly: nothing of an idle stream is left, however small."""
    now_ms = int((await redis.time())[0]) * 1000
    old = 450  # several macro nodes (stream-node-max-entries is 100)
    for i in range(old):
        await redis.xadd(STREAM, {"run_id": f"old{i}", "step": "a"}, id=f"{now_ms - 60_000}-{i}")
    ids = await _start(wstore, 5)

    report = await sweep(wstore, "w")

    assert report.trimmed == old
    remaining = await redis.xrange(STREAM)
    assert [e[1][b"run_id"].decode() for e in remaining] == ids  # the new entries stay
    # A few old entries only (less than a macro node): the exact trim takes them.
    await redis.delete(STREAM)
    for i in range(3):
        await redis.xadd(STREAM, {"run_id": f"old{i}"}, id=f"{now_ms - 60_000}-{i}")
    assert (await sweep(wstore, "w")).trimmed == 3
    assert await redis.xlen(STREAM) == 0


async def test_stream_retention_defaults_to_retention_and_is_checked():
    config = parse_config(YAML, file="sweep.yaml", with_triggers=False)
    assert config.workflows["w"].stream_retention_ms == 30_000
    assert config.workflows["other"].stream_retention_ms == 7 * 86_400_000
    bad = YAML.replace("stream_retention: 30s", "stream_retention: 30 seconds")
    with pytest.raises(ConfigError) as caught:
        parse_config(bad, file="sweep.yaml", with_triggers=False)
    assert str(caught.value) == (
        "sweep.yaml: workflow 'w': field 'stream_retention': must be a duration like "
        "'7d', '36h' or '90m' (got '30 seconds')"
    )


async def test_the_sweep_frees_memory_on_a_server_that_refuses_starts(
    start_redis, sweep_config: Config
):
    """At maxmemory with noeviction every start is refused; the sweep still runs
    (allow-oom), so the expired runs' memory comes back."""
    server = start_redis("--maxmemory-policy", "noeviction")
    client = redis_client(server.url, 5.0)
    try:
        store = RunStore(client, sweep_config, timeout=5.0)
        ids = await _start(store, 300)
        await _expire(client, store, ids)
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory", used - 1)
        with pytest.raises(StoreUnavailable, match="maxmemory"):
            await store.start_run("w", {})

        report = await sweep(store, "w")

        assert report.removed == 300
        assert await client.zcard(INDEX) == 0
    finally:
        await client.aclose()


async def test_the_background_sweeper_logs_an_outage_once_and_stops_cleanly(
    sweep_config: Config, caplog: pytest.LogCaptureFixture
):
    client = redis_client(f"redis://127.0.0.1:{free_port()}/0", 1.0)
    store = RunStore(client, sweep_config, timeout=1.0)
    sweeper = Sweeper(store, interval=0.005)
    caplog.set_level(logging.INFO, logger="realm")
    task = asyncio.create_task(sweeper.run())
    try:
        await _until(_at_least(sweeper, 5))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.name == "realm"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("sweep: Redis is unreachable: ")


async def test_the_background_sweeper_says_when_it_works_again(
    redis: Redis, sweep_config: Config, caplog: pytest.LogCaptureFixture
):
    store = RunStore(redis, sweep_config, timeout=1.0)
    sweeper = Sweeper(store, interval=0.005)
    caplog.set_level(logging.INFO, logger="realm")
    await redis.set(POSITION, "not a score")  # ZRANGE refuses it: an error, not a crash
    await sweeper.tick(["w"])
    await sweeper.tick(["w"])
    await redis.delete(POSITION)
    await sweeper.tick(["w"])
    messages = [r.getMessage() for r in caplog.records if r.name == "realm"]
    assert len(messages) == 2, messages
    assert messages[0].startswith("sweep failed: ResponseError: ")
    assert messages[1] == "sweep: trimming resumed"


def _at_least(sweeper: Sweeper, ticks: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return sweeper.ticks >= ticks

    return check


async def test_a_busy_server_is_unavailable_not_an_error(start_redis, sweep_config: Config):
    """BUSY (a script past busy-reply-threshold) means "not now": StoreUnavailable,
    which the background loop logs once and retries."""
    server = start_redis("--busy-reply-threshold", "50")
    client = redis_client(server.url, 5.0)
    blocker = redis_client(server.url, 5.0)
    busy = asyncio.create_task(
        blocker.eval(
            "local t = redis.call('TIME')[1] while redis.call('TIME')[1] - t < 10 do end", 0
        )
    )
    try:
        store = RunStore(client, sweep_config, timeout=5.0)

        async def refused_busy() -> bool:
            try:
                await sweep(store, "w")
            except StoreUnavailable as exc:
                assert "BUSY" in exc.message, exc.message
                return True
            return False

        await _until(refused_busy)
    finally:
        await client.script_kill()
        with pytest.raises(Exception, match="killed"):
            await busy
        await client.aclose()
        await blocker.aclose()
