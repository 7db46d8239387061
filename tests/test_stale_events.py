"""An ordered trigger's stale events: a delivery whose order value is below the highest
one that started a run for its entity starts nothing (200, ``outcome: stale``,
``STATE_EVENT_STALE``), decided in the claim itself. Against real Redis servers, and a
real `realm listen` for the out-of-order storm.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync

from gateway.ingest.dryrun import dry_run
from gateway.ingest.ordering import order_number
from gateway.loading import parse_config
from gateway.model.errors import ConfigError, RealmError
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.trigger_yaml import BASE, refusal

WF = "single"  # one step, `only` (tests/conftest.py)
KEY = "sub-1"


async def start(
    store: RunStore,
    event: str,
    number: float,
    *,
    rank: int = 0,
    ties: str = "accept",
    live: str = "cancel_existing",
    terminal: str = "rerun",
    entity: str = "sub-1",
):
    return await store.start_run(
        WF,
        {"event": event},
        KEY,
        live,  # type: ignore[arg-type]
        terminal,  # type: ignore[arg-type]
        markers=[
            store.event_marker(WF, "t", event),
            store.order_marker(entity, number, rank, ties, str(number)),
        ],
    )


async def run_count(store: RunStore) -> int:
    return int(await store.redis.zcard(store.keys(WF).runs()))


# ------------------------------------------------------------------ the claim


async def test_an_older_event_starts_nothing_and_cancels_nothing(store: RunStore) -> None:
    newest = await start(store, "evt-2", 200)
    with pytest.raises(RealmError) as stale:
        await start(store, "evt-1", 100)
    assert stale.value.code == "STATE_EVENT_STALE"
    assert stale.value.message == (
        "Stale event for workflow 'single': its order value 100 is not after 200, of an "
        "event that already started a run for the same entity; nothing was started."
    )
    # cancel_existing did not end the newer run, and nothing else was written.
    assert (await store.get_run(newest.run_id)).phase == "running"
    assert await run_count(store) == 1
    assert await store.redis.exists(store.keys(WF).event("t", "evt-1")) == 0
    # A newer one supersedes it, and moves the mark.
    newer = await start(store, "evt-3", 300)
    assert newer.rerun_of == newest.run_id
    with pytest.raises(RealmError):
        await start(store, "evt-2b", 250)


async def test_a_redelivery_of_a_started_event_is_deduplicated_not_stale(store: RunStore) -> None:
    """The event's marker answers first: an event that started a run gets that run
    again, even once a newer event moved the mark past it."""
    first = await start(store, "evt-1", 100)
    await start(store, "evt-2", 200)
    again = await start(store, "evt-1", 100)
    assert (again.deduped, again.run_id) == (True, first.run_id)


@pytest.mark.parametrize(("ties", "starts"), [("accept", True), ("refuse", False)])
async def test_ties_follow_the_trigger(store: RunStore, ties: str, starts: bool) -> None:
    await start(store, "evt-1", 100, ties=ties)
    if starts:
        assert not (await start(store, "evt-2", 100, ties=ties)).deduped
    else:
        with pytest.raises(RealmError) as stale:
            await start(store, "evt-2", 100, ties=ties)
        assert stale.value.code == "STATE_EVENT_STALE"


async def test_a_rank_breaks_a_tie(store: RunStore) -> None:
    """Stripe's `created` has whole seconds: an `active` and a `canceled` update of
    one second are ordered by the status's rank, whatever order they arrive in."""
    canceled = await start(store, "evt-canceled", 100, rank=3, ties="refuse")
    with pytest.raises(RealmError, match="not after"):
        await start(store, "evt-active", 100, rank=1, ties="refuse")
    later = await start(store, "evt-next", 101, rank=0, ties="refuse")
    assert later.rerun_of == canceled.run_id


async def test_entities_are_ordered_apart(store: RunStore) -> None:
    await start(store, "evt-a", 500, entity="sub-a")
    started = await start(store, "evt-b", 100, entity="sub-b")
    assert not started.deduped


async def test_the_preview_says_stale_and_writes_nothing(store: RunStore) -> None:
    await start(store, "evt-2", 200)
    markers = [
        store.event_marker(WF, "t", "evt-1"),
        store.order_marker("sub-1", 100, 0, "accept", "100"),
    ]
    with pytest.raises(RealmError) as stale:
        await store.preview_start(WF, KEY, "cancel_existing", "rerun", "flag", "fp", markers)
    assert stale.value.code == "STATE_EVENT_STALE"
    marker = [store.order_marker("sub-1", 300, 0, "accept", "300")]
    decision, _ = await store.preview_start(
        WF, KEY, "cancel_existing", "rerun", "flag", "fp", marker
    )
    assert decision == "rerun"


# ------------------------------------------------------------------ values and config


@pytest.mark.parametrize(
    ("value", "number"),
    [
        (1700000000, 1.7e9),
        (12.5, 12.5),
        ("42", 42.0),
        ("1970-01-01T00:00:01Z", 1_000_000.0),
        ("1970-01-01T01:00:01+01:00", 1_000_000.0),
        ("1970-01-01 00:00:00.25Z", 250_000.0),
        ("1970-01-02", 86_400_000_000.0),
        ("yesterday", None),
        ("2024-02-30", None),
        (True, None),
        (None, None),
        ([1], None),
    ],
)
def test_order_values_are_numbers_times_or_dates(value: Any, number: float | None) -> None:
    assert order_number(value) == number


@pytest.mark.parametrize(
    ("order", "field", "reason"),
    [
        ("[1]", "order", "must be a mapping"),
        ("{key: x}", "order.by", "is required"),
        ("{by: $.created, ties: maybe}", "order.ties", "must be one of accept, refuse"),
        ("{by: $.created, when: 1}", "order.when", "unknown field"),
        ("{by: {header: X-T, jsonpath: $.t}}", "order.by", "exactly one source"),
        ("{by: $.c, rank: {by: $.s}}", "order.rank.order", "is required"),
        ("{by: $.c, rank: {by: $.s, order: [a, a]}}", "order.rank.order", "names a word twice"),
        ("{by: $.c, key: '{nope}'}", "order.key", ""),
    ],
)
def test_a_wrong_order_is_refused_naming_its_field(order: str, field: str, reason: str) -> None:
    message = refusal(f"order: {order}")
    assert f"field '{field}'" in message and reason in message


def test_an_entity_apart_from_the_key_needs_one_partition() -> None:
    text = (
        "version: 1\nworkflows:\n  deploy: {steps: [a], partitions: 4}\ntriggers:"
        + BASE.replace("\n", "\n  ")
        + "  key: 'k-{$.id}'\n    order: {by: $.created, key: '{$.entity}'}\n"
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(text, file="t.yaml", env={})
    assert "order.key must be the trigger's key" in str(refused.value)


# ------------------------------------------------------------------ through the listener

ENTITIES, EVENTS_EACH, SENDERS = 50, 20, 16

ORDERED = """
version: 1
workflows:
  sync-subscription:
    steps: [sync]
triggers:
  stripe-subscription:
    workflow: sync-subscription
    path: /hooks/subs
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
    key: "sub-{$.data.object.id}"
    on_live_match: cancel_existing
    on_terminal_match: rerun
    order: {by: $.created}
    params:
      event: $.id
      created: $.created
"""


def test_out_of_order_deliveries_never_start_an_older_event(
    tmp_path: Path, module_redis: Any, db: redis_sync.Redis
) -> None:
    """1 000 events of 50 subscriptions, each subscription's events shuffled, sent by
    16 concurrent senders with one in five sent twice: for every subscription the runs
    started, in the order they started, carry rising `created` values, and its newest
    event started one."""
    rng = random.Random(21)
    events = [
        {"id": f"evt_{e}_{n}", "created": 1_700_000_000 + 10 * n,
         "data": {"object": {"id": f"s{e}", "status": "active"}}}
        for e in range(ENTITIES) for n in range(EVENTS_EACH)
    ]  # fmt: skip
    rng.shuffle(events)
    sends = events + rng.sample(events, len(events) // 5)
    rng.shuffle(sends)
    listener = Listener(tmp_path, ORDERED, redis_url=module_redis.url).start()
    try:
        outcomes = asyncio.run(_send_all(listener.base_url, sends))
        # An order value that is no number, time or date: 422, saying where and what.
        bad = dict(events[0], id="evt_bad", created="yesterday")
        reply = httpx.post(listener.base_url + "/hooks/subs", content=orjson.dumps(bad),
                           headers={"content-type": "application/json"}, timeout=10)  # fmt: skip
    finally:
        listener.stop()
    assert reply.status_code == 422
    (result,) = reply.json()["results"]
    assert (result["code"], result["message"]) == (
        "VALIDATION_ORDER",
        "order value is missing or not comparable: jsonpath $.created holds 'yesterday' "
        "(a number, an RFC 3339 time or an ISO date is needed)",
    )
    assert set(outcomes) <= {"started", "deduplicated", "stale"}, outcomes
    assert outcomes["stale"] > 0 and outcomes["started"] > ENTITIES

    created: dict[str, list[int]] = defaultdict(list)
    for e in range(ENTITIES):
        key_runs = f"realm:{{sync-subscription}}:keyruns:sub-s{e}"
        for run_id in db.zrange(key_runs, 0, -1):
            params = db.hget(f"realm:{{sync-subscription}}:run:{run_id}", "params")
            created[f"s{e}"].append(orjson.loads(params)["created"])
    newest = 1_700_000_000 + 10 * (EVENTS_EACH - 1)
    for entity, values in created.items():
        assert values == sorted(values) and len(set(values)) == len(values), (entity, values)
        assert values[-1] == newest, entity
    assert len(created) == ENTITIES


async def _send_all(base_url: str, sends: list[dict[str, Any]]) -> dict[str, int]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for event in sends:
        queue.put_nowait(event)
    outcomes: dict[str, int] = defaultdict(int)

    async def sender(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            event = queue.get_nowait()
            reply = await client.post("/hooks/subs", content=orjson.dumps(event),
                                      headers={"content-type": "application/json"})  # fmt: skip
            assert reply.status_code in (200, 202), reply.text
            outcomes[reply.json()["results"][0]["outcome"]] += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        await asyncio.gather(*(sender(client) for _ in range(SENDERS)))
    return dict(outcomes)


async def test_triggers_test_says_a_delivery_would_be_stale(store: RunStore) -> None:
    """`realm triggers test` walks the request path writing nothing: an event older
    than the entity's mark is reported as the refusal a live delivery would get."""
    config = parse_config(ORDERED, file="t.yaml", env={})
    ordered = RunStore(store.redis, config, timeout=5.0)
    trigger = config.triggers["stripe-subscription"]
    event = {"id": "evt_1", "created": 100, "data": {"object": {"id": "s1"}}}
    headers = [("Content-Type", "application/json")]
    fresh = await dry_run(ordered, [trigger], headers, orjson.dumps(event), sign=False)
    assert fresh["triggers"][0]["result"] == "a claim now would start a new run"
    await ordered.start_run(
        "sync-subscription", {"event": "evt_2", "created": 200}, "sub-s1", markers=[
            ordered.order_marker("sub-s1", 200, 0, "accept", "200")
        ],
    )  # fmt: skip
    stale = await dry_run(ordered, [trigger], headers, orjson.dumps(event), sign=False)
    assert stale["triggers"][0]["result"] == (
        "200: STATE_EVENT_STALE: Stale event for workflow 'sync-subscription': its order "
        "value 100 is not after 200, of an event that already started a run for the same "
        "entity; nothing was started."
    )
