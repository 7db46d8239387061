"""An idle runner waits on Redis, not on a timer: a blocking read of the ready streams
(XREADGROUP ... BLOCK) on a connection of its own, so a step made ready on a quiet
workflow starts at once. Real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from gateway.loading import parse_config
from gateway.runners.runner import Runner
from gateway.store.keys import Keys
from gateway.store.runs import TakenStep
from gateway.store.runstore import RunStore
from gateway.store.steps import RUNNERS_GROUP

YAML = """
version: 1
workflows:
  quiet:
    steps: [only]
  wide:
    steps: [only]
    partitions: 3
"""


def _store(redis: Redis) -> RunStore:
    return RunStore(redis, parse_config(YAML, file="wait.yaml", with_triggers=False), timeout=5.0)


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def blocked_readers(redis: Redis) -> list[dict[str, Any]]:
    """The clients Redis holds in a blocking XREADGROUP."""
    return [c for c in await redis.client_list()
            if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")]  # fmt: skip


async def test_an_idle_runner_waits_on_redis_and_a_new_step_starts_at_once(redis: Redis) -> None:
    store = _store(redis)
    started: list[float] = []

    async def only(step: TakenStep) -> dict[str, str]:
        started.append(time.monotonic())
        return {}

    runner = Runner(store, ["quiet", "wide"], {"only": only}, concurrency=2)
    task = asyncio.create_task(runner.run())
    try:
        # Idle: blocked in a read on Redis, on one connection for every stream of both
        # workflows (so nothing polls meanwhile).
        await until(lambda: _some(blocked_readers(redis)))
        [reader] = await blocked_readers(redis)
        assert reader["cmd"] == "xreadgroup"
        ready_at = time.monotonic()
        await store.start_run("quiet", {})
        await until(lambda: _true(bool(started)))
        # A loose bound (a shared, busy test machine): polling backed off to 1 s.
        assert started[0] - ready_at < 0.5
        await until(lambda: _some(blocked_readers(redis)))  # waiting again
        runner.stop()
        await asyncio.wait_for(task, 2.0)  # the wait ends with stop(), not at its timeout
    finally:
        runner.abandon()
        await asyncio.gather(task, return_exceptions=True)
    assert runner.counts["ok"] == 1
    assert await blocked_readers(redis) == []


async def test_a_wait_stopped_leaves_the_next_step_to_the_next_take(redis: Redis) -> None:
    store = _store(redis)
    stop = asyncio.Event()
    wait = asyncio.create_task(store.wait_for_steps(["quiet"], "r1", stop=stop, wait_ms=60_000))
    await until(lambda: _some(blocked_readers(redis)))
    stop.set()
    assert await asyncio.wait_for(wait, 2.0) == []
    run = await store.start_run("quiet", {})
    [taken] = await store.take_steps("quiet", "r2")
    assert taken.run_id == run.run_id, "the stopped read took nothing with it"
    await store.end_waits("r1")


async def test_a_wait_takes_at_most_count_and_leaves_the_rest_ready(redis: Redis) -> None:
    """Entries ready on two partitions at once: one read returns both; the one beyond
    ``count`` is left for the next take at once (not after a lease)."""
    store = _store(redis)
    await store.ensure_groups("wide")
    runs = set()
    while len({Keys("realm", "wide", int(r[-4:], 16) % 3).stream() for r in runs}) < 2:
        runs.add((await store.start_run("wide", {"n": len(runs)})).run_id)
    got = await store.wait_for_steps(["wide"], "r1", count=1, wait_ms=1_000)
    rest: list[TakenStep] = []
    for _ in range(3):
        rest += await store.take_steps("wide", "r2", count=10)
    assert len(got) == 1
    assert {t.run_id for t in got + rest} == runs
    await store.end_waits("r1")


async def test_a_wait_with_nothing_new_returns_empty_after_its_time(redis: Redis) -> None:
    store = _store(redis)
    began = time.monotonic()
    assert await store.wait_for_steps(["quiet"], "r1", wait_ms=200) == []
    assert time.monotonic() - began >= 0.099  # between half and all of wait_ms, at random
    pending = await redis.xpending(Keys("realm", "quiet").stream(), RUNNERS_GROUP)
    assert pending["pending"] == 0
    await store.end_waits("r1")


async def _some(found: Awaitable[list[Any]]) -> bool:
    return bool(await found)


async def _true(value: bool) -> bool:
    return value
