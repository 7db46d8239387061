"""Fault injection: `realm listen` (2 workers) under load while Redis fails.

Every test drives a real `realm listen --workers 2` process over loopback HTTP,
with senders that behave like GitHub or Stripe (tests/senders.py: retry any
non-2xx or connection error, small backoff, overall deadline), against
redis-server processes the test starts itself. Faults: duplicate bursts,
`kill -9` with AOF, SIGSTOP, a lost script cache, a reply lost on the wire
(tests/tcp_proxy.py), a server at `maxmemory`, SIGTERM to the listener.

What is checked is the first promise: one piece of work gets one run (exactly one run
and one stream entry per event), nothing acknowledged is lost (every 2xx names
a run that is stored), and the gateway says 503 when it cannot be sure. The load,
the listener and that verdict are tests/exactly_once.py's.

Each test prints one line `FIGURES <name>: k=v ...` with what it measured
(see with `pytest -s`); docs/reliability.md quotes them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.store.scripts import script_source
from tests.exactly_once import (
    CONFIG,
    SENDERS,
    admin,
    assert_exactly_once,
    connections_per_worker,
    count,
    figures,
    first_2xx_after,
    judge,
    listening,
    loaded,
    make_events,
    polled,
    reached,
    read_store,
    redelivered,
)
from tests.listener import spool_off
from tests.senders import Outcome, Tally, client_for, send_all, warm_up
from tests.servers import RedisServer
from tests.tcp_proxy import TcpProxy

TIMEOUT_503 = 3.5  # settings.redis_timeout (2 s) plus scheduling slack

# --------------------------------------------------------------------------- helpers


def error_count(url: str, code: str) -> int:
    """How many error replies of ``code`` the server sent (INFO errorstats)."""
    with admin(url) as db:
        stat = db.info("errorstats").get(f"errorstat_{code}", {})
    return int(stat.get("count", 0)) if isinstance(stat, dict) else 0


# --------------------------------------------------------------------------- 1. duplicates


@pytest.mark.faults
async def test_concurrent_duplicates_make_one_run(tmp_path: Path, start_redis) -> None:
    server = start_redis()
    [event] = make_events(1, seed=1)
    n = 200
    async with asyncio.timeout(60):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener:
            async with client_for(listener.base_url, n) as client:
                await warm_up(client, n)  # 200 open connections, spread over both workers
                spread = connections_per_worker(listener)
                replies = await asyncio.gather(
                    *(
                        client.post(event.path, content=event.body, headers=dict(event.headers))
                        for _ in range(n)
                    )
                )
    statuses = Counter(r.status_code for r in replies)
    results = [r.json()["results"][0] for r in replies]
    run_ids = {r["run_id"] for r in results}
    outcomes = Counter(r["outcome"] for r in results)
    stored = read_store(server.url, [event.event_id])
    figures(
        "concurrent-duplicates",
        deliveries=n,
        runs=len(stored.runs),
        stream=sum(stored.stream.values()),
        started=outcomes["started"],
        deduplicated=outcomes["deduplicated"],
        distinct_run_ids=len(run_ids),
        connections_per_worker="/".join(map(str, spread)),
        non2xx=sum(c for s, c in statuses.items() if not 200 <= s < 300),
    )
    assert len(spread) == 2 and sum(spread) == n  # both workers took part in the race
    assert statuses == {202: 1, 200: n - 1}
    assert outcomes == {"started": 1, "deduplicated": n - 1}
    assert len(run_ids) == 1
    assert stored.runs == list(run_ids)
    assert stored.stream == Counter({stored.runs[0]: 1})
    assert stored.pointer == {event.event_id: stored.runs[0]}


# --------------------------------------------------------------------------- 2. redeliveries


@pytest.mark.slow
@pytest.mark.faults
async def test_mixed_redeliveries_one_run_per_event(tmp_path: Path, start_redis) -> None:
    server = start_redis()
    events = make_events(5000, seed=2)
    deliveries = redelivered(events, 3, seed=2)
    async with asyncio.timeout(150):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener:
            t0 = time.monotonic()
            outcomes = await send_all(
                listener.base_url, deliveries, concurrency=SENDERS, seconds=120
            )
            elapsed = time.monotonic() - t0
    v = judge(server.url, events, outcomes)
    figures(
        "mixed-redeliveries",
        events=v.events,
        deliveries=v.deliveries,
        senders=SENDERS,
        runs=v.runs,
        stream=v.stream,
        started=v.started,
        events_without_run=v.events_without_run,
        events_with_several_runs=v.events_with_several_runs,
        non2xx=v.non2xx,
        seconds=elapsed,
        deliveries_per_s=v.deliveries / elapsed,
    )
    assert_exactly_once(v)
    assert v.started == v.events  # each run was announced (202) to exactly one delivery
    assert v.non2xx == 0, v.statuses


# --------------------------------------------------------------------------- 3. kill -9


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.parametrize("fsync", ["always", "everysec"])
async def test_redis_killed_mid_load_loses_nothing_acknowledged(
    tmp_path: Path, start_redis, fsync: str
) -> None:
    server: RedisServer = start_redis("--appendfsync", fsync, appendonly=True)
    events = make_events(2000, seed=3)
    deliveries = redelivered(events, 2, seed=3)
    outage = 2.0
    tally = Tally()
    async with asyncio.timeout(150):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener:
            pid = listener.process.pid if listener.process else None
            load = await loaded(listener, deliveries, tally, acked=1200, seconds=90)
            acked_at_kill = tally.acked
            server.kill()  # SIGKILL: nothing is flushed
            t_kill = time.monotonic()
            await asyncio.sleep(outage)  # the outage itself, not a synchronisation
            t_restart = time.monotonic()
            await asyncio.to_thread(server.start)  # same port, same data dir (AOF)
            t_back = time.monotonic()
            outcomes = await load
            assert listener.process is not None and listener.process.pid == pid
            assert listener.process.poll() is None  # it recovered without a restart
    attempts = [a for o in outcomes for a in o.attempts]
    during = [a for a in attempts if a.sent > t_kill and a.done < t_restart]
    v = judge(server.url, events, outcomes)
    recovery = first_2xx_after(attempts, t_restart)
    figures(
        f"redis-kill-9 appendfsync={fsync}",
        events=v.events,
        deliveries=v.deliveries,
        acked_at_kill=acked_at_kill,
        acked=v.acked,
        runs=v.runs,
        stream=v.stream,
        duplicates=v.duplicates,
        events_without_run=v.events_without_run,
        acked_lost=v.acked_lost,
        acked_other_run=v.acked_other_run,
        replies_503=count(v, "503"),
        conn_errors=count(v, "conn"),
        other_non2xx=v.non2xx - count(v, "503") - count(v, "conn"),
        outage_s=t_restart - t_kill,
        redis_start_s=t_back - t_restart,
        recovery_s=recovery if recovery is not None else -1.0,
    )
    assert not any(a.ok for a in during), "a 2xx while Redis was down"
    assert v.non2xx == count(v, "503"), v.statuses  # only retryable 503s reach a sender
    assert recovery is not None and recovery < 5.0
    assert v.runs_without_one_stream_entry == 0, v
    if fsync == "always":
        assert_exactly_once(v)
    # everysec: an acknowledged claim may be lost with the last second of AOF; the
    # figures above report how many were (it is not asserted). Redis write()s the AOF
    # before it replies in both modes and only the fsync is deferred, so a killed
    # process loses nothing the kernel already has; a lost machine would, and so may a
    # write Redis postpones while a slow disk is still busy with the last fsync.


# --------------------------------------------------------------------------- 4. SIGSTOP


@pytest.mark.slow
@pytest.mark.faults
async def test_redis_frozen_is_503_within_the_timeout_and_recovers(
    tmp_path: Path, start_redis
) -> None:
    server: RedisServer = start_redis()
    events = make_events(1500, seed=4)
    deliveries = redelivered(events, 2, seed=4)
    freeze = 10.0
    tally = Tally()
    async with asyncio.timeout(120):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener:
            pid = listener.process.pid if listener.process else None
            load = await loaded(listener, deliveries, tally, acked=500, seconds=80)
            server.pause()  # SIGSTOP
            t_pause = time.monotonic()
            try:
                await asyncio.sleep(freeze)  # the freeze itself
            finally:
                server.resume()  # SIGCONT
            t_resume = time.monotonic()
            outcomes = await load
            assert listener.process is not None and listener.process.pid == pid
            assert listener.process.poll() is None
    attempts = [a for o in outcomes for a in o.attempts]
    # Sent while Redis was frozen, early enough that the reply was due before SIGCONT.
    frozen = [a for a in attempts if t_pause < a.sent < t_resume - TIMEOUT_503]
    inside = [a for a in attempts if a.sent > t_pause and a.done < t_resume]
    v = judge(server.url, events, outcomes)
    after = [a for a in attempts if a.done >= t_resume]
    last_503 = max((a.done for a in after if a.status == 503), default=t_resume) - t_resume
    recovery = first_2xx_after(attempts, t_resume)
    figures(
        "redis-frozen-10s",
        events=v.events,
        deliveries=v.deliveries,
        replies_during_freeze=len(frozen),
        replies_503_during_freeze=sum(a.status == 503 for a in frozen),
        replies_2xx_during_freeze=sum(a.ok for a in inside),
        max_reply_s_during_freeze=max((a.seconds for a in frozen), default=0.0),
        runs=v.runs,
        duplicates=v.duplicates,
        events_without_run=v.events_without_run,
        replies_503=count(v, "503"),
        conn_errors=count(v, "conn"),
        recovery_s=recovery if recovery is not None else -1.0,
        last_503_after_sigcont_s=last_503,
    )
    assert frozen, "no delivery was answered during the freeze"
    assert all(a.status == 503 and a.code == "STORE_UNAVAILABLE" for a in frozen), Counter(
        (a.status, a.error) for a in frozen
    )
    assert all(a.retry_after for a in frozen)
    assert max(a.seconds for a in frozen) <= TIMEOUT_503
    assert not any(a.ok for a in inside), "a 2xx while Redis was frozen"
    assert v.non2xx == count(v, "503"), v.statuses  # no hang, no connection error
    assert recovery is not None and recovery < 5.0
    assert_exactly_once(v)


# --------------------------------------------------------------------------- 5. script cache


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.parametrize("how", ["script-flush", "restart"])
async def test_script_cache_lost_mid_load(tmp_path: Path, start_redis, how: str) -> None:
    server: RedisServer = start_redis(appendonly=True)  # a restart keeps the data
    events = make_events(2000, seed=5)
    deliveries = redelivered(events, 2, seed=5)
    tally = Tally()
    thresholds = (800, 1600, 2400) if how == "script-flush" else (1600,)
    async with asyncio.timeout(150):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener:
            load = await loaded(listener, deliveries, tally, acked=thresholds[0], seconds=90)
            for threshold in thresholds:
                await reached(tally.acked_at_least(threshold), load, timeout=60)
                if how == "script-flush":
                    with admin(server.url) as db:
                        db.script_flush()
                else:
                    # A restart: SIGTERM (the AOF is flushed), then start on the same port.
                    await asyncio.to_thread(server.stop)
                    t_restart = time.monotonic()
                    await asyncio.to_thread(server.start)
                    t_back = time.monotonic()
            noscript = error_count(server.url, "NOSCRIPT")
            outcomes = await load
            noscript = max(noscript, error_count(server.url, "NOSCRIPT"))
    v = judge(server.url, events, outcomes)
    extra = {}
    if how == "restart":
        attempts = [a for o in outcomes for a in o.attempts]
        recovery = first_2xx_after(attempts, t_restart)
        extra["redis_start_s"] = t_back - t_restart
        extra["recovery_s"] = recovery if recovery is not None else -1.0
    figures(
        f"script-cache-lost {how}",
        events=v.events,
        deliveries=v.deliveries,
        cache_losses=len(thresholds),
        noscript_replies=noscript,
        runs=v.runs,
        duplicates=v.duplicates,
        events_without_run=v.events_without_run,
        replies_503=count(v, "503"),
        other_non2xx=v.non2xx - count(v, "503"),
        **extra,
    )
    assert noscript > 0, "the script cache loss was never noticed: the fault did not bite"
    assert v.non2xx == count(v, "503"), v.statuses
    assert_exactly_once(v)


# --------------------------------------------------------------------------- 6. lost reply

# The claim's script: the listener's background sweep sends EVALSHAs of its own.
START_RUN_SHA = hashlib.sha1(script_source("start_run").encode()).hexdigest().encode()


@pytest.mark.faults
async def test_lost_claim_reply_is_retried_and_reports_the_callers_own_run(
    tmp_path: Path, start_redis
) -> None:
    server: RedisServer = start_redis()
    proxy = TcpProxy(server.port).start()
    events = make_events(10, seed=6)
    outcomes: list[Outcome] = []
    try:
        async with asyncio.timeout(60):
            with listening(tmp_path, proxy.url) as listener:
                for event in events:
                    proxy.drop_next_reply(b"EVALSHA", sha=START_RUN_SHA)
                    [outcome] = await send_all(
                        listener.base_url, [event], concurrency=1, seconds=20
                    )
                    outcomes.append(outcome)
                    assert not proxy.armed, "the claim never went through the proxy"
    finally:
        proxy.stop()
    v = judge(server.url, events, outcomes)
    dropped_ids = [d.script_argv[0].decode() for d in proxy.dropped]
    first = [o.attempts[0] for o in outcomes]
    figures(
        "lost-claim-reply",
        events=v.events,
        dropped_replies=len(proxy.dropped),
        replies_202_started=sum(a.status == 202 and a.outcome == "started" for a in first),
        replies_deduplicated=sum(a.outcome == "deduplicated" for a in first),
        sender_retries=v.attempts - v.deliveries,
        runs=v.runs,
        stream=v.stream,
        duplicates=v.duplicates,
    )
    assert len(proxy.dropped) == len(events)
    # The dropped EVALSHA committed: its run id (ARGV[1]) is the run in Redis, and
    # the gateway's retry of that same call found it and reported it as started.
    assert all(d.reply.startswith(b"*6\r\n$7\r\ncreated") for d in proxy.dropped)
    for outcome, dropped_id in zip(outcomes, dropped_ids, strict=True):
        [attempt] = outcome.attempts
        assert attempt.status == 202, attempt.reply
        assert attempt.outcome == "started", attempt.reply
        assert attempt.reply["results"][0]["deduped"] is False
        assert attempt.run_id == dropped_id
    assert_exactly_once(v)


# --------------------------------------------------------------------------- 7. maxmemory


@contextmanager
def out_of_memory(server: RedisServer) -> Iterator[int]:
    """Fill the server past a lowered ``maxmemory`` (noeviction); yield its DBSIZE."""
    with admin(server.url) as db:
        db.set("filler", "x" * (3 * 1024 * 1024))
        db.config_set("maxmemory", "2mb")
        info = db.info("memory")
        assert info["used_memory"] > info["maxmemory"] > 0, info
        yield db.dbsize()


@pytest.mark.faults
async def test_out_of_memory_start_writes_nothing_and_is_never_acknowledged(
    tmp_path: Path, start_redis
) -> None:
    server: RedisServer = start_redis("--maxmemory-policy", "noeviction")
    events = make_events(5, seed=7)
    refusals = 20
    async with asyncio.timeout(60):
        # The listener loads its scripts before the fill.
        with (
            listening(tmp_path, server.url, spool_off(CONFIG)) as listener,
            out_of_memory(server) as dbsize_before,
        ):
            load = asyncio.create_task(
                send_all(listener.base_url, events, concurrency=len(events), seconds=30)
            )
            await polled(lambda: error_count(server.url, "OOM") >= refusals, "OOM refusals")
            with admin(server.url) as db:
                dbsize_full = db.dbsize()
                # The workflows' layout record and the runners' group on each stream
                # (an empty stream), written by the listener at start (before the
                # fill), are no start's write.
                realm_keys = [
                    k for k in db.scan_iter("realm:*", count=1000)
                    if not k.endswith(":meta") and not (k.endswith(":stream") and not db.xlen(k))
                ]  # fmt: skip
                oom = error_count(server.url, "OOM")
                t_freed = time.monotonic()
                db.config_set("maxmemory", "0")  # memory is back: the senders' retries work
            outcomes = await load
    attempts = [a for o in outcomes for a in o.attempts]
    refused = [a for a in attempts if a.done < t_freed]
    v = judge(server.url, events, outcomes)
    recovery = first_2xx_after(attempts, t_freed)
    figures(
        "maxmemory-noeviction",
        deliveries=len(events),
        attempts_while_full=len(refused),
        oom_refusals=oom,
        statuses_while_full="/".join(
            f"{s}x{c}" for s, c in sorted(Counter(a.status for a in refused).items())
        ),
        replies_2xx_while_full=sum(a.ok for a in refused),
        realm_keys_while_full=len(realm_keys),
        dbsize_before=dbsize_before,
        dbsize_while_full=dbsize_full,
        runs_after_memory_freed=v.runs,
        recovery_s=recovery if recovery is not None else -1.0,
    )
    assert refused and not any(a.ok for a in refused), "acknowledged while Redis refused writes"
    assert all(a.status is not None and a.status >= 500 for a in refused)
    assert realm_keys == [] and dbsize_full == dbsize_before  # refused before any write
    assert_exactly_once(v)  # once memory is back, each event gets its one run


@pytest.mark.faults
async def test_out_of_memory_start_is_503_store_unavailable(tmp_path: Path, start_redis) -> None:
    server: RedisServer = start_redis("--maxmemory-policy", "noeviction")
    [event] = make_events(1, seed=7)
    async with asyncio.timeout(60):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener, out_of_memory(server):
            async with client_for(listener.base_url, 1) as client:
                reply = await client.post(
                    event.path, content=event.body, headers=dict(event.headers)
                )
    code = (
        reply.json().get("code")
        if reply.headers.get("content-type") == "application/json"
        else None
    )
    figures(
        "maxmemory-reply",
        status=reply.status_code,
        code=code,
        retry_after=reply.headers.get("retry-after"),
    )
    assert reply.status_code == 503, reply.text
    assert reply.json()["code"] == "STORE_UNAVAILABLE"
    assert reply.headers["retry-after"] == "5"


# --------------------------------------------------------------------------- 8. SIGTERM


@pytest.mark.slow
@pytest.mark.faults
async def test_sigterm_finishes_in_flight_deliveries_and_loses_nothing(
    tmp_path: Path, start_redis
) -> None:
    server: RedisServer = start_redis()
    events = make_events(3000, seed=8)
    tally = Tally()
    give_up = asyncio.Event()
    async with asyncio.timeout(120):
        with listening(tmp_path, server.url, spool_off(CONFIG)) as listener:
            load = await loaded(listener, events, tally, acked=600, seconds=60, give_up=give_up)
            in_flight = tally.in_flight
            listener.terminate()  # SIGTERM
            t_term = time.monotonic()
            code = await asyncio.to_thread(listener.wait, 40)
            t_exit = time.monotonic()
            give_up.set()  # nothing listens any more: the senders stop retrying
            outcomes = await load
    attempts = [a for o in outcomes for a in o.attempts]
    spanning = [a for a in attempts if a.sent < t_term < a.done]
    v = judge(server.url, events, outcomes)
    stored = read_store(server.url, [e.event_id for e in events])
    acked_events = {o.delivery.event_id for o in outcomes if o.acked is not None}
    claimed_unanswered = sum(
        e.event_id in stored.runs_by_event and e.event_id not in acked_events for e in events
    )
    figures(
        "sigterm-graceful",
        deliveries=v.deliveries,
        in_flight_at_sigterm=in_flight,
        in_flight_answered=sum(a.status is not None for a in spanning),
        in_flight_2xx=sum(a.ok for a in spanning),
        in_flight_no_reply=sum(a.status is None for a in spanning),
        acked=v.acked,
        runs=v.runs,
        acked_lost=v.acked_lost,
        claimed_unanswered=claimed_unanswered,
        duplicates=v.duplicates,
        shutdown_s=t_exit - t_term,
        exit_code=code,
    )
    assert code == 0
    assert v.acked_lost == 0 and v.acked_other_run == 0, v
    assert v.events_with_several_runs == 0 and v.runs_without_one_stream_entry == 0, v
    # Every delivery the gateway took in got its reply: no run without a 2xx.
    assert claimed_unanswered == 0
    assert v.runs == v.acked
