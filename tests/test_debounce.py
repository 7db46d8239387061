"""Scheduled runs: ``debounce`` (one run after a storm of a key's deliveries, with the
last one's params) and ``delay`` (every run starts later). A scheduled run's first step
goes to the runners when it is due, from whichever `realm listen` process's sweep sees
it first, once. Against real Redis servers and real `realm listen` processes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from gateway.ingest.dryrun import dry_run
from gateway.loading import parse_config
from gateway.store.runs import Flow
from gateway.store.runstore import RunStore
from gateway.store.sweep import start_due
from tests.listener import Listener
from tests.trigger_yaml import compiled, refusal

WF = "single"  # one step, `only` (tests/conftest.py)
KEY = "cus_1"


async def server_ms(store: RunStore) -> int:
    seconds, micros = await store.redis.time()
    return seconds * 1000 + micros // 1000


async def debounced(store: RunStore, n: int, period_ms: int = 60_000, max_wait_ms: int = 0):
    return await store.start_run(
        WF, {"n": n}, KEY, "use_existing", "rerun",
        flow=Flow(debounce_ms=period_ms, max_wait_ms=max_wait_ms),
        markers=[store.event_marker(WF, "t", f"evt-{n}")],
    )  # fmt: skip


async def stream_length(store: RunStore) -> int:
    return int(await store.redis.xlen(store.keys(WF).stream()))


async def test_a_delayed_start_is_scheduled_and_starts_once_when_due(store: RunStore) -> None:
    before = await server_ms(store)
    started = await store.start_run(WF, {"a": 1}, flow=Flow(delay_ms=300))
    assert (started.phase, started.deduped, started.next_step) == ("scheduled", False, None)
    assert started.due_ms is not None and before + 300 <= started.due_ms <= before + 1300
    run = await store.get_run(started.run_id)
    assert (run.phase, run.due_ms) == ("scheduled", started.due_ms)
    assert await stream_length(store) == 0
    assert await start_due(store, WF) == 0  # not yet
    while await server_ms(store) < started.due_ms:
        await asyncio.sleep(0.02)
    # Eight sweeps at once, as eight gateway workers: one start.
    counts = await asyncio.gather(*(start_due(store, WF) for _ in range(8)))
    assert sum(counts) == 1
    assert await stream_length(store) == 1
    run = await store.get_run(started.run_id)
    assert (run.phase, run.next_step, run.due_ms) == ("running", "only", None)
    [taken] = await store.take_steps(WF, "r1")
    assert (taken.run_id, taken.params) == (started.run_id, {"a": 1})


async def test_fifty_starts_within_the_period_make_one_run_with_the_last_params(
    store: RunStore,
) -> None:
    first = await debounced(store, 0, period_ms=500)
    results = [first] + [await debounced(store, n, period_ms=500) for n in range(1, 50)]
    assert first.phase == "scheduled" and not first.deduped
    assert {r.run_id for r in results} == {first.run_id}
    assert all(r.debounced and r.phase == "scheduled" for r in results[1:])
    last_at = await server_ms(store)
    run = await store.get_run(first.run_id)
    assert run.params == {"n": 49}
    assert last_at <= run.due_ms + 5 and run.due_ms >= last_at + 500 - 50
    assert await store.redis.zcard(store.keys(WF).runs()) == 1
    while await server_ms(store) < run.due_ms:
        assert await start_due(store, WF) == 0
        await asyncio.sleep(0.02)
    assert await start_due(store, WF) == 1
    [taken] = await store.take_steps(WF, "r1")
    assert (taken.run_id, taken.params) == (first.run_id, {"n": 49})
    started_ms = int(await store.redis.hget(store.keys(WF).run(first.run_id), "started_ms"))
    assert started_ms >= last_at + 500 - 50


async def test_a_redelivery_changes_nothing(store: RunStore) -> None:
    first = await debounced(store, 0)
    await debounced(store, 1)
    due = (await store.get_run(first.run_id)).due_ms
    again = await debounced(store, 0)
    assert (again.run_id, again.deduped, again.debounced) == (first.run_id, True, False)
    run = await store.get_run(first.run_id)
    assert (run.params, run.due_ms) == ({"n": 1}, due)


async def test_max_wait_bounds_a_storm_that_never_pauses(store: RunStore) -> None:
    """A delivery every 50 ms with a 300 ms period never pauses long enough; max_wait
    (800 ms) starts the run anyway, and the storm's next delivery meets a live run."""
    first = await debounced(store, 0, period_ms=300, max_wait_ms=800)
    created = (await store.get_run(first.run_id)).created_ms
    n = 1
    while True:
        await asyncio.sleep(0.05)
        result = await debounced(store, n, period_ms=300, max_wait_ms=800)
        n += 1
        assert result.due_ms is None or result.due_ms <= created + 800
        if await start_due(store, WF):
            break
        assert await server_ms(store) < created + 2000, "max_wait did not bound the storm"
    started_ms = int(await store.redis.hget(store.keys(WF).run(first.run_id), "started_ms"))
    assert created + 800 <= started_ms < created + 1500
    later = await debounced(store, n, period_ms=300, max_wait_ms=800)
    assert (later.run_id, later.deduped, later.phase) == (first.run_id, True, "running")


async def test_a_scheduled_run_can_be_cancelled_by_id_and_by_key(store: RunStore) -> None:
    one = await store.start_run(WF, {}, flow=Flow(delay_ms=60_000))
    assert await store.cancel_run(one.run_id) == 1
    assert (await store.get_run(one.run_id)).phase == "cancelled"
    assert await store.redis.zcard(store.keys(WF).due()) == 0
    keyed = await debounced(store, 0)
    assert await store.cancel_key(WF, KEY) == 1
    assert (await store.get_run(keyed.run_id)).phase == "cancelled"
    # The key is free again: the next storm schedules a new run (on_terminal_match rerun).
    fresh = await debounced(store, 1)
    assert fresh.run_id != keyed.run_id and fresh.phase == "scheduled"
    assert fresh.rerun_of == keyed.run_id


async def test_another_start_on_a_scheduled_key_is_deduplicated(store: RunStore) -> None:
    scheduled = await debounced(store, 0)
    plain = await store.start_run(WF, {"other": True}, KEY, "cancel_existing", "rerun")
    assert (plain.run_id, plain.deduped, plain.phase) == (scheduled.run_id, True, "scheduled")
    assert (await store.get_run(scheduled.run_id)).params == {"n": 0}


async def test_the_preview_says_schedule_and_debounce(store: RunStore) -> None:
    flow = Flow(debounce_ms=1000)
    decision, _ = await store.preview_start(
        WF, KEY, "use_existing", "rerun", "flag", "fp", flow=flow
    )
    assert decision == "schedule"
    await debounced(store, 0)
    decision, _ = await store.preview_start(
        WF, KEY, "use_existing", "rerun", "flag", "fp", flow=flow
    )
    assert decision == "debounce"


@pytest.mark.parametrize(
    ("extra", "field", "reason"),
    [
        ("debounce: 30s", "debounce", "must be a mapping"),
        ("debounce: {max_wait: 5m}", "debounce.period", "is required"),
        ("debounce: {period: soon}", "debounce.period", "must be a duration"),
        ("debounce: {period: 1m, max_wait: 30s}", "debounce.max_wait", "at least debounce.period"),
        ("debounce: {period: 1m, wait: 5m}", "debounce.wait", "unknown field"),
        ("delay: later", "delay", "must be a duration"),
        ("delay: 1m\n  debounce: {period: 1m}", "delay", "cannot be combined with debounce"),
    ],
)
def test_a_wrong_debounce_or_delay_is_refused_naming_its_field(
    extra: str, field: str, reason: str
) -> None:
    message = refusal(extra)
    assert f"field '{field}'" in message and reason in message


def test_debounce_and_delay_compile_to_their_flow() -> None:
    assert compiled("debounce: {period: 30s, max_wait: 5m}").flow == Flow(
        debounce_ms=30_000, max_wait_ms=300_000
    )
    assert compiled("delay: 10m").flow == Flow(delay_ms=600_000)


# ------------------------------------------------------------------ listeners

SCHEDULED = """
version: 1
workflows:
  sync:
    steps: [run]
triggers:
  customer-updated:
    workflow: sync
    path: /hooks/stripe
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
    key: "{$.data.object.id}"
    params: {version: $.n}
    on_terminal_match: rerun
    debounce: {period: 1s, max_wait: 10s}
  later:
    workflow: sync
    path: /hooks/later
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
    delay: 1s
"""


@pytest.mark.slow
def test_two_gateways_debounce_fifty_deliveries_into_one_run(
    tmp_path: Path, module_redis: Any, db: redis_sync.Redis
) -> None:
    """50 deliveries for one customer within the period, over 2 `realm listen`
    processes: every reply is 202 scheduled with the same run id; one run starts, about
    a period after the last, with the last delivery's params; a redelivery changes
    nothing. A delayed delivery starts about its delay after it came."""
    gateways = []
    for n in range(2):
        (workdir := tmp_path / f"g{n}").mkdir()
        gateways.append(Listener(workdir, SCHEDULED, redis_url=module_redis.url).start())
    try:
        urls = [g.base_url for g in gateways]
        replies = [
            _send(urls[n % 2], "/hooks/stripe", {"id": f"evt_{n}", "n": n,
                                                 "data": {"object": {"id": "cus_9"}}})
            for n in range(50)
        ]  # fmt: skip
        last_sent_ms = _server_ms(db)
        assert {(r.status_code, r.json()["results"][0]["outcome"]) for r in replies} == {
            (202, "scheduled")
        }
        [run_id] = {r.json()["results"][0]["run_id"] for r in replies}
        due_ms = replies[-1].json()["results"][0]["due_ms"]
        again = _send(urls[0], "/hooks/stripe", {"id": "evt_3", "n": 3,
                                                 "data": {"object": {"id": "cus_9"}}})  # fmt: skip
        assert again.status_code == 200
        assert again.json()["results"][0]["outcome"] == "deduplicated"
        delayed = _send(urls[1], "/hooks/later", {"id": "later-1"}).json()["results"][0]
        assert delayed["outcome"] == "scheduled"

        run_key = f"realm:{{sync}}:run:{run_id}"
        started_ms = _wait_started(db, run_key, deadline_s=10)
        assert last_sent_ms + 1000 - 50 <= started_ms <= due_ms + 2000
        assert orjson.loads(db.hget(run_key, "params")) == {"version": 49}
        delayed_started = _wait_started(db, f"realm:{{sync}}:run:{delayed['run_id']}", 10)
        assert delayed["due_ms"] <= delayed_started <= delayed["due_ms"] + 2000
        # Each started once: one stream entry each.
        entries = db.xrange("realm:{sync}:stream")
        assert sorted(e[1]["run_id"] for e in entries) == sorted([run_id, delayed["run_id"]])
        assert db.zcard("realm:{sync}:runs") == 2
    finally:
        for g in gateways:
            g.stop()


def _send(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, content=orjson.dumps(body),
                      headers={"content-type": "application/json"}, timeout=10)  # fmt: skip


def _server_ms(db: redis_sync.Redis) -> int:
    seconds, micros = db.time()
    return seconds * 1000 + micros // 1000


def _wait_started(db: redis_sync.Redis, run_key: str, deadline_s: float) -> int:
    """Poll the run until a sweep started it (bounded); its start time, by the server."""
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        if db.hget(run_key, "phase") == "running":
            return int(db.hget(run_key, "started_ms"))
        time.sleep(0.05)
    raise AssertionError(f"{run_key} was not started within {deadline_s} s")


async def test_triggers_test_says_a_delivery_would_be_scheduled(redis: Redis) -> None:
    config = parse_config(SCHEDULED, file="s.yaml", env={})
    store = RunStore(redis, config, timeout=5.0)
    trigger = config.triggers["customer-updated"]
    headers = [("Content-Type", "application/json")]
    body = orjson.dumps({"id": "evt_1", "n": 1, "data": {"object": {"id": "cus_1"}}})
    first = await dry_run(store, [trigger], headers, body, sign=False)
    assert (
        first["triggers"][0]["result"] == "a claim now would schedule a new run (debounce, delay)"
    )
    run = await store.start_run(
        "sync", {"version": 0}, "cus_1", "use_existing", "rerun", flow=trigger.flow
    )
    later = await dry_run(store, [trigger], headers, body, sign=False)
    assert later["triggers"][0]["result"] == (
        f"a claim now would give run {run.run_id} (scheduled) these params and push its due "
        "time (debounce)"
    )
