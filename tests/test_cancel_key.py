"""Cancelling by idempotency key when the key's pointer dangles (it names a run whose
hash no longer exists: deleted, evicted, a partial restore), against a real server:
the key is freed, and nothing of it is left without a TTL, so the workflow's memory
still follows its retention (what the sweep and expiry leave is what it was before)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from gateway.loading import parse_config
from gateway.store.runstore import RunStore
from gateway.store.sweep import sweep

YAML = """
version: 1
workflows:
  w:
    steps: [a]
    retention: 1s
"""


@pytest.fixture
async def wstore(redis: Redis) -> RunStore:
    return RunStore(redis, parse_config(YAML, file="t.yaml", with_triggers=False), timeout=5.0)


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_cancel_key_on_a_dangling_pointer_leaves_no_key_without_a_ttl(
    wstore: RunStore, redis: Redis
) -> None:
    keys = wstore.keys("w")
    first = await wstore.start_run("w", {}, "k")
    await wstore.cancel_run(first.run_id)
    # The key runs again: its run set holds both runs, kept without a TTL while the
    # second is live.
    second = await wstore.start_run("w", {}, "k", on_terminal_match="rerun")
    assert await redis.zcard(keys.key_runs("k")) == 2
    await redis.delete(keys.run(second.run_id))  # the pointer now dangles

    assert await wstore.cancel_key("w", "k") == 0

    assert await redis.exists(keys.pointer("k")) == 0  # the key is free
    # What the sweep trims (not expiry) aside, every key of the workflow expires.
    swept = {keys.runs(), keys.key_index(), keys.stream(), keys.sweep(), keys.key_sweep(),
             keys.stream_sweep()}  # fmt: skip
    left = {k.decode() async for k in redis.scan_iter(match="realm:{w}:*")} - swept
    assert left, "the first run's hash and the key's run set are still there"
    without_ttl = [k for k in sorted(left) if await redis.pttl(k) < 0]
    assert without_ttl == []

    # Once retention has passed, expiry and the sweep leave nothing of the key or its
    # runs: not in the key index (reconcile's walk), not in the run index.
    async def expired() -> bool:
        return await redis.exists(*left) == 0

    await _until(expired)
    await sweep(wstore, "w")
    assert await redis.zrange(keys.key_index(), 0, -1) == []
    assert await redis.zrange(keys.runs(), 0, -1) == []
    again = await wstore.start_run("w", {}, "k")  # and the key starts afresh
    assert again.run_id not in (first.run_id, second.run_id)


async def test_a_key_started_after_cancel_key_freed_it_keeps_its_run_set_live(
    wstore: RunStore, redis: Redis
) -> None:
    """cancel_key on a dangling pointer leaves the key's run set with a TTL and no
    pointer. The key is still in the key index, so the next start on it takes the
    full path: the run set loses its TTL while the new run is live, and the new run
    is its newest member."""
    keys = wstore.keys("w")
    first = await wstore.start_run("w", {}, "k")
    await wstore.cancel_run(first.run_id)
    second = await wstore.start_run("w", {}, "k", on_terminal_match="rerun")
    await redis.delete(keys.run(second.run_id))
    assert await wstore.cancel_key("w", "k") == 0
    assert await redis.exists(keys.pointer("k")) == 0
    assert await redis.pttl(keys.key_runs("k")) > 0

    third = await wstore.start_run("w", {}, "k")

    assert await redis.pttl(keys.key_runs("k")) == -1
    newest = await redis.zrange(keys.key_runs("k"), -1, -1)
    assert [m.decode() for m in newest] == [third.run_id]
