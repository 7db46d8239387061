"""The runners' consumer group exists from the moment a workflow does, with a real
`realm listen` on a server of the test's own: the listener makes it on every stream as
it starts and when a reload brings a workflow, so a runner deployed long after
``stream_retention`` still finds every step no runner has read (the listener's sweep
deletes only the unread entries whose run no longer needs them)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
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

CONFIG = """\
version: 1
workflows:
  late:
    steps: [a]
    stream_retention: 1s
triggers:
  late-hook:
    workflow: late
    path: /hooks/late
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
"""
ADDED = """\
  added:
    steps: [a]
    partitions: 2
"""
LATE = Keys("realm", "late")


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _has_group(redis: Redis, stream: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        if not await redis.exists(stream):
            return False
        return [g["name"] for g in await redis.xinfo_groups(stream)] == [b"runners"]

    return check


async def test_a_runner_deployed_after_stream_retention_finds_every_step(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    server = start_redis()
    listener = Listener(tmp_path, CONFIG, redis_url=server.url).start()
    redis = redis_client(server.url, 5.0)
    store = RunStore(redis, parse_config(CONFIG, with_triggers=False), timeout=5.0)
    try:
        # Made as the listener starts, before any delivery: nothing read yet.
        await _until("the group on the stream", _has_group(redis, LATE.stream()))
        [group] = await redis.xinfo_groups(LATE.stream())
        assert group["last-delivered-id"] == b"0-0"

        async with httpx.AsyncClient(base_url=listener.base_url, timeout=10) as http:
            started = []
            for i in range(3):
                reply = await http.post("/hooks/late", json={"id": f"e{i}"})
                assert reply.status_code == 202, reply.text
                started.append(reply.json()["results"][0]["run_id"])
        # A run that ended before any runner came: its step is nobody's work.
        ended = (await store.start_run("late", {})).run_id
        await store.cancel_run(ended)
        ended_entry = await redis.hget(LATE.run(ended), "entry")

        # The listener's own sweep runs past stream_retention (1 s): it deleted the
        # ended run's entry, and left the others, which no runner has read.
        async def ended_entry_deleted() -> bool:
            return await redis.xrange(LATE.stream(), ended_entry, ended_entry) == []

        await _until("the sweep to delete the ended run's entry", ended_entry_deleted)
        stream = await redis.xrange(LATE.stream())
        assert [f[b"run_id"].decode() for _, f in stream] == started

        taken = await store.take_steps("late", "latecomer", count=10)
        assert sorted(t.run_id for t in taken) == sorted(started)
        assert "Traceback" not in listener.log()
    finally:
        await redis.aclose()
        listener.stop()


async def test_a_reload_makes_the_group_of_every_new_stream(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    server = start_redis()
    listener = Listener(tmp_path, CONFIG, redis_url=server.url).start()
    redis = redis_client(server.url, 5.0)
    try:
        await _until("the group on the stream", _has_group(redis, LATE.stream()))
        listener.config_path.write_text(CONFIG.replace("triggers:", ADDED + "triggers:"))
        assert listener.process is not None
        os.kill(listener.process.pid, signal.SIGHUP)

        # Each partition of the new workflow: its stream and group, before any start.
        for partition in range(2):
            stream = Keys("realm", "added", partition).stream()
            await _until(f"the group on {stream}", _has_group(redis, stream))
        assert "Traceback" not in listener.log()
    finally:
        await redis.aclose()
        listener.stop()
