"""A queue per key (``on_live_match: queue``): while the key's run is live, a start
creates a run in phase ``queued`` behind it, and the ending that frees its place starts
the next one, in arrival order, in the same script: by a runner's report, a runner's
failure, a lease that lapsed, a cancel. ``concurrency.limit`` lets several runs of one
key be live; ``queue.keep: newest`` keeps one waiting, the latest. Against real Redis
servers, and two real `realm listen` processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from gateway.ingest.dryrun import dry_run
from gateway.loading import parse_config
from gateway.model.errors import RealmError
from gateway.store.reconcile import reconcile
from gateway.store.runs import Flow
from gateway.store.runstore import RunStore
from gateway.store.sweep import sweep
from tests.listener import Listener
from tests.trigger_yaml import compiled, refusal

WF = "single"
# One attempt a step: a runner's failure ends the run (and starts the next).
WORKFLOWS = """
version: 1
workflows:
  single:
    steps: [only]
    max_attempts: 1
    lease: 1s
"""
TOKEN = "queue-test-api-token"
KEY = "acme/api"


@pytest.fixture
async def store(redis: Redis) -> RunStore:
    return RunStore(redis, parse_config(WORKFLOWS, file="q.yaml", with_triggers=False), timeout=5)


async def start(store: RunStore, n: int, flow: Flow | None = None, key: str = KEY):
    return await store.start_run(WF, {"n": n}, key, "queue", "rerun", flow=flow)


async def phases(store: RunStore, ids: list[str]) -> list[str]:
    return [(await store.get_run(i)).phase for i in ids]


async def running(store: RunStore, ids: list[str]) -> list[str]:
    return [i for i, phase in zip(ids, await phases(store, ids), strict=True) if phase == "running"]


async def test_a_start_behind_a_live_run_waits_and_starts_when_it_ends(store: RunStore) -> None:
    first = await start(store, 0)
    second = await start(store, 1)
    assert (first.phase, second.phase, second.deduped) == ("running", "queued", False)
    assert second.next_step is None and second.rerun_of is None
    waiting = await store.get_run(second.run_id)
    assert (waiting.phase, waiting.key, waiting.params) == ("queued", KEY, {"n": 1})
    # Nothing of the waiting run reaches the runners before its turn.
    assert [s.run_id for s in await store.take_steps(WF, "r1", count=10)] == [first.run_id]

    done = await store.complete_step(first.run_id, "only")
    assert done.phase == "completed"
    assert await phases(store, [first.run_id, second.run_id]) == ["completed", "running"]
    [taken] = await store.take_steps(WF, "r1", count=10)
    assert (taken.run_id, taken.params) == (second.run_id, {"n": 1})
    pointer = await store.redis.hgetall(store.keys(WF).pointer(KEY))
    assert pointer[b"run"].decode() == second.run_id and pointer[b"phase"] == b"running"
    # The key's run set names it, newest: reconcile would point the key at it.
    newest = await store.redis.zrange(store.keys(WF).key_runs(KEY), -1, -1)
    assert newest == [second.run_id.encode()]


async def test_twenty_concurrent_starts_give_one_run_and_nineteen_in_arrival_order(
    store: RunStore,
) -> None:
    """Each ending starts exactly the next one, whatever ends it: a runner's report, a
    runner's failure, an operator's cancel or fail, a lease that lapsed."""
    results = await asyncio.gather(*(start(store, n) for n in range(20)))
    live = [r for r in results if r.phase == "running"]
    queued = [r for r in results if r.phase == "queued"]
    assert (len(live), len(queued)) == (1, 19)
    # Arrival order: the order the claims ran in, which the run index keeps too.
    order = [m.decode() for m in await store.redis.zrange(store.keys(WF).runs(), 0, -1)]
    assert order[0] == live[0].run_id
    assert set(order[1:]) == {r.run_id for r in queued}

    async def end(run_id: str, how: int) -> None:
        if how == 0:
            [taken] = await store.take_steps(WF, "r1")
            assert taken.run_id == run_id
            await store.complete_step(run_id, "only", lease=taken.lease)
        elif how == 1:
            await store.cancel_run(run_id)
        elif how == 2:
            await store.fail_run(run_id, "operator says no")
        else:
            [taken] = await store.take_steps(WF, "r1")
            failed = await store.fail_step(run_id, "only", "boom", lease=taken.lease)
            assert failed.phase == "failed"

    for i, run_id in enumerate(order):
        assert await running(store, order) == [run_id], f"after {i} endings"
        await end(run_id, i % 4)
    assert await running(store, order) == []
    assert await store.redis.zcard(store.keys(WF).queue(KEY)) == 0
    assert await store.redis.zcard(store.keys(WF).queued()) == 0
    ended = await phases(store, order)
    assert ended == [["completed", "cancelled", "failed", "failed"][i % 4] for i in range(20)]
    assert await store.redis.pttl(store.keys(WF).pointer(KEY)) > 0  # idle: it expires


async def test_a_lapsed_lease_on_the_last_attempt_starts_the_next(store: RunStore) -> None:
    first = await start(store, 0)
    second = await start(store, 1)
    [taken] = await store.take_steps(WF, "r1", lease_ms=50)
    assert taken.run_id == first.run_id
    # The runner vanishes: a take after the workflow's lease (1 s, the horizon at
    # which runners look at pending steps again) finds it lapsed on the last attempt.
    steps = []
    for _ in range(300):
        steps = await store.take_steps(WF, "r2")
        if steps:
            break
        await asyncio.sleep(0.02)
    assert (await store.get_run(first.run_id)).phase == "failed"
    assert [s.run_id for s in steps] == [second.run_id]


async def test_concurrency_lets_a_key_run_several_at_once(store: RunStore) -> None:
    flow = Flow(limit=3)
    results = [await start(store, n, flow) for n in range(10)]
    assert [r.phase for r in results] == ["running"] * 3 + ["queued"] * 7
    ids = [r.run_id for r in results]
    await store.complete_step(ids[1], "only")
    assert await running(store, ids) == [ids[0], ids[2], ids[3]]
    await store.cancel_run(ids[0])
    assert await running(store, ids) == [ids[2], ids[3], ids[4]]
    # A start while three are live and six wait: it waits too, last.
    late = await start(store, 10, flow)
    assert late.phase == "queued"
    for run_id in ids[2:]:
        await store.cancel_run(run_id)
    assert await running(store, [*ids, late.run_id]) == [late.run_id]
    # An earlier run ends last: the key is idle, and its retention starts.
    await start(store, 11, flow)
    pointer, keyruns = store.keys(WF).pointer(KEY), store.keys(WF).key_runs(KEY)
    assert await store.redis.pttl(pointer) == -1
    await store.cancel_key(WF, KEY)
    assert await store.redis.hget(pointer, "live") == b""
    assert await store.redis.pttl(pointer) > 0 and await store.redis.pttl(keyruns) > 0


async def test_keep_newest_leaves_one_waiting_with_the_latest_params(store: RunStore) -> None:
    flow = Flow(keep="newest")
    first = await start(store, 0, flow)
    waiting = [await start(store, n, flow) for n in range(1, 6)]
    assert all(w.phase == "queued" for w in waiting)
    assert await store.redis.zrange(store.keys(WF).queue(KEY), 0, -1) == [
        waiting[-1].run_id.encode()
    ]
    for superseded in waiting[:-1]:
        run = await store.get_run(superseded.run_id)
        assert run.phase == "cancelled"
        assert run.error and "superseded by run" in run.error
    await store.complete_step(first.run_id, "only")
    run = await store.get_run(waiting[-1].run_id)
    assert (run.phase, run.params) == ("running", {"n": 5})


async def test_keep_newest_under_concurrent_starts_leaves_at_most_one_waiting(
    store: RunStore,
) -> None:
    flow = Flow(keep="newest")
    results = await asyncio.gather(*(start(store, n, flow) for n in range(30)))
    assert sum(r.phase == "running" for r in results) == 1
    assert await store.redis.zcard(store.keys(WF).queue(KEY)) == 1
    phases_now = await phases(store, [r.run_id for r in results])
    assert sorted(set(phases_now)) == ["cancelled", "queued", "running"]
    assert phases_now.count("queued") == 1


async def test_a_full_queue_refuses_the_start(store: RunStore) -> None:
    flow = Flow(queue_max=2)
    await start(store, 0, flow)
    await start(store, 1, flow)
    await start(store, 2, flow)
    with pytest.raises(RealmError) as full:
        await start(store, 3, flow)
    assert full.value.code == "STATE_QUEUE_FULL"
    assert full.value.message == (
        "Queue full for workflow 'single': 2 runs already wait behind the live runs of "
        "this idempotency key; nothing was queued."
    )
    assert await store.redis.zcard(store.keys(WF).runs()) == 3


async def test_cancelling_a_queued_run_takes_it_out_of_the_queue(store: RunStore) -> None:
    first = await start(store, 0)
    second = await start(store, 1)
    third = await start(store, 2)
    assert await store.cancel_run(second.run_id) == 1
    assert (await store.get_run(second.run_id)).phase == "cancelled"
    assert await store.cancel_run(second.run_id) == 0
    await store.complete_step(first.run_id, "only")
    assert await phases(store, [second.run_id, third.run_id]) == ["cancelled", "running"]


async def test_cancelling_the_key_cancels_its_queue(store: RunStore) -> None:
    flow = Flow(limit=2)
    ids = [(await start(store, n, flow)).run_id for n in range(5)]
    assert await store.cancel_key(WF, KEY) == 5
    assert await phases(store, ids) == ["cancelled"] * 5
    assert await store.redis.zcard(store.keys(WF).queued()) == 0
    # Nothing of the key is left live: a new start runs at once.
    again = await start(store, 9, flow)
    assert again.phase == "running" and again.rerun_of in ids
    assert await store.cancel_key(WF, KEY) == 1
    assert await store.cancel_key(WF, KEY) == 0


async def test_a_start_racing_the_ending_is_never_lost_nor_started_twice(store: RunStore) -> None:
    """Ends and starts interleaved at random: at every moment at most one run is live,
    and in the end every run ran once, in arrival order."""
    first = await start(store, 0)
    order = [first.run_id]
    finished: list[str] = []

    async def starter(base: int) -> None:
        for n in range(base, base + 10):
            order.append((await start(store, n)).run_id)

    async def ender() -> None:
        while len(finished) < 41:
            steps = await store.take_steps(WF, "r1", count=5)
            assert len(steps) <= 1
            for step in steps:
                await store.complete_step(step.run_id, "only", lease=step.lease)
                finished.append(step.run_id)
            if not steps:
                await asyncio.sleep(0.005)

    await asyncio.wait_for(
        asyncio.gather(starter(1), starter(11), starter(21), starter(31), ender()), 30
    )
    index = [m.decode() for m in await store.redis.zrange(store.keys(WF).runs(), 0, -1)]
    assert finished == index and sorted(finished) == sorted(order)


async def test_the_preview_says_queue(store: RunStore) -> None:
    await start(store, 0)
    decision, state = await store.preview_start(
        WF, KEY, "queue", "rerun", "flag", "fp", flow=Flow(queue_max=1)
    )
    assert decision == "queue" and state is not None and state.live == 1
    await start(store, 1)
    decision, _ = await store.preview_start(
        WF, KEY, "queue", "rerun", "flag", "fp", flow=Flow(queue_max=1)
    )
    assert decision == "queue_full"


async def test_queued_runs_are_listed_and_counted(store: RunStore) -> None:
    await start(store, 0)
    waiting = await start(store, 1)
    runs, _ = await store.list_runs(WF, phase="queued")
    assert [r.id for r in runs] == [waiting.run_id]
    await sweep(store, WF)  # the sweep leaves a waiting run alone
    assert (await store.get_run(waiting.run_id)).phase == "queued"


async def test_a_batch_refuses_the_queue_policy(store: RunStore) -> None:
    with pytest.raises(RealmError) as refused:
        await store.start_run_batch(WF, [{"idempotency_key": "k"}], on_live_match="queue")
    assert refused.value.code == "VALIDATION_PARAMS" and "single starts" in refused.value.message


@pytest.mark.parametrize(
    ("extra", "field", "reason"),
    [
        ("queue: {max: 3}", "queue", "needs on_live_match: queue"),
        ("concurrency: {limit: 2}", "concurrency", "needs on_live_match: queue"),
        ("on_live_match: queue\n  queue: {max: 0}", "queue.max", "1 or more"),
        (
            "on_live_match: queue\n  queue: {keep: oldest}",
            "queue.keep",
            "must be one of all, newest",
        ),
        ("on_live_match: queue\n  queue: {size: 3}", "queue.size", "unknown field"),
        ("on_live_match: queue\n  queue: 3", "queue", "must be a mapping"),
        ("on_live_match: queue\n  concurrency: {limit: true}", "concurrency.limit", "whole number"),
        ("on_live_match: queue\n  delay: 1m", "delay", "cannot be combined with on_live_match"),
    ],
)
def test_a_wrong_queue_is_refused_naming_its_field(extra: str, field: str, reason: str) -> None:
    message = refusal(extra)
    assert f"field '{field}'" in message and reason in message


def test_a_queue_trigger_compiles_to_its_flow() -> None:
    trigger = compiled(
        "on_live_match: queue\n  queue: {max: 5, keep: newest}\n  concurrency: {limit: 2}"
    )
    assert trigger.flow == Flow(limit=2, queue_max=5, keep="newest")


# ------------------------------------------------------------------ two gateways

QUEUED = """
version: 1
workflows:
  build:
    steps: [run]
    max_attempts: 1
triggers:
  push:
    workflow: build
    path: /hooks/push
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
    key: "{$.repo}"
    on_live_match: queue
    on_terminal_match: rerun
"""


@pytest.mark.slow
def test_two_gateways_queue_twenty_deliveries_behind_one_run(
    tmp_path: Path, module_redis: Any, db: redis_sync.Redis
) -> None:
    """20 deliveries at once over 2 `realm listen` processes: one starts, 19 queue
    (202, outcome queued), a redelivery of each is deduplicated; then each ending, by a
    runner's report, failure or a cancel through the listener's API, starts the next
    in arrival order, once."""
    gateways = []
    for n in range(2):
        (workdir := tmp_path / f"g{n}").mkdir()
        gateways.append(
            Listener(
                workdir, QUEUED, redis_url=module_redis.url, env={"REALM_API_TOKEN": TOKEN}
            ).start()
        )
    try:
        urls = [g.base_url for g in gateways]
        sends = [{"id": f"evt-{n}", "repo": "acme/api", "n": n} for n in range(20)]
        replies = asyncio.run(_send_all(urls, sends))
        again = asyncio.run(_send_all(urls, sends[:3]))
        outcomes = sorted(r["outcome"] for r in replies)
        assert outcomes == ["queued"] * 19 + ["started"]
        assert all(r["status"] == 202 for r in replies)
        assert [r["outcome"] for r in again] == ["deduplicated"] * 3
        assert all(r["phase"] in ("running", "queued") for r in again)
        order = db.zrange("realm:{build}:runs", 0, -1)
        assert len(order) == 20
        metrics = httpx.get(urls[0] + "/metrics", timeout=10).text
        assert 'realm_runs_waiting{phase="queued",workflow="build"} 19.0' in metrics
        counted = 'realm_trigger_outcomes_total{outcome="queued",trigger="push",workflow="build"}'
        assert counted in metrics

        def live() -> list[str]:
            return [i for i in order if db.hget(f"realm:{{build}}:run:{i}", "phase") == "running"]

        for i, run_id in enumerate(order):
            assert live() == [run_id]
            if i % 3 == 0:
                asyncio.run(_report(module_redis.url, run_id, fail=False))
            elif i % 3 == 1:
                asyncio.run(_report(module_redis.url, run_id, fail=True))
            else:
                _cancel_through_the_api(urls[i % 2], run_id)
        assert live() == []
        assert db.zcard("realm:{build}:queued") == 0
    finally:
        for g in gateways:
            g.stop()


async def _report(url: str, run_id: str, *, fail: bool) -> None:
    """A runner takes the step and reports it done, or failed (its only attempt)."""
    from gateway.link.connection import redis_client

    client = redis_client(url, 5.0)
    try:
        store = RunStore(client, parse_config(QUEUED, file="q.yaml", with_triggers=False))
        [taken] = await store.take_steps("build", "runner")
        assert taken.run_id == run_id
        if fail:
            await store.fail_step(run_id, "run", "boom", lease=taken.lease)
        else:
            await store.complete_step(run_id, "run", lease=taken.lease)
    finally:
        await client.aclose()


def _cancel_through_the_api(url: str, run_id: str) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    reply = httpx.post(f"{url}/v1/runs/{run_id}/cancel", headers=headers, json={})
    assert reply.status_code == 200 and reply.json() == {"cancelled": 1}, reply.text


async def _send_all(urls: list[str], sends: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(n: int, body: dict[str, Any]) -> dict[str, Any]:
            reply = await client.post(
                urls[n % len(urls)] + "/hooks/push", content=orjson.dumps(body),
                headers={"content-type": "application/json"},
            )  # fmt: skip
            assert reply.status_code in (200, 202), reply.text
            result = reply.json()["results"][0]
            return {**result, "status": reply.status_code}

        return list(await asyncio.gather(*(one(n, b) for n, b in enumerate(sends))))


async def test_triggers_test_says_a_delivery_would_queue(redis: Redis) -> None:
    """`realm triggers test` walks the request path writing nothing."""
    config = parse_config(QUEUED, file="q.yaml", env={})
    store = RunStore(redis, config, timeout=5.0)
    trigger = config.triggers["push"]
    headers = [("Content-Type", "application/json")]
    body = orjson.dumps({"id": "evt-9", "repo": "acme/api"})
    idle = await dry_run(store, [trigger], headers, body, sign=False)
    assert idle["triggers"][0]["result"] == "a claim now would start a new run"
    live = await store.start_run("build", {}, "acme/api", "queue", "rerun")
    busy = await dry_run(store, [trigger], headers, body, sign=False)
    assert busy["triggers"][0]["result"] == (
        f"a claim now would queue a new run behind the live runs of its key (run {live.run_id} "
        "is live)"
    )
    assert await redis.zcard(store.keys("build").runs()) == 1


async def test_a_repaired_pointer_keeps_its_queue_going(store: RunStore) -> None:
    """Reconcile rewrites a pointer that names the wrong run: the key's live runs and
    limit stay, so the queued run still starts when the live one ends."""
    first = await start(store, 0)
    waiting = await start(store, 1)
    pointer = store.keys(WF).pointer(KEY)
    await store.redis.hset(pointer, "run", "00000000-0000-4000-8000-000000000000")
    report = await reconcile(store, dry_run=False)
    assert report.written == 1
    assert (await store.redis.hget(pointer, "run")).decode() == first.run_id
    assert (await store.redis.hget(pointer, "live")).decode() == first.run_id
    await store.complete_step(first.run_id, "only")
    assert (await store.get_run(waiting.run_id)).phase == "running"
