"""Reconcile against a real server: dry run, repair, idempotence, and racing starts."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from gateway.keys import Keys
from gateway.reconcile import reconcile
from gateway.store import RunStore

KEYS = Keys("realm", "sync")


async def rerun_chain(store: RunStore, key: str, length: int) -> list[str]:
    """``length`` runs under one key, each ended and then rerun: oldest first."""
    ids = []
    for _ in range(length):
        result = await store.start_run("sync", {}, key, on_terminal_match="rerun")
        ids.append(result.run_id)
        await store.fail_run(result.run_id)
    return ids


async def test_dry_run_reports_then_repair_then_everything_is_current(
    store: RunStore, redis: Redis
):
    ok = (await store.start_run("sync", {}, "ok")).run_id
    missing = (await store.start_run("sync", {}, "missing")).run_id
    await redis.delete(KEYS.pointer("missing"))
    stale_chain = await rerun_chain(store, "stale", 3)
    await redis.hset(KEYS.pointer("stale"), "run", stale_chain[0])
    dup_chain = await rerun_chain(store, "dup", 2)

    report = await reconcile(store, dry_run=True)
    lines = report.text().splitlines()
    assert lines[:3] == [
        "Would write 2 pointer(s) across 4 key group(s); 2 already current.",
        "Missing pointers: 1; stale pointers: 1.",
        "Duplicate-key groups: 2",
    ]
    # SCAN order is the server's: compare the group lines as a set.
    assert set(lines[3:]) == {
        f"  - workflow 'sync' → canonical {stale_chain[2]}; other runs: "
        f"{stale_chain[1]}, {stale_chain[0]}",
        f"  - workflow 'sync' → canonical {dup_chain[1]}; other runs: {dup_chain[0]}",
    }
    assert (report.missing, report.stale, report.current, report.duplicate_groups) == (1, 1, 2, 2)
    assert {d.canonical: d.others for d in report.duplicates} == {
        stale_chain[2]: (stale_chain[1], stale_chain[0]),
        dup_chain[1]: (dup_chain[0],),
    }
    assert await redis.exists(KEYS.pointer("missing")) == 0, "a dry run writes nothing"

    repaired = await reconcile(store, dry_run=False)
    assert repaired.text().startswith(
        "Wrote 2 pointer(s) across 4 key group(s); 2 already current."
    )
    assert (await redis.hget(KEYS.pointer("missing"), "run")).decode() == missing
    assert (await redis.hget(KEYS.pointer("stale"), "run")).decode() == stale_chain[2]
    # The repaired pointers behave: a repeat deduplicates against the right run.
    again = await store.start_run("sync", {}, "missing")
    assert (again.deduped, again.run_id) == (True, missing)
    stale_again = await store.start_run("sync", {}, "stale")
    assert (stale_again.run_id, stale_again.phase) == (stale_chain[2], "failed")
    # The ended run's repaired pointer expires with it.
    assert await redis.pttl(KEYS.pointer("stale")) > 0

    second = await reconcile(store, dry_run=True)
    assert second.text().startswith(
        "Would write 0 pointer(s) across 4 key group(s); 4 already current."
    )
    assert (await redis.hget(KEYS.pointer("ok"), "run")).decode() == ok


async def test_a_repair_never_overwrites_a_pointer_a_start_moved(store: RunStore, redis: Redis):
    chain = await rerun_chain(store, "k", 2)
    await redis.hset(KEYS.pointer("k"), "run", chain[0])  # stale, as reconcile would read it
    # A start reruns the key between reconcile's read and its write...
    newer = await store.start_run("sync", {}, "k", on_terminal_match="rerun")
    # ...so the compare-and-set, holding what it read, must leave the pointer alone.
    reply = await store.scripts.repoint(
        [KEYS.pointer("k"), KEYS.key_runs("k"), KEYS.run(chain[1])], [chain[0], chain[1]]
    )
    assert reply == [b"moved"]
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == newer.run_id


async def test_repair_racing_many_starts_leaves_every_key_at_its_newest_run(
    store: RunStore, redis: Redis
):
    for i in range(30):
        await rerun_chain(store, f"k{i}", 2)
        await redis.hset(KEYS.pointer(f"k{i}"), "run", "stale")

    async def starts() -> None:
        for i in range(30):
            await store.start_run("sync", {}, f"k{i}", on_terminal_match="rerun")

    report, _ = await asyncio.gather(reconcile(store, dry_run=False), starts())
    for i in range(30):
        runs, _ = await store.list_runs("sync", key=f"k{i}", limit=10)
        assert (await redis.hget(KEYS.pointer(f"k{i}"), "run")).decode() == runs[0].id
    assert report.written + report.moved + report.current >= 30
    after = await reconcile(store, dry_run=True)
    assert after.to_write == 0
