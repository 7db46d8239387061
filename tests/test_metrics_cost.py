"""What scrapes and probes cost Redis, counted by the server (INFO commandstats) of a
real `realm listen`: the step-stream gauges of /metrics are read at most once a second
and one read at a time per worker, however many scrapes come; /readyz checks the
scripts with one SCRIPT EXISTS instead of loading each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from gateway.store.scripts import SCRIPT_NAMES
from tests.listener import Listener
from tests.servers import RedisServer

WORKFLOWS, PARTITIONS = 5, 64
CONFIG = "version: 1\nworkflows:\n" + "".join(
    f"  wf{i}:\n    steps: [only]\n    partitions: {PARTITIONS}\n" for i in range(WORKFLOWS)
)
SCRIPTS = len(SCRIPT_NAMES)


@pytest.fixture
def served(
    start_redis: Callable[..., RedisServer], tmp_path: Path
) -> Iterator[tuple[Listener, redis_sync.Redis]]:
    """A listener of 5 workflows of 64 partitions on a server of the test's own, and a
    client of that server."""
    server = start_redis()
    listener = Listener(tmp_path, CONFIG, redis_url=server.url).start()
    client = redis_sync.Redis.from_url(server.url, socket_timeout=10)
    try:
        yield listener, client
    finally:
        client.close()
        listener.stop()


def calls(db: redis_sync.Redis, command: str) -> int:
    return int(db.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def partitions_read(db: redis_sync.Redis) -> int:
    """Partitions the gauges read: each read opens with XINFO GROUPS (XLEN for a stream
    no runner has read). The listener's sweep (gateway/store/lua/sweep.lua) asks
    XINFO GROUPS too, once per script call: those are set aside."""
    stats = {name: v.get("calls", 0) for name, v in db.info("commandstats").items()}
    sweeps = stats.get("cmdstat_evalsha", 0)
    return stats.get("cmdstat_xinfo|groups", 0) + stats.get("cmdstat_xlen", 0) - sweeps


def scrape(listener: Listener) -> str:
    reply = httpx.get(listener.base_url + "/metrics", timeout=30)
    assert reply.status_code == 200
    return reply.text


def queue_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("realm_steps_waiting{")]


@pytest.mark.slow
def test_twenty_concurrent_scrapes_read_the_streams_once(
    served: tuple[Listener, redis_sync.Redis],
):
    listener, db = served
    db.config_resetstat()

    async def scrapes() -> list[str]:
        async with httpx.AsyncClient(base_url=listener.base_url, timeout=30) as client:
            replies = await asyncio.gather(*(client.get("/metrics") for _ in range(20)))
        assert {reply.status_code for reply in replies} == {200}
        return [reply.text for reply in replies]

    texts = asyncio.run(scrapes())
    read = partitions_read(db)
    stream_commands = sum(calls(db, name) for name in ("exists", "xinfo|groups", "xlen",
                                                        "xpending", "xrange"))  # fmt: skip
    print(f"FIGURES metrics_20_scrapes: partitions_read={read} stream_commands={stream_commands}")
    # One read of the 320 partitions (two, should the scrapes straddle the second).
    assert read in (WORKFLOWS * PARTITIONS, 2 * WORKFLOWS * PARTITIONS)
    assert all(queue_lines(text) == queue_lines(texts[0]) for text in texts)
    assert len(queue_lines(texts[0])) == 2 * WORKFLOWS
    assert 'realm_queue_read_ok{workflow="wf4"} 1.0' in texts[0]


@pytest.mark.slow
def test_a_worker_reads_the_streams_at_most_once_a_second(
    served: tuple[Listener, redis_sync.Redis],
):
    listener, db = served
    one_read = WORKFLOWS * PARTITIONS
    scrape(listener)
    read_at = time.monotonic()
    first = partitions_read(db)
    assert first >= one_read
    scrape(listener)
    assert partitions_read(db) == first  # served from the last read
    deadline = read_at + 10
    while partitions_read(db) == first and time.monotonic() < deadline:
        scrape(listener)
        time.sleep(0.05)
    assert partitions_read(db) == first + one_read
    assert time.monotonic() - read_at >= 0.9  # not before the second was out


def test_readyz_checks_the_scripts_without_loading_them(
    served: tuple[Listener, redis_sync.Redis],
):
    listener, db = served
    db.config_resetstat()
    for _ in range(5):
        ready = httpx.get(listener.base_url + "/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
    assert calls(db, "script|exists") == 5
    assert calls(db, "script|load") == 0
    # A server that lost its scripts (restarted, flushed) gets the missing ones back.
    db.script_flush()
    assert httpx.get(listener.base_url + "/readyz", timeout=10).status_code == 200
    assert calls(db, "script|load") == SCRIPTS
    assert all(db.script_exists(*[s.sha for s in _scripts(db)]))


def _scripts(db: redis_sync.Redis) -> list[object]:
    from redis.asyncio import Redis

    from gateway.store.scripts import Scripts

    return list(Scripts(Redis()).all())
