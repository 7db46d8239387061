"""The delivery log's store (gateway/deliveries/log.py): what a record keeps and leaves out,
trimming to the retention and the count caps, paging by position while deliveries
are recorded, and replay's semantics. Against a real Redis; the listener's own
recording is tested end to end in tests/test_deliveries_api.py."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from gateway.deliveries.log import (
    DeliveryFilter,
    DeliveryRecorder,
    LogKeys,
    build_record,
    get_delivery,
    list_deliveries,
    replay,
    write_records,
)
from gateway.deliveries.records import pack_record
from gateway.ingest.delivery import Reply
from gateway.ingest.served import triggers_by_path
from gateway.model.errors import RealmError
from gateway.store.runstore import RunStore
from tests.deliveries_scaffold import (
    STORE_CONFIG,
    deliver,
    load,
    push,
    signed,
    spec_fingerprint,
)

FIXED = STORE_CONFIG.replace("equals: push}", "in: [push, release]}")


@pytest.fixture
async def log_store(redis: Redis) -> RunStore:
    return RunStore(redis, load(), timeout=5.0)


async def test_a_started_delivery_is_kept_without_its_credentials(log_store: RunStore) -> None:
    body = push()
    item = await deliver(log_store, body, signed(body, delivery="d-1"))
    (delivery_id,) = await write_records(log_store, log_store.config.settings, [item])

    record = await get_delivery(log_store, delivery_id)
    run_id = record["triggers"][0]["run_id"]
    assert record == {
        "delivery_id": delivery_id,
        "received_ms": item.received_ms,
        "path": "/hooks/git",
        "status": 202,
        "code": None,
        "message": None,
        "ms": 1.5,
        "config_version": log_store.config.version,
        "replay_of": None,
        "rerun": False,
        "triggers": [
            {
                "trigger": "push",
                "workflow": "deploy",
                "outcome": "started",
                "run_id": run_id,
                "event_id": "d-1",
                "deduped": False,
                "rerun_of": None,
                "phase": "running",
                "code": None,
                "message": f"Run '{run_id}' created for workflow 'deploy'. Ready for the agent: "
                "'build'.",
                # Each step's word: the one walk of the request path (delivery.handle).
                "signature": "ok",
                "matched": True,
                "why_not": None,
                "key": "d-1",
                "params": {"ref": "refs/heads/main"},
                # What a replay checks: it verified, under this spec (the scheme and the
                # secret's variable name, hashed; never the secret).
                "verified": True,
                "verify_spec": spec_fingerprint("github", "GIT_SECRET"),
            }
        ],
        # Signature, authorization and cookie headers are gone; the rest in order.
        "headers": [
            ["content-type", "application/json"],
            ["x-github-event", "push"],
            ["x-github-delivery", "d-1"],
            ["user-agent", "GitHub-Hookshot/abc"],
        ],
        "body": body.decode(),
        "body_encoding": "utf-8",
        "body_size": len(body),
        "body_truncated": False,
    }
    page, cursor = await list_deliveries(log_store)
    assert cursor is None
    assert page == [
        {
            "delivery_id": delivery_id,
            "received_ms": item.received_ms,
            "path": "/hooks/git",
            "status": 202,
            "code": None,
            "outcomes": [{"trigger": "push", "outcome": "started", "run_id": run_id}],
            "replay_of": None,
        }
    ]


async def test_a_refused_delivery_keeps_its_reason_and_nothing_it_sent(
    log_store: RunStore,
) -> None:
    body = push()
    headers = signed(body)
    headers[3][1] = "sha256=" + "0" * 64
    item = await deliver(log_store, body, headers)
    (delivery_id,) = await write_records(log_store, log_store.config.settings, [item])

    record = await get_delivery(log_store, delivery_id)
    assert (record["status"], record["code"], record["message"]) == (
        401,
        "AUTH_REQUIRED",
        "signature did not verify: signature mismatch",
    )
    assert (record["headers"], record["body"], record["body_size"]) == (None, None, None)
    with pytest.raises(RealmError) as refused:
        await replay(
            log_store,
            triggers_by_path(log_store.config),
            log_store.config.settings,
            "v",
            delivery_id,
        )
    assert (refused.value.code, refused.value.message) == (
        "STATE_DELIVERY_NOT_REPLAYABLE",
        f"delivery {delivery_id} was refused (401) before it was verified: the log keeps "
        "neither its headers nor its body",
    )


async def test_bodies_are_cut_at_the_limit_and_binary_ones_kept_exactly(
    log_store: RunStore,
) -> None:
    settings = log_store.config.settings
    long_body = push(pad=5000)
    long_item = await deliver(log_store, long_body, signed(long_body))
    binary = b"\xff\xfe" + push()  # not UTF-8: the parse fails (400), the bytes are kept
    binary_item = await deliver(log_store, binary, signed(binary))
    long_id, binary_id = await write_records(log_store, settings, [long_item, binary_item])

    cut = await get_delivery(log_store, long_id)
    assert (cut["body"], cut["body_size"], cut["body_truncated"]) == (
        long_body[:2000].decode(),
        len(long_body),
        True,
    )
    with pytest.raises(RealmError) as refused:
        await replay(log_store, triggers_by_path(log_store.config), settings, "v", long_id)
    assert refused.value.message == (
        f"delivery {long_id} was stored cut at settings.max_stored_body_bytes (its body "
        f"had {len(long_body)} bytes): the whole body is not kept"
    )
    kept = await get_delivery(log_store, binary_id)
    assert kept["status"] == 400
    assert (kept["body_encoding"], base64.b64decode(kept["body"])) == ("base64", binary)

    no_bodies = dataclasses.replace(settings, store_bodies=False)
    (bare_id,) = await write_records(log_store, no_bodies, [long_item])
    bare = await get_delivery(log_store, bare_id)
    assert (bare["body"], bare["body_size"], bare["headers"][1]) == (
        None,
        len(long_body),
        ["x-github-event", "push"],
    )


async def test_the_log_is_trimmed_to_its_caps_and_a_flood_of_refusals_keeps_the_rest(
    log_store: RunStore, redis: Redis
) -> None:
    settings = log_store.config.settings  # max_deliveries 50: refused ones keep 100
    body = push()
    good = await deliver(log_store, body, signed(body))
    bad = dataclasses.replace(good, reply=Reply(401, {"code": "AUTH_REQUIRED"}), body=None)
    for _ in range(8):
        await write_records(log_store, settings, [good] * 20 + [bad] * 40)
    keys = LogKeys(log_store.prefix)
    assert await redis.zcard(keys.index) == 50
    assert await redis.zcard(keys.refused) == 100
    # Every record dropped from an index is deleted, not left to expire.
    records = [k async for k in redis.scan_iter(match=keys.base + "*", count=1000)]
    assert len(records) == 150
    page, _ = await list_deliveries(log_store, DeliveryFilter(status="202"), limit=1000)
    assert len(page) == 50


async def test_the_cap_keeps_the_newest_when_an_older_record_arrives_late(
    log_store: RunStore, redis: Redis
) -> None:
    """Ids of one millisecond, or of a worker whose clock is behind, arrive out of
    order: the trim drops the oldest ids, whichever call brought them."""
    settings = log_store.config.settings  # max_deliveries 50
    body = push()
    now = int(time.time() * 1000)
    item = await deliver(log_store, body, signed(body), when_ms=now)
    newest = await write_records(log_store, settings, [item] * 50)
    late = dataclasses.replace(item, received_ms=now - 1000)
    await write_records(log_store, settings, [late] * 5)
    keys = LogKeys(log_store.prefix)
    assert await redis.zrange(keys.index, 0, -1) == sorted(i.encode() for i in newest)
    assert len([k async for k in redis.scan_iter(match=keys.base + "*", count=1000)]) == 50


async def test_deliveries_past_retention_are_trimmed(log_store: RunStore, redis: Redis) -> None:
    settings = dataclasses.replace(log_store.config.settings, delivery_retention_ms=60_000)
    body = push()
    now = int(time.time() * 1000)
    old = await deliver(log_store, body, signed(body), when_ms=now - 120_000)
    new = await deliver(log_store, body, signed(body), when_ms=now)
    old_ids = await write_records(log_store, settings, [old] * 5)
    # Written later: the trim of this call finds the old ones past retention.
    new_ids = await write_records(log_store, settings, [new] * 3)
    keys = LogKeys(log_store.prefix)
    assert await redis.zrange(keys.index, 0, -1) == sorted(i.encode() for i in new_ids)
    assert not await redis.exists(*(keys.record(i) for i in old_ids))
    assert 0 < await redis.pttl(keys.record(new_ids[0])) <= 60_000


async def test_records_of_an_earlier_version_and_long_summaries_are_read(
    log_store: RunStore, redis: Redis
) -> None:
    """An earlier version kept each record as a hash (fields p, s, o, sum, doc, b): a
    log written then is still listed, read and replayed. A record whose summary does
    not fit the first kilobyte a listing reads is read again as far as it goes."""
    settings = log_store.config.settings
    keys = LogKeys(log_store.prefix)
    body = push()
    now = int(time.time() * 1000)
    legacy = await deliver(log_store, body, signed(body, delivery="d-old"), when_ms=now - 2000)
    legacy_id, values = build_record(legacy, settings)
    await redis.hset(
        keys.record(legacy_id),
        mapping=dict(zip(["p", "s", "o", "sum", "doc", "b"], values[2:], strict=True)),
    )
    await redis.zadd(keys.index, {legacy_id: 0})
    long = await deliver(log_store, body, signed(body, delivery="d-long"), when_ms=now - 1000)
    long_id, values = build_record(long, settings)
    summary = orjson.loads(values[5])
    summary["outcomes"] *= 40  # as a path with many triggers would have
    values[5] = orjson.dumps(summary)
    assert len(values[5]) > 2048
    await redis.set(keys.record(long_id), pack_record(values))
    await redis.zadd(keys.index, {long_id: 0})

    page, _ = await list_deliveries(log_store)
    assert [item["delivery_id"] for item in page] == [long_id, legacy_id]
    assert page[0] == summary
    assert len(page[0]["outcomes"]) == 40
    record = await get_delivery(log_store, legacy_id)
    assert (record["body"], record["triggers"][0]["event_id"]) == (body.decode(), "d-old")
    replayed = await replay(
        log_store, triggers_by_path(log_store.config), settings,
        log_store.config.version, legacy_id,
    )  # fmt: skip
    assert replayed["replay_of"] == legacy_id
    assert replayed["triggers"][0]["outcome"] == "deduplicated"


async def test_filters_select_by_path_status_outcome_and_time(log_store: RunStore) -> None:
    settings = log_store.config.settings
    now = int(time.time() * 1000)
    body = push()
    started = await deliver(log_store, body, signed(body), when_ms=now - 5000)
    ignored = await deliver(log_store, body, signed(body, event="ping"), when_ms=now - 4000)
    bad_headers = signed(body)
    bad_headers[3][1] = "sha256=00"
    refused = await deliver(log_store, body, bad_headers, when_ms=now - 3000)
    elsewhere = dataclasses.replace(started, path="/hooks/other", received_ms=now - 2000)
    ids = await write_records(log_store, settings, [started, ignored, refused, elsewhere])

    async def found(**where: Any) -> list[str]:
        page, cursor = await list_deliveries(log_store, DeliveryFilter(**where))
        assert cursor is None
        return [d["delivery_id"] for d in page]

    assert await found() == ids[::-1]
    assert await found(path="/hooks/git") == [ids[2], ids[1], ids[0]]
    assert await found(status="202") == [ids[3], ids[0]]
    assert await found(status="2xx") == [ids[3], ids[1], ids[0]]
    assert await found(status="4xx") == [ids[2]]
    assert await found(outcome="unverified") == [ids[2]]
    assert await found(outcome="ignored") == [ids[1]]
    assert await found(outcome="started", path="/hooks/git") == [ids[0]]
    assert await found(since_ms=now - 3500) == [ids[3], ids[2]]

    for where, message in [
        ({"status": "2x"}, "status must be an HTTP status like 202 or a class like 4xx (got '2x')"),
        (
            {"outcome": "lost"},
            "outcome must be one of started, queued, scheduled, deduplicated, refused, stale, "
            "rate_limited, handshake, ignored, unverified, accepted (got 'lost')",
        ),
        ({"path": "hooks"}, "path must start with '/' (got 'hooks')"),
    ]:
        with pytest.raises(RealmError) as bad:
            await list_deliveries(log_store, DeliveryFilter(**where))
        assert (bad.value.code, bad.value.message) == ("VALIDATION_PARAMS", message)
    with pytest.raises(RealmError) as bad:
        await list_deliveries(log_store, cursor="12")
    assert bad.value.message == (
        "delivery id '12' is not one (ids look like dlv-0193a1b2c3d4-5e6f7a8b)"
    )


async def test_paging_sees_every_delivery_once_while_more_are_recorded(
    log_store: RunStore,
) -> None:
    settings = dataclasses.replace(log_store.config.settings, max_deliveries=100_000)
    body = push()
    item = await deliver(log_store, body, signed(body))
    before = set()
    for _ in range(10):
        before.update(await write_records(log_store, settings, [item] * 30))
    writing = True

    async def keep_recording() -> None:
        while writing:
            await write_records(log_store, settings, [dataclasses.replace(item)] * 7)
            await asyncio.sleep(0)

    writer = asyncio.create_task(keep_recording())
    seen: list[str] = []
    cursor = None
    try:
        while True:
            page, cursor = await list_deliveries(log_store, limit=13, cursor=cursor)
            seen.extend(d["delivery_id"] for d in page)
            await asyncio.sleep(0)  # let the writer record between pages
            if cursor is None:
                break
    finally:
        writing = False
        await writer
    assert len(seen) == len(set(seen))  # nothing twice
    assert before <= set(seen)  # nothing recorded before paging began is skipped
    assert seen == sorted(seen, reverse=True)


async def test_replay_applies_the_policies_and_rerun_starts_a_new_run(
    log_store: RunStore,
) -> None:
    settings = log_store.config.settings
    by_path = triggers_by_path(log_store.config)
    body = push()
    (first_id,) = await write_records(
        log_store, settings, [await deliver(log_store, body, signed(body, delivery="e-1"))]
    )
    run_id = (await get_delivery(log_store, first_id))["triggers"][0]["run_id"]

    again = await replay(log_store, by_path, settings, "v2", first_id)
    assert (again["replay_of"], again["rerun"], again["status"], again["config_version"]) == (
        first_id,
        False,
        200,
        "v2",
    )
    (result,) = again["triggers"]
    assert (result["outcome"], result["run_id"], result["event_id"]) == (
        "deduplicated",
        run_id,
        "e-1",
    )
    # The replay is itself in the log, with the headers and body it was sent with.
    assert (await get_delivery(log_store, again["delivery_id"]))["body"] == body.decode()

    rerun = await replay(log_store, by_path, settings, "v2", first_id, rerun=True)
    (result,) = rerun["triggers"]
    assert (result["outcome"], result["rerun_of"]) == ("started", run_id)
    assert result["run_id"] != run_id
    assert (await log_store.get_run(run_id)).phase == "cancelled"
    assert (await log_store.get_run(result["run_id"])).rerun_of == run_id


async def test_a_delivery_ignored_by_a_wrong_trigger_starts_a_run_once_fixed(
    log_store: RunStore,
) -> None:
    settings = log_store.config.settings
    body = push()
    ignored = await deliver(log_store, body, signed(body, event="release", delivery="e-9"))
    assert ignored.reply.results[0].outcome == "ignored"
    (ignored_id,) = await write_records(log_store, settings, [ignored])

    fixed = load(FIXED)
    replayed = await replay(
        log_store.with_config(fixed), triggers_by_path(fixed), settings, fixed.version, ignored_id
    )
    (result,) = replayed["triggers"]
    assert (replayed["status"], result["outcome"], result["event_id"]) == (202, "started", "e-9")
    assert (await log_store.get_run(result["run_id"])).params == {"ref": "refs/heads/main"}

    with pytest.raises(RealmError) as gone:
        await replay(log_store, {}, settings, "v", ignored_id)
    assert (gone.value.code, gone.value.message) == (
        "NOT_FOUND_PATH",
        "no trigger serves /hooks/git in the current configuration: delivery "
        f"{ignored_id} has nothing to be matched against",
    )
    missing = "dlv-000000000000-00000000"
    with pytest.raises(RealmError) as unknown:
        await get_delivery(log_store, missing)
    assert (unknown.value.code, unknown.value.message) == (
        "NOT_FOUND_DELIVERY",
        f"delivery {missing} is not in the delivery log (it keeps "
        "settings.delivery_retention and at most settings.max_deliveries)",
    )


async def test_the_recorder_keeps_what_redis_refused_until_it_takes_it(
    log_store: RunStore, redis: Redis
) -> None:
    body = push()
    item = await deliver(log_store, body, signed(body))
    recorder = DeliveryRecorder(log_store, log_store.config.settings)
    await redis.config_set("maxmemory", "1")  # every write refused (OOM)
    try:
        recorder.add(item)
        recorder.add(dataclasses.replace(item))  # each delivery is its own item
        await recorder.flush()
        assert len(recorder._buffer) == 2
        assert not await redis.exists(LogKeys(log_store.prefix).index)
    finally:
        await redis.config_set("maxmemory", "0")
    await recorder.flush()
    assert recorder._buffer == []
    page, _ = await list_deliveries(log_store)
    assert len(page) == 2

    off = DeliveryRecorder(log_store, dataclasses.replace(log_store.config.settings,
                                                         delivery_log=False))  # fmt: skip
    off.add(item)
    assert off._buffer == []
