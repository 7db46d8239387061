"""The delivery log when Redis misbehaves (gateway/deliveries/writing.py): a connection
that stops answering costs one flush, not the log; a flush that failed part-way
writes each record once after its retry; and an outage is said in two lines per
worker (when it starts failing, when it recovers, with counts), not one per flush.
Real servers, a real TCP proxy (tests/tcp_proxy.py) and real `realm listen` processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis as redis_sync
from redis.asyncio import Redis
from redis.client import NEVER_DECODE

from gateway.deliveries.log import DeliveryRecorder, LogKeys
from gateway.deliveries.records import unpack_record
from gateway.link.connection import redis_client
from gateway.store.runstore import RunStore
from gateway.store.scripts import script_source
from tests.deliveries_scaffold import CONFIG, ENV, deliver, load, logged, plain, push, signed
from tests.listener import Listener, spool_off
from tests.servers import RedisServer
from tests.tcp_proxy import TcpProxy

RECORD_SHA = hashlib.sha1(script_source("record_deliveries").encode()).hexdigest().encode()


def wait_until(check: Callable[[], bool], what: str, listener: Listener, seconds: float = 20):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what}; the listener said:\n{listener.log()[-3000:]}"
        time.sleep(0.02)


def event_ids(db: redis_sync.Redis) -> list[str]:
    """The event id of every delivery the log holds (one per record)."""
    keys = LogKeys("realm")
    ids = db.zrange(keys.index, 0, -1) + db.zrange(keys.refused, 0, -1)
    found = []
    for delivery_id in ids:
        stored = db.execute_command("GET", keys.record(delivery_id), **{NEVER_DECODE: True})
        doc = json.loads(unpack_record(stored)[0])
        found += [t["event_id"] for t in doc["triggers"]]
    return sorted(found)


def log_lines(listener: Listener) -> list[dict]:
    """The delivery log's own lines in the listener's stderr (not the per-delivery ones)."""
    return [
        json.loads(line)
        for line in listener.log().splitlines()
        if line.startswith('{"event":"delivery_log"')
    ]


Served = tuple[RedisServer, redis_sync.Redis]


@pytest.fixture
def sync_db(start_redis: Callable[..., RedisServer]) -> Iterator[Served]:
    """A server of the test's own, and a client of it straight (never through a proxy)."""
    server = start_redis()
    client = redis_sync.Redis(port=server.port, decode_responses=True, socket_timeout=5)
    yield server, client
    client.close()


@pytest.mark.slow
def test_a_connection_that_stops_answering_costs_one_flush_and_no_record_twice(
    sync_db: Served, tmp_path: Path
) -> None:
    server, db = sync_db
    proxy = TcpProxy(server.port).start()
    listener = Listener(tmp_path, CONFIG, redis_url=proxy.url, env=ENV)
    try:
        listener.start()
        assert plain(listener.base_url, "e-1").status_code == 202
        wait_until(lambda: logged(db) == 1, "the first delivery was not logged", listener)

        # The next write of the log reaches Redis, which runs it; its reply never comes
        # back and the connection stays open and silent.
        proxy.drop_next_reply(b"EVALSHA", sha=RECORD_SHA, stall=True)
        assert plain(listener.base_url, "e-2").status_code == 202
        wait_until(lambda: len(proxy.dropped) == 1, "the write never stalled", listener)
        for n in range(3, 7):  # answered while that flush waits
            assert plain(listener.base_url, f"e-{n}").status_code == 202

        # The stalled flush ends at its deadline; the next writes them all, e-2 again
        # under its own id: once each.
        wait_until(lambda: logged(db) >= 6, "the log stopped after the stall", listener)
        assert event_ids(db) == [f"e-{n}" for n in range(1, 7)]
        assert "Traceback" not in listener.log()
    finally:
        listener.stop()
        proxy.stop()


async def test_a_flush_that_failed_part_way_writes_each_record_once(
    sync_db: Served, redis: Redis
) -> None:
    """40 records go in two script calls. Redis takes the first and answers; it runs
    the second too, but that reply never comes (the connection goes silent): the flush
    ends at its deadline with 8 records unacknowledged, and the next flush sends them
    again, each under the id it was given when buffered."""
    server, db = sync_db
    proxy = TcpProxy(server.port).start()
    client = redis_client(proxy.url, 1.0)
    try:
        store = RunStore(client, load(), timeout=1.0)
        body = push()
        first = await deliver(RunStore(redis, load(), timeout=5.0), body, signed(body))
        items = [dataclasses.replace(first) for _ in range(40)]
        recorder = DeliveryRecorder(store, store.config.settings)
        for item in items:
            recorder.add(item)
        given = [r.id.decode() for r in recorder._buffer]  # each record's id, fixed when buffered
        await store.load_scripts()  # no NOSCRIPT round to count among the EVALSHAs
        proxy.drop_next_reply(b"EVALSHA", sha=RECORD_SHA, stall=True, after=1)
        async with asyncio.timeout(10):  # a flush without a deadline would wait for ever
            await recorder.flush()
        assert (len(proxy.dropped), len(recorder._buffer)) == (1, 8)
        assert [r.id.decode() for r in recorder._buffer] == given[32:]
        async with asyncio.timeout(10):
            await recorder.flush()
        assert recorder._buffer == []
    finally:
        await client.aclose()
        proxy.stop()
    stored = db.zrange(LogKeys("realm").index, 0, -1)
    assert len(stored) == 40, "a record sent again was logged twice"
    assert set(stored) == set(given)  # the ids given when buffered


@pytest.mark.slow
def test_an_outage_is_one_line_when_it_starts_and_one_when_it_ends(
    sync_db: Served, tmp_path: Path
) -> None:
    server, _ = sync_db
    listener = Listener(tmp_path, spool_off(CONFIG), redis_url=server.url, env=ENV).start()
    try:
        server.stop()
        # A second and a half of outage: every delivery answered 503 and recorded,
        # while each worker's flush fails every 100 ms.
        sent = 0
        began = time.monotonic()
        while time.monotonic() - began < 1.5:
            reply = plain(listener.base_url, f"down-{sent}")
            assert reply.status_code == 503, reply.text
            sent += 1
        wait_until(lambda: len(log_lines(listener)) >= 1, "no line said it failed", listener)
        server.start()
        db = redis_sync.Redis(port=server.port, decode_responses=True, socket_timeout=5)
        wait_until(lambda: len(log_lines(listener)) >= 2, "no line said it recovered", listener)
        wait_until(lambda: logged(db) == sent, "the buffered records were not written", listener)
        db.close()
    finally:
        listener.stop()
    lines = log_lines(listener)
    assert len(lines) == 2, lines  # not one per failed flush
    failing, recovered = lines
    assert {k: failing[k] for k in ("level", "state", "error")} == {
        "level": "warning",
        "state": "failing",
        "error": "StoreUnavailable",
    }
    assert 1 <= failing["buffered"] <= sent
    assert {k: recovered[k] for k in ("level", "state", "written", "dropped")} == {
        "level": "info",
        "state": "recovered",
        "written": sent,
        "dropped": 0,
    }
    assert recovered["seconds"] >= 1.0
