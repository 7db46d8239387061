"""The spool end to end (gateway/spool/, gateway/ingest/drain.py): a real `realm listen`
keeps the verified deliveries Redis cannot take, answers them 202 ``accepted``, and
claims them once Redis answers, exactly once per event.

The senders here never retry: each delivery is one HTTP request whose answer is
recorded (``Sender`` with a deadline already past makes one attempt), so every
reply a sender got is asserted, and a 503 cannot hide behind a successful retry.
What Redis holds is judged as the failover tests judge it (tests/exactly_once.py).

1. Redis killed for 10 s under a steady load and restarted on its port with its AOF
   (2 workers), or frozen for 10 s (1 worker): every delivery 2xx, one run per event once
   drained, each ``accepted`` delivery's log record showing its drained outcome.
2. A cluster failover with ``durability: {replicas: 1}``: the same.
3. The listener SIGKILLed mid-drain; a new one adopts its spool and drains it: one
   run per event, nothing left in the spool's folder.
4. Never spooled: an unverified delivery (401), ``spool: false`` (503), a full spool
   (503, its files never past ``max_bytes``); what /readyz says meanwhile.
5. A drained adopted folder is removed, and a spooled delivery keeps the headers its
   triggers read (none that authenticates it).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.store.keys import Keys
from tests.cluster import Cluster
from tests.exactly_once import (
    CONFIG,
    DEPLOY,
    ENV,
    GITHUB_SECRET,
    admin,
    assert_exactly_once,
    figures,
    judge,
    make_events,
    metric,
    polled,
    reached,
    read_store,
    wait_for_workers,
)
from tests.listener import Listener, spool_off
from tests.senders import Delivery, Outcome, Sender, Tally, client_for
from tests.servers import RedisServer
from tests.signing import github_headers
from tests.test_failover import revive

TOKEN = "spool-faults-token-93b1d7e2"
LISTEN_ENV = {**ENV, "REALM_API_TOKEN": TOKEN}
# Sender.deliver starts no retry past its deadline: one already past means one attempt.
SENT_ONCE = 0.0
# Enough that the load goes on while some wait out settings.redis_timeout.
SENDERS = 32
OUTAGE_S = 10.0
ALONE_S = 3.0  # a promoted primary without a replica, before the killed node is back
# Redis fsyncs each write to its AOF before it answers: a SIGKILL loses nothing it
# answered, so what the restarted server holds is exactly what was claimed.
AOF = ("--appendfsync", "always")

ACCEPTED_MESSAGE = (
    "The delivery is kept in this gateway's spool and its runs start once Redis answers: "
    "no run id yet; the delivery log shows the outcome under this delivery_id"
)


def with_settings(settings: str) -> str:
    return f"{CONFIG}settings:\n{settings}"  # (CONFIG has no settings of its own)


def spool_dir(listener: Listener) -> Path:
    """The spool's folder of a listener started without --data-dir: `.realm` in its cwd."""
    return listener.workdir / ".realm" / "spool"


def segment_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*/*.seg"))


def runs(url: str) -> int:
    with admin(url) as db:
        return int(db.zcard(DEPLOY.runs()))


def sigkill(listener: Listener) -> None:
    """Kill a listener of one worker (its process is the worker) with SIGKILL."""
    if listener.process is not None:
        listener.process.kill()
        listener.process.wait()
        listener.process = None


def with_repeats(events: Sequence[Delivery], every: int, later: int) -> list[Delivery]:
    """Each event once, in order, and every ``every``-th again ``later`` deliveries
    after its first: a redelivery (same id, same body) sent as a request of its own."""
    first = [(float(i), e) for i, e in enumerate(events)]
    again = [(i + later + 0.5, e) for i, e in enumerate(events) if i % every == 0]
    return [e for _, e in sorted(first + again, key=lambda pair: pair[0])]


async def send_paced(
    base_url: str, deliveries: Sequence[Delivery], *, rate: float, tally: Tally
) -> list[Outcome]:
    """Send each delivery once, delivery i at ``i / rate`` s from now (a steady load,
    whatever the replies), by SENDERS senders of one keep-alive connection each."""
    start = time.monotonic()
    outcomes: list[Outcome | None] = [None] * len(deliveries)
    queue = iter(range(len(deliveries)))

    async def sender() -> None:
        async with client_for(base_url, 1) as client:
            one = Sender(client, deadline=SENT_ONCE, tally=tally)
            for i in queue:
                await asyncio.sleep(max(start + i / rate - time.monotonic(), 0.0))
                outcomes[i] = await one.deliver(deliveries[i])

    await asyncio.gather(*(sender() for _ in range(SENDERS)))
    assert all(o is not None for o in outcomes)
    return outcomes  # type: ignore[return-value]


def kinds(outcomes: Sequence[Outcome]) -> Counter[str]:
    """Each delivery's one reply, by kind; anything but a 2xx of the three kinds is
    named with its status and code (the assertion then shows it)."""
    seen: Counter[str] = Counter()
    for o in outcomes:
        assert len(o.attempts) == 1, "a sender retried"
        a = o.attempts[0]
        if a.status == 202 and a.outcome == "started":
            seen["started"] += 1
        elif a.status == 200 and a.outcome == "deduplicated":
            seen["deduplicated"] += 1
        elif a.status == 202 and a.reply.get("outcome") == "accepted":
            assert a.outcome == "accepted" and a.run_id is None, a.reply
            assert a.reply["message"].endswith(ACCEPTED_MESSAGE), a.reply
            seen["accepted"] += 1
        else:
            seen[f"{a.status} {a.code or a.error}"] += 1
    return seen


def accepted(outcomes: Sequence[Outcome]) -> dict[str, Delivery]:
    """The delivery of each ``accepted`` reply, by the delivery id it was given."""
    return {
        o.attempts[0].reply["delivery_id"]: o.delivery
        for o in outcomes
        if o.attempts[0].status == 202 and o.attempts[0].reply.get("outcome") == "accepted"
    }


def drained(listener: Listener, url: str, events: int) -> Callable[[], bool]:
    """Nothing left in the spool, and a run for each of ``events`` events."""

    return lambda: metric(listener, "realm_spool_records") == 0 and runs(url) == events


async def drained_outcomes(listener: Listener, ids: Sequence[str]) -> dict[str, dict]:
    """Each delivery id's record in the delivery log once it is no longer ``accepted``."""
    records: dict[str, dict] = {}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=listener.base_url, headers=headers) as api:
        deadline = time.monotonic() + 30
        while len(records) < len(ids):
            for delivery_id in [i for i in ids if i not in records]:
                reply = await api.get(f"/v1/deliveries/{delivery_id}")
                # 404 until the recorder's first flush, then accepted until the drain's
                if reply.status_code == 200 and any(
                    t["outcome"] != "accepted" for t in reply.json()["triggers"]
                ):
                    records[delivery_id] = reply.json()
            if time.monotonic() > deadline:
                missing = [i for i in ids if i not in records][:5]
                raise AssertionError(f"the delivery log still says accepted for {missing}")
            await asyncio.sleep(0.1)
    return records


def check_log(
    records: dict[str, dict], by_id: dict[str, Delivery], outcomes: Sequence[Outcome], url: str
) -> int:
    """Each accepted delivery's record shows its drained outcome under its id, with the
    run stored for its event; across live replies and drained records no event was
    started twice. Returns how many events nobody was told were started: those whose
    claim ran but whose answer never came (Redis killed or paused with the claim sent),
    each then accepted, and deduplicated when drained."""
    events = sorted({o.delivery.event_id for o in outcomes})
    stored = read_store(url, events).runs_by_event
    started = Counter(o.delivery.event_id for o in outcomes if o.attempts[0].outcome == "started")
    for delivery_id, record in records.items():
        event_id = by_id[delivery_id].event_id
        [trigger] = record["triggers"]
        assert record["delivery_id"] == delivery_id
        outcome = (record["status"], trigger["outcome"])
        assert outcome in {(202, "started"), (200, "deduplicated")}, record
        assert trigger["event_id"] == event_id and trigger["verified"] is True, record
        assert [trigger["run_id"]] == stored[event_id], record
        started[event_id] += trigger["outcome"] == "started"
    assert max(started.values()) == 1, started.most_common(3)
    unseen = [e for e in events if not started[e]]
    spooled = {d.event_id for d in by_id.values()}
    assert set(unseen) <= spooled, unseen
    return len(unseen)


# --------------------------------------------------------------------------- 1. Redis down


@pytest.mark.slow
@pytest.mark.faults
# Two workers for the kill (each keeps and drains its own spool); one for the freeze.
# (One worker killed is the case test_listener_killed_mid_drain_and_its_spool_adopted
# and tests/test_deploy.py already run.)
@pytest.mark.parametrize(("workers", "fault"), [(2, "kill"), (1, "pause")], ids=["w2", "w1-paused"])
async def test_redis_down_for_10s_under_load(
    tmp_path: Path, start_redis: Callable[..., RedisServer], workers: int, fault: str
) -> None:
    """``kill``: SIGKILL, then a new server on the same port and folder (its AOF has
    every claim it answered). ``pause``: SIGSTOP, then SIGCONT: each claim meanwhile
    waits settings.redis_timeout (2 s) and is spooled, and the claims it had sent run
    once Redis resumes, so the drain finds some of its records already claimed."""
    redis = start_redis(*AOF, appendonly=True)
    events = make_events(900, seed=51)
    deliveries = with_repeats(events, every=5, later=150)  # 1 080 requests, 18 s at 60/s
    tally = Tally()
    listener = Listener(tmp_path, CONFIG, redis_url=redis.url, env=LISTEN_ENV, workers=workers)
    try:
        listener.start()
        if workers > 1:
            wait_for_workers(listener, workers)
        async with asyncio.timeout(120), httpx.AsyncClient(base_url=listener.base_url) as probe:
            load = asyncio.create_task(
                send_paced(listener.base_url, deliveries, rate=60, tally=tally)
            )
            await reached(tally.acked_at_least(240), load, timeout=30)
            redis.kill() if fault == "kill" else redis.pause()
            outage_ends = time.monotonic() + OUTAGE_S
            while time.monotonic() < outage_ends:  # the fault's length, not a wait for it
                await asyncio.sleep(0.1)
            readyz = await probe.get("/readyz", timeout=10)
            redis.start() if fault == "kill" else redis.resume()
            back = time.monotonic()
            outcomes = await load
            await polled(drained(listener, redis.url, len(events)), "the drain", timeout=40)
            drain_s = time.monotonic() - back
            by_id = accepted(outcomes)
            records = await drained_outcomes(listener, list(by_id))
        seen = kinds(outcomes)
        unseen = check_log(records, by_id, outcomes, redis.url)
        figures(f"spool-redis-{fault} workers={workers}", **seen, started_unseen=unseen,
                drained_after_s=drain_s)  # fmt: skip
        assert set(seen) <= {"started", "deduplicated", "accepted"}, seen
        assert sum(seen.values()) == len(deliveries)
        # 10 s of a 60/s load: about 600 deliveries spooled, or with Redis paused, as
        # many as 32 senders waiting 2 s each could send (about 160).
        assert seen["accepted"] >= (300 if fault == "kill" else 100), seen
        assert seen["started"] >= 200, seen
        assert readyz.status_code == 200, readyz.text
        assert readyz.json()["store"] == "unavailable" and readyz.json()["spool"] == "accepting"
        assert_exactly_once(judge(redis.url, events, outcomes))
        # Killed, only the claims in flight then (one a sender) can have run unanswered.
        assert unseen <= (SENDERS if fault == "kill" else seen["accepted"]), unseen
        assert metric(listener, "realm_spool_appended_total") == seen["accepted"]
        assert metric(listener, "realm_spool_drained_total") == seen["accepted"]
        assert metric(listener, "realm_spool_dropped_total", labelled=True) == 0
        assert metric(listener, "realm_spool_full_total") == 0
    finally:
        listener.stop()
    # Stopped with nothing pending: each worker's folder went with it.
    assert sorted(p.name for p in spool_dir(listener).iterdir()) == ["size.lock"]


# --------------------------------------------------------------------------- 2. failover


@pytest.mark.slow
@pytest.mark.faults
async def test_cluster_failover_with_durability(
    tmp_path: Path, cluster: Cluster, cluster_db: object
) -> None:
    """A primary killed under load: claims to it fail, then its promoted replica has
    no replica of its own, and ``durability: {replicas: 1}`` refuses every claim
    until the killed node is back as that replica (ALONE_S after the promotion, as a
    supervisor restarts it). All of it is spooled."""
    events = make_events(900, seed=52)
    deliveries = with_repeats(events, every=5, later=150)
    tally = Tally()
    primary = cluster.primary_for_key(DEPLOY.runs())
    [replica] = cluster.replicas_of(primary)
    config = with_settings("  durability: {replicas: 1}\n")
    listener = Listener(tmp_path, config, redis_url=cluster.seeds_url, env=LISTEN_ENV)
    url = f"redis://127.0.0.1:{replica.port}/0"  # the workflow's primary, once promoted
    try:
        listener.start()
        async with asyncio.timeout(150):
            load = asyncio.create_task(
                send_paced(listener.base_url, deliveries, rate=60, tally=tally)
            )
            await reached(tally.acked_at_least(240), load, timeout=30)
            cluster.kill(primary)
            killed = time.monotonic()
            promoted = await asyncio.to_thread(cluster.wait_promoted, primary)
            promoted_s = time.monotonic() - killed
            alone_until = time.monotonic() + ALONE_S
            while time.monotonic() < alone_until:  # the fault's length, not a wait for it
                await asyncio.sleep(0.1)
            await revive(cluster, primary)
            outcomes = await load
            await polled(drained(listener, url, len(events)), "the drain", timeout=60)
    finally:
        listener.stop()
    assert promoted is replica
    seen = kinds(outcomes)
    assert set(seen) <= {"started", "deduplicated", "accepted"}, seen
    why = Counter(
        "durability" if o.attempts[0].reply["message"].startswith("not confirmed on 1 replica")
        else "primary_down" for o in outcomes if o.attempts[0].reply.get("outcome") == "accepted"
    )  # fmt: skip
    figures("spool-cluster-failover durable=yes", **seen, **why, promoted_after_s=promoted_s)
    # Both: claims sent to the killed primary, and claims the promoted one could not
    # confirm on a replica (it had none until the killed node came back as one).
    assert why["primary_down"] > 0 and why["durability"] > 0, why
    assert_exactly_once(judge(url, events, outcomes))


# --------------------------------------------------------------------------- 3. gateway killed


@pytest.mark.slow
@pytest.mark.faults
async def test_listener_killed_mid_drain_and_its_spool_adopted(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    redis = start_redis(*AOF, appendonly=True)
    # 310 records at 40 a second: 7.75 s of drain. The second listener is left about
    # 250, not a whole number of one-second drain windows: when it is, the adopted
    # folder outlives its drain (test_an_adopted_folder_is_removed_once_drained).
    events = make_events(310, seed=53)
    config = with_settings("  spool: {drain_rate: 40}\n")
    first = Listener(tmp_path, config, redis_url=redis.url, env=LISTEN_ENV)
    second = Listener(tmp_path, config, redis_url=redis.url, env=LISTEN_ENV)
    try:
        first.start()
        assert first.process is not None
        pid = first.process.pid  # one worker: the listener's process serves
        redis.kill()
        async with asyncio.timeout(90):
            outcomes = await send_paced(first.base_url, events, rate=1000, tally=Tally())
            assert kinds(outcomes) == {"accepted": len(events)}
            [folder] = [p for p in spool_dir(first).iterdir() if p.is_dir()]
            assert folder.name.startswith(f"w-{pid}-")
            redis.start()
            await polled(lambda: runs(redis.url) >= 60, "60 runs drained", timeout=30)
            sigkill(first)  # mid-drain
            at_kill = runs(redis.url)
            assert at_kill < len(events), "the drain ended before the kill"
            assert list(folder.glob("*.seg"))
            second.start()
            await polled(drained(second, redis.url, len(events)), "the adoptive drain", 40)
        # What the first had claimed but not yet moved past is claimed again, and
        # deduplicated: at most one record more than the runs it left.
        again = metric(second, "realm_spool_drained_total")
        figures("spool-listener-killed", spooled=len(events), runs_at_kill=at_kill,
                drained_by_the_next=again)  # fmt: skip
        assert len(events) - at_kill <= again <= len(events) - at_kill + 1
        assert metric(second, "realm_spool_appended_total") == 0
        assert not folder.exists()
        assert f'"state":"adopted","folder":"{folder.name}","records":' in second.log()
        assert_exactly_once(judge(redis.url, events, outcomes))
    finally:
        sigkill(first)
        second.stop()
    assert sorted(p.name for p in spool_dir(second).iterdir()) == ["size.lock"]


@pytest.mark.slow
@pytest.mark.faults
async def test_an_adopted_folder_is_removed_once_drained(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    """At 1 a second every drain window ends on time, never on an empty spool: the
    case test_listener_killed_mid_drain_and_its_spool_adopted steers clear of."""
    redis = start_redis()
    config = with_settings("  spool: {drain_rate: 1}\n")
    first = Listener(tmp_path, config, redis_url=redis.url, env=LISTEN_ENV)
    second = Listener(tmp_path, config, redis_url=redis.url, env=LISTEN_ENV)
    events = make_events(3, seed=56)
    try:
        first.start()
        redis.kill()
        async with asyncio.timeout(60):
            outcomes = await send_paced(first.base_url, events, rate=1000, tally=Tally())
            assert kinds(outcomes) == {"accepted": len(events)}
            [folder] = [p for p in spool_dir(first).iterdir() if p.is_dir()]
            sigkill(first)
            redis.start()
            second.start()
            await polled(drained(second, redis.url, len(events)), "the adoptive drain", 20)
            assert_exactly_once(judge(redis.url, events, outcomes))
            # Its records drained, the folder goes (within a tick of the drain's loop).
            await polled(lambda: not folder.exists(), "the drained folder to go", 5)
    finally:
        sigkill(first)
        second.stop()
    assert sorted(p.name for p in spool_dir(second).iterdir()) == ["size.lock"]


# --------------------------------------------------------------------------- 4. never spooled


def big_push(n: int, size: int) -> Delivery:
    """A signed push of about ``size`` bytes (a long commit message pads it)."""
    sha = hashlib.sha1(f"big-{n}".encode()).hexdigest()
    body = orjson.dumps({"ref": "refs/heads/main", "after": sha,
                         "repository": {"full_name": "octo-org/big"},
                         "head_commit": {"id": sha, "message": "x" * size}})  # fmt: skip
    event_id = f"big-{n}-{sha[:12]}"
    return Delivery(event_id, body, github_headers(body, GITHUB_SECRET, delivery=event_id))


def down(tmp_path: Path, start_redis: Callable[..., RedisServer], config: str,
         workers: int = 1) -> Listener:  # fmt: skip
    """A listener whose Redis was killed after it started."""
    redis = start_redis()
    listener = Listener(tmp_path, config, redis_url=redis.url, env=LISTEN_ENV, workers=workers)
    listener.start()
    if workers > 1:
        wait_for_workers(listener, workers)
    redis.kill()
    return listener


@pytest.mark.faults
def test_an_unverified_delivery_is_never_spooled(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    listener = down(tmp_path, start_redis, CONFIG)
    try:
        [event] = make_events(1, seed=54)
        forged = {**event.headers, "X-Hub-Signature-256": "sha256=" + "0" * 64}
        reply = httpx.post(f"{listener.base_url}{event.path}", content=event.body,
                           headers=forged, timeout=10)  # fmt: skip
        assert reply.status_code == 401, reply.text
        assert reply.json()["code"] == "AUTH_REQUIRED"
        assert reply.json()["message"].startswith("signature did not verify: ")
        assert segment_bytes(spool_dir(listener)) == 0
        assert metric(listener, "realm_spool_appended_total") == 0
        # The same delivery signed as GitHub signs it is kept: the 401 was the signature.
        reply = httpx.post(f"{listener.base_url}{event.path}", content=event.body,
                           headers=dict(event.headers), timeout=10)  # fmt: skip
        assert (reply.status_code, reply.json()["outcome"]) == (202, "accepted"), reply.text
        assert segment_bytes(spool_dir(listener)) > len(event.body)
    finally:
        listener.stop()


@pytest.mark.faults
def test_spool_false_answers_503_while_redis_is_down(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    listener = down(tmp_path, start_redis, spool_off(CONFIG))
    try:
        [event] = make_events(1, seed=55)
        reply = httpx.post(f"{listener.base_url}{event.path}", content=event.body,
                           headers=dict(event.headers), timeout=10)  # fmt: skip
        assert reply.status_code == 503, reply.text
        assert reply.json()["code"] == "STORE_UNAVAILABLE"
        assert reply.headers["Retry-After"] == "5"
        assert "spool" not in reply.json()["message"]
        assert httpx.get(f"{listener.base_url}/readyz", timeout=5).status_code == 503
        assert not spool_dir(listener).exists()
    finally:
        listener.stop()


@pytest.mark.faults
@pytest.mark.parametrize("workers", [1, 2])
async def test_a_full_spool_answers_503_and_never_passes_max_bytes(
    tmp_path: Path, start_redis: Callable[..., RedisServer], workers: int
) -> None:
    """1 MiB of spool, 100 KB deliveries: 10 fit (frames of about 100.6 KB), the 11th
    does not. With 2 workers, both share the one limit."""
    config = with_settings("  spool: {max_bytes: 1MiB}\n")
    listener = down(tmp_path, start_redis, config, workers)
    root = spool_dir(listener)
    ready: list[int] = []
    statuses: list[tuple[int, str]] = []

    async def send(client: httpx.AsyncClient, delivery: Delivery) -> None:
        reply = await client.post(delivery.path, content=delivery.body,
                                  headers=dict(delivery.headers))  # fmt: skip
        assert segment_bytes(root) <= 1024**2
        body = reply.json()
        statuses.append((reply.status_code, body.get("outcome") or body["code"]))
        if reply.status_code == 503:
            assert body["message"].endswith(" (the spool is full: the delivery was not kept)")
            assert reply.headers["Retry-After"] == "5"
        ready.append((await client.get("/readyz")).status_code)

    try:
        deliveries = [big_push(n, 100_000) for n in range(16)]
        async with httpx.AsyncClient(base_url=listener.base_url, timeout=10) as client:
            if workers == 1:  # one at a time: /readyz is exact after each
                for delivery in deliveries:
                    await send(client, delivery)
                assert ready == [200] * 9 + [503] * 7
            else:  # all at once, over both workers
                await asyncio.gather(*(send(client, d) for d in deliveries))
        assert Counter(statuses) == {(202, "accepted"): 10, (503, "STORE_UNAVAILABLE"): 6}
        assert 10 * 100_000 < segment_bytes(root) <= 1024**2
        assert metric(listener, "realm_spool_full_total") == 6
        assert metric(listener, "realm_spool_appended_total") == 10
        assert httpx.get(f"{listener.base_url}/readyz", timeout=5).status_code == 503
    finally:
        listener.stop()


# Twilio sends each webhook's id in I-Twilio-Idempotency-Token (its retries carry the
# same); its X-Twilio-Signature is none of the gateway's schemes: `verify: none`.
TWILIO_CONFIG = """\
version: 1
workflows:
  sms:
    steps: [reply]
triggers:
  twilio-sms:
    workflow: sms
    path: /hooks/twilio
    verify: {scheme: none}
    event_id: {header: I-Twilio-Idempotency-Token}
"""
SMS = Keys("realm", "sms")


@pytest.mark.faults
async def test_a_spooled_delivery_is_claimed_with_the_headers_its_trigger_reads(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    redis = start_redis("--appendfsync", "always", appendonly=True)  # the first run survives
    listener = Listener(tmp_path, TWILIO_CONFIG, redis_url=redis.url, env=LISTEN_ENV)

    def sms(n: int) -> tuple[str, httpx.Response]:
        token = f"1e0b2c7a-4f1d-4d8e-9a55-7b9f3c2e8d1{n}"
        body = f"MessageSid=SM0123456789abcdef0123456789abcde{n}&From=%2B15550100&Body=hi"
        headers = {"Content-Type": "application/x-www-form-urlencoded",
                   "I-Twilio-Idempotency-Token": token}  # fmt: skip
        return token, httpx.post(f"{listener.base_url}/hooks/twilio", content=body,
                                 headers=headers, timeout=10)  # fmt: skip

    try:
        listener.start()
        _, reply = sms(0)  # Redis up: the trigger reads its event id and starts a run
        assert (reply.status_code, reply.json()["results"][0]["outcome"]) == (202, "started")
        redis.kill()
        token, reply = sms(1)
        assert (reply.status_code, reply.json()["outcome"]) == (202, "accepted"), reply.text
        delivery_id = reply.json()["delivery_id"]
        redis.start()
        await polled(lambda: metric(listener, "realm_spool_drained_total") == 1, "the drain", 20)
        [record] = (await drained_outcomes(listener, [delivery_id])).values()
        assert record["triggers"][0]["outcome"] == "started", record["triggers"][0]
        assert record["triggers"][0]["event_id"] == token
        with admin(redis.url) as db:
            assert db.zcard(SMS.runs()) == 2
    finally:
        listener.stop()
