"""start_run_batch against a real server: all-or-nothing validation, dedup, round trips."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from gateway.model.errors import RealmError
from gateway.store.keys import Keys
from gateway.store.runstore import RunStore

KEYS = Keys("realm", "sync")


async def evalsha_calls(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return sum(stats.get(name, {}).get("calls", 0) for name in ("cmdstat_evalsha", "cmdstat_eval"))


async def test_one_bad_item_creates_nothing_and_is_named(store: RunStore, redis: Redis):
    items = [
        {"params": {"repo": "o/r", "sha": "abcdef0"}, "idempotency_key": "a"},
        {"params": {"repo": "o/r"}, "idempotency_key": "b"},
        {"params": {"repo": "o/r", "sha": "abcdef1"}},
        {"params": {"repo": 5, "sha": "abcdef2"}, "idempotency_key": "d"},
    ]
    with pytest.raises(RealmError) as err:
        await store.start_run_batch("deploy", items)

    assert err.value.code == "VALIDATION_BATCH_ITEMS"
    assert err.value.message == (
        "start_run_batch: 2 items failed schema validation\n"
        "  - item 1: $: 'sha' is a required property\n"
        "  - item 3: $.repo: 5 is not of type 'string'\n"
        "One or more items failed schema validation. No runs were created."
    )
    assert await redis.dbsize() == 0


async def test_new_existing_and_repeated_keys_get_the_right_deduped(store: RunStore, redis: Redis):
    existing = await store.start_run("sync", {}, "order-4417")
    entries = await store.start_run_batch(
        "sync",
        [
            {"params": {}, "idempotency_key": "order-21"},
            {"params": {}, "idempotency_key": "order-22"},
            {"params": {}, "idempotency_key": "order-4417"},
            {"params": {}, "idempotency_key": "order-21"},
            {"params": {}},
        ],
    )

    assert [e.index for e in entries] == [0, 1, 2, 3, 4]
    assert [e.result.deduped for e in entries] == [False, False, True, True, False]
    assert entries[2].result.run_id == existing.run_id
    assert entries[3].result.run_id == entries[0].result.run_id
    assert len({e.result.run_id for e in entries}) == 4
    assert await redis.xlen(KEYS.stream()) == 4  # the existing run's entry + 3 new runs
    assert await redis.zcard(KEYS.runs()) == 4


async def test_a_batch_applies_its_policies_to_every_item(store: RunStore, redis: Redis):
    live = await store.start_run("sync", {}, "a")
    done = await store.start_run("sync", {}, "b")
    await store.fail_run(done.run_id)

    refused = await store.start_run_batch(
        "sync", [{"idempotency_key": "a"}, {"idempotency_key": "b"}], on_live_match="fail",
        on_terminal_match="reject",
    )  # fmt: skip
    assert [e.error.code for e in refused] == [
        "STATE_RUN_ALREADY_ACTIVE",
        "STATE_IDEMPOTENCY_KEY_USED",
    ]

    replaced = await store.start_run_batch(
        "sync", [{"idempotency_key": "a"}, {"idempotency_key": "b"}],
        on_live_match="cancel_existing", on_terminal_match="rerun_if_failed",
    )  # fmt: skip
    assert [e.result.rerun_of for e in replaced] == [live.run_id, done.run_id]
    assert (await store.get_run(live.run_id)).phase == "cancelled"
    assert (await redis.hget(KEYS.pointer("a"), "run")).decode() == replaced[0].result.run_id


async def test_a_batch_of_1000_takes_one_script_call(store: RunStore, redis: Redis):
    items = [{"params": {"n": i}, "idempotency_key": f"k{i % 700}"} for i in range(1000)]
    before = await evalsha_calls(redis)
    entries = await store.start_run_batch("sync", items)
    calls = await evalsha_calls(redis) - before

    assert calls == 1
    assert sum(not e.result.deduped for e in entries) == 700
    assert await redis.zcard(KEYS.runs()) == 700


async def test_a_batch_with_cancel_existing_names_live_runs_in_a_second_call(
    store: RunStore, redis: Redis
):
    for i in range(5):
        await store.start_run("sync", {}, f"k{i}")
    before = await evalsha_calls(redis)
    entries = await store.start_run_batch(
        "sync", [{"idempotency_key": f"k{i}"} for i in range(10)], on_live_match="cancel_existing"
    )
    assert await evalsha_calls(redis) - before == 2
    assert [e.result.rerun_of is not None for e in entries] == [True] * 5 + [False] * 5
    runs, _ = await store.list_runs("sync", phase="running", limit=100)
    assert len(runs) == 10
