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
from redis.exceptions import ResponseError

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.store import sweep as sweep_module
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
  queue:
    steps: [a, b]
    stream_retention: 1s
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
    # One call per walk: the run index's first chunk, the key index (150 keys, one
    # chunk), whose keys are all gone but k0's (its run, ids[0], is live), and the
    # stream (nothing older than stream_retention).
    assert (first.calls, first.checked, first.removed) == (3, INDEX_CHUNK, INDEX_CHUNK - 2)
    assert (first.keys_checked, first.keys_removed) == (150, 149)
    assert await redis.exists(POSITION) == 1

    rest = await sweep(wstore, "w")
    assert (rest.calls, rest.checked, rest.wrapped) == (4, n - INDEX_CHUNK + 1, True)
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
    script_keys = [keys.runs(), keys.sweep(), *(keys.run(r) for r in chunk)]

    one = await call(script_keys, ["", "123", "index", 1, "", "", "", "", *chunk])
    two = await call(script_keys, ["", "456", "index", 1, "", "", "", "", *chunk])

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
    script_keys = [KEY_INDEX, KEY_POSITION,
                   *(n for k in chunk for n in (keys.pointer(k), keys.key_runs(k)))]  # fmt: skip

    reply = await wstore.scripts.sweep(script_keys, ["", "", "index", 2, "", "", "", "", *chunk])

    assert reply == [b"swept", 4, 0, b"0", 0]  # an index call leaves the stream alone
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


async def _read_and_acknowledge(redis: Redis, stream: str, n: int) -> None:
    """A runner reads ``n`` entries through the runners' group and is done with them."""
    [(_, read)] = await redis.xreadgroup("runners", "r1", {stream: ">"}, count=n)
    assert len(read) == n
    await redis.xack(stream, "runners", *(entry_id for entry_id, _ in read))


async def test_the_stream_is_trimmed_by_age_back_to_empty(wstore: RunStore, redis: Redis):
    """Entries the runners read and acknowledged go once older than stream_retention
    (30 s here), whole macro nodes first, then exactly: nothing of an idle stream is
    left, however small."""
    now_ms = int((await redis.time())[0]) * 1000
    await wstore.ensure_groups("w")
    old = 450  # several macro nodes (stream-node-max-entries is 100)
    for i in range(old):
        await redis.xadd(STREAM, {"run_id": f"old{i}", "step": "a"}, id=f"{now_ms - 60_000}-{i}")
    await _read_and_acknowledge(redis, STREAM, old)
    ids = await _start(wstore, 5)

    report = await sweep(wstore, "w")

    assert (report.trimmed, report.entries_removed) == (old, 0)
    remaining = await redis.xrange(STREAM)
    assert [e[1][b"run_id"].decode() for e in remaining] == ids  # the new entries stay
    # A few old entries only (less than a macro node): the exact trim takes them.
    await redis.delete(STREAM)
    for i in range(3):
        await redis.xadd(STREAM, {"run_id": f"old{i}"}, id=f"{now_ms - 60_000}-{i}")
    await redis.xgroup_create(STREAM, "runners", id="0")  # it went with the stream
    await _read_and_acknowledge(redis, STREAM, 3)
    assert (await sweep(wstore, "w")).trimmed == 3
    assert await redis.xlen(STREAM) == 0


async def _until_older_than(redis: Redis, stream: str, ms: int) -> None:
    """Poll the server's clock until the stream's newest entry is older than ``ms``."""
    [(newest, _)] = await redis.xrevrange(stream, count=1)

    async def old_enough() -> bool:
        seconds, micros = await redis.time()
        return seconds * 1000 + micros // 1000 > int(newest.split(b"-")[0]) + ms

    await _until(old_enough)


async def test_a_step_no_runner_read_is_kept_however_old(wstore: RunStore, redis: Redis):
    """No runner has read the stream yet, and it has no group: entries older than
    stream_retention stay while their run needs them, for a runner that comes later;
    the unread ones no run needs any more (ended, moved on) are deleted."""
    stream = wstore.keys("queue").stream()
    live = [(await wstore.start_run("queue", {"n": n})).run_id for n in range(3)]
    cancelled = [(await wstore.start_run("queue", {})).run_id for _ in range(2)]
    for run_id in cancelled:
        await wstore.cancel_run(run_id)
    moved_on = (await wstore.start_run("queue", {})).run_id
    await wstore.complete_step(moved_on, "a")  # by an operator: no runner read its entry
    assert await redis.xlen(stream) == 7
    await _until_older_than(redis, stream, 1000)

    report = await sweep(wstore, "queue")

    left = [(f[b"run_id"].decode(), f[b"step"].decode()) for _, f in await redis.xrange(stream)]
    assert left == [(r, "a") for r in live] + [(moved_on, "b")]
    assert (report.entries_checked, report.entries_removed, report.trimmed) == (7, 3, 0)
    [group] = await redis.xinfo_groups(stream)  # made by the sweep, from the first entry
    assert (group["name"], group["last-delivered-id"]) == (b"runners", b"0-0")
    # A runner deployed now is handed every one of them.
    taken = await wstore.take_steps("queue", "latecomer", count=10)
    assert sorted((t.run_id, t.step) for t in taken) == sorted(left)


async def test_consumers_that_left_are_deleted_a_few_per_call(
    wstore: RunStore, redis: Redis, monkeypatch: pytest.MonkeyPatch
):
    """A consumer idle past the bound with nothing pending has left: deleted, at most
    CONSUMER_LIMIT per call. One holding a step stays, however idle, and one that
    read lately stays."""
    stream = wstore.keys("queue").stream()
    for n in range(7):
        await wstore.start_run("queue", {"n": n})
    [held] = await wstore.take_steps("queue", "holder")

    async def read_one(consumer: str) -> None:
        """A runner takes an entry and is done with it (raw commands: XAUTOCLAIM, as
        take_steps sends it, would move the held entry to whoever calls it)."""
        [(_, [(entry_id, _)])] = await redis.xreadgroup("runners", consumer, {stream: ">"}, 1)
        await redis.xack(stream, "runners", entry_id)

    for i in range(5):  # runners that did their work and went away
        await read_one(f"gone{i}")

    async def consumers() -> dict[str, dict]:
        found = await redis.xinfo_consumers(stream, "runners")
        return {c["name"].decode(): c for c in found}

    async def all_idle() -> bool:
        return all(c["idle"] >= 2000 for c in (await consumers()).values())

    await _until(all_idle)
    await read_one("recent")  # a runner still there
    monkeypatch.setattr(sweep_module, "CONSUMER_LIMIT", 2)

    deleted = [
        (await sweep(wstore, "queue", consumer_idle_ms=2000)).consumers_removed for _ in range(4)
    ]

    assert deleted == [2, 2, 1, 0]
    left = await consumers()
    assert sorted(left) == ["holder", "recent"]
    assert left["holder"]["pending"] == 1 and left["holder"]["idle"] >= 2000
    # Nothing of the held step was lost: its runner reports it.
    done = await wstore.complete_step(held.run_id, "a", lease=held.lease, entry_id=held.entry_id)
    assert done.next_step == "b"


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
        # Well under what is used: keys still expiring (the cancels' operation records)
        # must not bring the server back under its limit before the start is tried.
        await client.config_set("maxmemory", used // 2)
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
    which the background loop logs once and retries. The sweep's first command is a
    pipeline (its position and the server's clock), whose error redis-py rewrites as
    "Command # 1 (GET …) of pipeline caused error: ('BUSY …',)": the reply inside is
    what counts. The test waits until the server answers BUSY before it sweeps."""
    server = start_redis("--busy-reply-threshold", "50")
    client = redis_client(server.url, 5.0)
    blocker = redis_client(server.url, 5.0)
    await asyncio.gather(client.ping(), blocker.ping())  # both connected before the script
    busy = asyncio.create_task(
        blocker.eval(
            "local t = redis.call('TIME')[1] while redis.call('TIME')[1] - t < 10 do end", 0
        )
    )
    try:
        store = RunStore(client, sweep_config, timeout=5.0)

        async def answers_busy() -> bool:
            try:
                await client.ping()
            except ResponseError as exc:
                assert str(exc).startswith("BUSY "), exc
                return True
            return False

        await _until(answers_busy)

        with pytest.raises(StoreUnavailable) as swept:
            await sweep(store, "w")
        assert swept.value.message.startswith("Redis refused the call: BUSY Redis is busy")
        # Any pipelined read of the store is classified the same way (get_run reads
        # the run hash of every workflow in one pipeline).
        with pytest.raises(StoreUnavailable) as read:
            await store.get_run("0" * 32)
        assert read.value.message.startswith("Redis refused the call: BUSY Redis is busy")
    finally:
        await client.script_kill()
        with pytest.raises(Exception, match="killed"):
            await busy
        await client.aclose()
        await blocker.aclose()
