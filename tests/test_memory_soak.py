"""Soak: Redis memory follows the runs inside retention, not every run ever started
(the retention rule of the Redis layout).

A real `realm listen --workers 2` (whose workers sweep in the background) serves a
workflow with a 1 s retention. For a few seconds runs are started, keyed through the
webhook and keyless through the store, and each is ended (completed, failed or
cancelled: live runs never expire). Then the load stops: the run index, the stream
and `used_memory` must come back to the baseline taken after a warm-up, by the
server's own expiry and the listener's sweep alone (this test never sweeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.store.keys import Keys
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.servers import RedisServer

pytestmark = pytest.mark.slow

CONFIG = """
version: 1
settings:
  delivery_retention: 1s  # the delivery log empties by its own trim, too
workflows:
  soak:
    steps: [a, b]
    retention: 1s
triggers:
  soak-hook:
    workflow: soak
    path: /hooks/soak
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
    params:
      n: $.n
      note: $.note
"""
KEYS = Keys("realm", "soak")
LIVE = 3  # runs left live throughout: they must stay in the index
SOAK_SECONDS = 8.0
SETTLE_SECONDS = 20.0  # the bound on the return to baseline
SENDERS = 12
NOTE = "x" * 2000  # params held by the run and its stream entries: the growth shows
# Allocator and dict-resize slack: the baseline holds 5 keys, the peak tens of thousands.
MEMORY_SLACK = 256 * 1024


async def test_memory_index_and_stream_return_to_baseline(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
):
    server = start_redis()
    listener = Listener(tmp_path, CONFIG, redis_url=server.url, workers=2).start()
    redis = redis_client(server.url, 5.0)
    store = RunStore(redis, parse_config(CONFIG, with_triggers=False), timeout=5.0)
    try:
        async with httpx.AsyncClient(base_url=listener.base_url, timeout=10) as http:
            live = [(await store.start_run("soak", {"n": -i})).run_id for i in range(LIVE)]
            # Warm-up: every code path once (connections, scripts, the sweep's position).
            await _load(http, store, seconds=0.5)
            await _until_idle(redis, deadline=time.monotonic() + SETTLE_SECONDS)
            baseline = await _figures(redis)

            peak = dict(baseline)
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample(redis, peak, stop))
            started = await _load(http, store, seconds=SOAK_SECONDS)
            stop.set()
            await sampler
            idle_at = time.monotonic()
            final = await _until_idle(
                redis, deadline=idle_at + SETTLE_SECONDS, memory_below=baseline["used_memory"]
            )
            settle = time.monotonic() - idle_at

        print(
            f"\nFIGURES soak: {started} runs in {SOAK_SECONDS:g} s (retention 1 s); "
            f"baseline {_show(baseline)}; peak {_show(peak)}; "
            f"{settle:.1f} s after the load: {_show(final)}"
        )
        # The load made Redis grow, and the growth all went away again.
        assert peak["index"] > LIVE + 100 and peak["stream"] > 100
        # Even under load the index held the runs of the last seconds, not all of them.
        assert peak["index"] < 0.8 * started
        assert peak["used_memory"] > baseline["used_memory"] + 4 * MEMORY_SLACK
        assert final["index"] == baseline["index"] == LIVE
        # The live runs' first steps stay in the stream: no runner has read them.
        assert final["stream"] == baseline["stream"] == LIVE
        assert final["used_memory"] <= baseline["used_memory"] + MEMORY_SLACK
        # Live runs are never swept, whatever their age.
        assert [await redis.zscore(KEYS.runs(), r) is not None for r in live] == [True] * LIVE
        assert await redis.exists(*(KEYS.run(r) for r in live)) == LIVE
        assert "Traceback" not in listener.log()
    finally:
        await redis.aclose()
        listener.stop()


async def _load(http: httpx.AsyncClient, store: RunStore, *, seconds: float) -> int:
    """Start and end runs from SENDERS tasks for ``seconds``; returns how many."""
    counter = itertools.count()
    deadline = time.monotonic() + seconds

    async def sender() -> None:
        while time.monotonic() < deadline:
            n = next(counter)
            if n % 2:  # keyed, through the webhook: pointer, key runs, event marker
                reply = await http.post("/hooks/soak", json={"id": str(uuid.uuid4()), "n": n,
                                                             "note": NOTE})  # fmt: skip
                assert reply.status_code == 202, reply.text
                run_id = reply.json()["results"][0]["run_id"]
            else:  # keyless, through the store
                run_id = (await store.start_run("soak", {"n": n, "note": NOTE})).run_id
            ending = n % 6
            if ending in (0, 1, 2):
                await store.complete_step(run_id, "a")
                await store.complete_step(run_id, "b")
            elif ending in (3, 4):
                await store.fail_run(run_id, "soak")
            else:
                await store.cancel_run(run_id)

    await asyncio.gather(*(sender() for _ in range(SENDERS)))
    return next(counter) - SENDERS  # each sender drew one number past the deadline


async def _figures(redis: Redis) -> dict[str, int]:
    memory = await redis.info("memory")
    return {
        "used_memory": int(memory["used_memory"]),
        "index": await redis.zcard(KEYS.runs()),
        "stream": await redis.xlen(KEYS.stream()),
        "keys": await redis.dbsize(),
    }


async def _sample(redis: Redis, peak: dict[str, int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for name, value in (await _figures(redis)).items():
            peak[name] = max(peak[name], value)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)  # the sampling period, or the end


async def _until_idle(
    redis: Redis, *, deadline: float, memory_below: int | None = None
) -> dict[str, int]:
    """Poll until only the live runs are left: the index and the stream hold them alone
    (their steps, unread), no key waits for its expiry, and (when given) memory is back."""
    while True:
        figures = await _figures(redis)
        expiring = (await redis.info("keyspace")).get("db0", {}).get("expires", 0)
        done = figures["index"] == LIVE and figures["stream"] == LIVE and expiring == 0
        if done and (memory_below is None or figures["used_memory"] <= memory_below + MEMORY_SLACK):
            return figures
        assert time.monotonic() < deadline, f"not back to the baseline in time: {figures}"
        await asyncio.sleep(0.1)


def _show(figures: dict[str, int]) -> str:
    return (
        f"used_memory {figures['used_memory'] / 1024:,.0f} KiB, index {figures['index']:,}, "
        f"stream {figures['stream']:,}, keys {figures['keys']:,}"
    )
