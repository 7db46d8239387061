"""8 OS processes start the same key at the same instant: exactly one run."""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing.synchronize import Barrier

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.store.keys import Keys
from gateway.store.runstore import RunStore
from tests.conftest import WORKFLOWS_YAML

PROCESSES = 8


def _start_after_barrier(url: str, barrier: Barrier, results: multiprocessing.Queue) -> None:
    async def main() -> None:
        client = redis_client(url, 10.0)
        store = RunStore(client, parse_config(WORKFLOWS_YAML, with_triggers=False))
        await client.ping()  # connected before the barrier: the race is the script call
        barrier.wait(timeout=30)
        result = await store.start_run("sync", {"n": 1}, "one-key")
        results.put((result.run_id, result.deduped))
        await client.aclose()

    asyncio.run(main())


async def test_8_processes_racing_one_key_make_one_run_and_one_stream_entry(redis, redis_server):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_start_after_barrier, args=(redis_server.url, barrier, results))
        for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    seen = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    assert len({run_id for run_id, _ in seen}) == 1, "every caller sees the same run id"
    assert sorted(deduped for _, deduped in seen) == [False] + [True] * (PROCESSES - 1)
    keys = Keys("realm", "sync")
    assert await redis.xlen(keys.stream()) == 1
    assert await redis.zcard(keys.runs()) == 1
