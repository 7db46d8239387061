"""Reconcile against a real server: dry run, repair, idempotence, racing starts,
dangling pointers, a lost repair reply, and the key index it walks (what the claim
writes there, what a walk reads, the --scan walk for keys from before the index)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.store.keys import Keys
from gateway.store.reconcile import reconcile
from gateway.store.runstore import RunStore
from tests.tcp_proxy import TcpProxy, _Pending, parse_command, resp_end

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
        "Would write 2 pointers across 4 key groups; 2 already current.",
        "Missing pointers: 1; stale pointers: 1.",
        "Duplicate-key groups: 2",
    ]
    # SCAN order is the server's: compare the group lines as a set.
    assert set(lines[3:]) == {
        f"  - workflow 'sync', key stale → canonical {stale_chain[2]}; other runs: "
        f"{stale_chain[1]}, {stale_chain[0]}",
        f"  - workflow 'sync', key dup → canonical {dup_chain[1]}; other runs: {dup_chain[0]}",
    }
    assert (report.missing, report.stale, report.current, report.duplicate_groups) == (1, 1, 2, 2)
    assert {d.canonical: d.others for d in report.duplicates} == {
        stale_chain[2]: (stale_chain[1], stale_chain[0]),
        dup_chain[1]: (dup_chain[0],),
    }
    assert await redis.exists(KEYS.pointer("missing")) == 0, "a dry run writes nothing"

    repaired = await reconcile(store, dry_run=False)
    assert repaired.text().startswith("Wrote 2 pointers across 4 key groups; 2 already current.")
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
        "Would write 0 pointers across 4 key groups; 4 already current."
    )
    assert (await redis.hget(KEYS.pointer("ok"), "run")).decode() == ok


async def repoint(store: RunStore, key: str, candidates: list[str], op: str = "op-1") -> list:
    """One repoint call naming these candidate runs; its reply as text."""
    reply = await store.scripts.repoint(
        [KEYS.pointer(key), KEYS.key_runs(key), KEYS.op(op), *map(KEYS.run, candidates)],
        candidates,
    )
    return [x.decode() for x in reply]


async def test_a_repair_decides_from_the_set_as_it_is_not_as_it_was_read(
    store: RunStore, redis: Redis
):
    chain = await rerun_chain(store, "k", 2)
    # A walk read the set as [chain[0], chain[1]] and the pointer as something else,
    # then a start reran the key before the repair arrived: the key's newest run is
    # now one the repair was not told about.
    newer = await store.start_run("sync", {}, "k", on_terminal_match="rerun")
    assert await repoint(store, "k", [chain[1], chain[0]]) == ["need", newer.run_id]
    # Told about it, the script finds the key already points at its newest run.
    assert await repoint(store, "k", [chain[1], chain[0], newer.run_id]) == [
        "current",
        newer.run_id,
    ]
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == newer.run_id


async def test_a_repair_never_points_a_key_back_at_a_superseded_run(store: RunStore, redis: Redis):
    # The defect this guards against: the pointer still holds what the walk read (the
    # compare-and-set of old passed), but the walk's idea of the newest run was older.
    first = await store.start_run("sync", {}, "k")
    second = await store.start_run("sync", {}, "k", on_live_match="cancel_existing")
    reply = await repoint(store, "k", [first.run_id, second.run_id])
    assert reply == ["current", second.run_id]
    again = await store.start_run("sync", {}, "k", on_live_match="cancel_existing")
    runs, _ = await store.list_runs("sync", key="k")
    assert [r.phase for r in runs] == ["running", "cancelled", "cancelled"]
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == again.run_id


async def test_the_walk_skips_runs_that_are_gone_and_asks_for_the_members_below(
    store: RunStore, redis: Redis
):
    chain = await rerun_chain(store, "k", 12)
    await redis.delete(*(KEYS.run(r) for r in chain[2:]))  # the 10 newest are gone
    # Told only of the newest, the script names the members below it, newest first.
    reply = await repoint(store, "k", [chain[11]])
    assert reply == ["need", *chain[10:2:-1]]
    reply = await repoint(store, "k", [chain[11], *chain[10:2:-1]])
    assert reply == ["need", chain[2], chain[1], chain[0]]
    reply = await repoint(store, "k", [*chain[::-1]])
    assert reply == ["written", chain[1], chain[11]]
    # The gone members it walked past left the set; the pointer names chain[1].
    members = [m.decode() for m in await redis.zrange(KEYS.key_runs("k"), 0, -1)]
    assert members == chain[:2]
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == chain[1]
    assert (await redis.hget(KEYS.pointer("k"), "phase")).decode() == "failed"
    assert await redis.pttl(KEYS.pointer("k")) > 0


async def test_a_dangling_pointer_is_reported_and_moved_to_the_newest_run_left(
    store: RunStore, redis: Redis
):
    chain = await rerun_chain(store, "k", 3)
    await redis.delete(KEYS.run(chain[2]))  # deleted or evicted: the pointer names nothing
    ok = (await store.start_run("sync", {}, "ok")).run_id

    report = await reconcile(store, dry_run=True)
    assert report.text().splitlines()[:2] == [
        "Would write 1 pointer across 2 key groups; 1 already current.",
        "Dangling pointers (naming a run that no longer exists): 1.",
    ]
    assert (report.dangling, report.missing, report.stale) == (1, 0, 0)
    assert report.as_dict()["dangling"] == 1
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == chain[2], "dry run"

    repaired = await reconcile(store, dry_run=False)
    assert repaired.text().splitlines()[:2] == [
        "Wrote 1 pointer across 2 key groups; 1 already current.",
        "Dangling pointers (naming a run that no longer exists): 1.",
    ]
    assert (repaired.written, repaired.dangling, repaired.deleted) == (1, 1, 0)
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == chain[1]
    assert (await redis.hget(KEYS.pointer("ok"), "run")).decode() == ok
    rerun = await store.start_run("sync", {}, "k", on_terminal_match="rerun")
    assert rerun.rerun_of == chain[1]
    assert (await reconcile(store, dry_run=True)).to_write == 0


async def test_a_dangling_pointer_whose_key_has_no_run_left_is_removed(
    store: RunStore, redis: Redis
):
    gone = (await store.start_run("sync", {}, "k")).run_id
    await redis.delete(KEYS.run(gone))

    report = await reconcile(store, dry_run=True)
    assert report.text().splitlines()[:2] == [
        "Would write 1 pointer across 1 key group; 0 already current.",
        "Dangling pointers (naming a run that no longer exists): 1.",
    ]
    repaired = await reconcile(store, dry_run=False)
    assert repaired.text().splitlines()[:3] == [
        "Wrote 0 pointers across 1 key group; 0 already current.",
        "Dangling pointers (naming a run that no longer exists): 1.",
        "Deleted 1 dangling pointer: its key has no run left.",
    ]
    assert repaired.as_dict()["deleted"] == 1
    assert await redis.exists(KEYS.pointer("k"), KEYS.key_runs("k")) == 0
    # The key is free: a start begins afresh, superseding nothing.
    fresh = await store.start_run("sync", {}, "k")
    assert (fresh.deduped, fresh.rerun_of) == (False, None)
    assert (
        (await reconcile(store, dry_run=True))
        .text()
        .startswith("Would write 0 pointers across 1 key group; 1 already current.")
    )


async def test_a_pointer_naming_a_run_outside_its_set_is_dangling_when_the_run_is_gone(
    store: RunStore, redis: Redis
):
    chain = await rerun_chain(store, "k", 2)
    await redis.hset(KEYS.pointer("k"), "run", "00000000-0000-4000-8000-000000000000")
    report = await reconcile(store, dry_run=False)
    assert (report.dangling, report.written) == (1, 1)
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == chain[1]


async def test_a_repair_whose_reply_is_lost_reports_what_it_wrote(
    store: RunStore, redis: Redis, redis_server, config
):
    chains = {k: await rerun_chain(store, k, 2) for k in ("a", "b", "c")}
    for key, chain in chains.items():
        await redis.hset(KEYS.pointer(key), "run", chain[0])  # stale
    proxy = TcpProxy(redis_server.port).start()
    client = redis_client(proxy.url, 5.0)
    try:
        through_proxy = RunStore(client, config, timeout=5.0)
        proxy.drop_next_reply(b"EVALSHA")
        report = await reconcile(through_proxy, dry_run=False)
        assert not proxy.armed, "no repair went through the proxy"
    finally:
        await client.aclose()
        proxy.stop()
    # The first repair committed; its reply never arrived, the store resent the
    # pipeline on a new connection, and the resend reported what the first did.
    assert len(proxy.dropped) == 1
    assert proxy.dropped[0].reply.startswith(b"*3\r\n$7\r\nwritten")
    assert (report.stale, report.written, report.moved) == (3, 3, 0)
    for key, chain in chains.items():
        assert (await redis.hget(KEYS.pointer(key), "run")).decode() == chain[1]


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


class StartBetween(TcpProxy):
    """A proxy that, once, runs a start between two commands of one pipeline: after
    Redis has answered the command ``after`` (so it ran), and before the commands
    that follow it reach Redis. The race, made deterministic."""

    after: list[bytes] | None = None
    between: Callable[[], Awaitable[None]] | None = None

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
        pending: deque,
        client_port: int,
    ) -> None:
        buf = bytearray()
        sent = 0  # bytes of buf already forwarded
        while chunk := await reader.read(65536):
            buf += chunk
            at = 0
            while at < len(buf) and (parsed := parse_command(buf, at)) is not None:
                args, at = parsed
                entry = _Pending(args)
                pending.append(entry)
                if args == self.after and self.between is not None:
                    between, self.between = self.between, None
                    entry.answered = asyncio.Event()  # type: ignore[attr-defined]
                    redis_w.write(bytes(buf[sent:at]))
                    sent = at
                    await redis_w.drain()
                    await entry.answered.wait()  # type: ignore[attr-defined]
                    await between()
            redis_w.write(bytes(buf[sent:]))
            await redis_w.drain()
            del buf[:at]
            sent = len(buf)

    async def _replies(
        self, reader: asyncio.StreamReader, client_w: asyncio.StreamWriter, pending: deque
    ) -> None:
        buf = bytearray()
        while chunk := await reader.read(65536):
            buf += chunk
            at = 0
            while at < len(buf) and (end := resp_end(buf, at)) is not None:
                at = end
                entry = pending.popleft()
                if hasattr(entry, "answered"):
                    entry.answered.set()
            client_w.write(bytes(buf[:at]))
            await client_w.drain()
            del buf[:at]


async def test_a_start_between_the_walks_reads_keeps_its_pointer_and_one_live_run(
    store: RunStore, redis: Redis, redis_server, config
):
    first = await store.start_run("sync", {}, "k")
    second = await store.start_run("sync", {}, "k", on_live_match="cancel_existing")
    started: list[str] = []

    async def start_meanwhile() -> None:
        # In the proxy's own loop, straight to Redis: the walk has read the key's run
        # set ([first, second]) but not yet its pointer.
        client = redis_client(redis_server.url, 5.0)
        racing = RunStore(client, config, timeout=5.0)
        result = await racing.start_run("sync", {}, "k", on_live_match="cancel_existing")
        started.append(result.run_id)
        await client.aclose()

    proxy = StartBetween(redis_server.port)
    proxy.after = [b"ZRANGE", KEYS.key_runs("k").encode(), b"0", b"-1"]
    proxy.between = start_meanwhile
    proxy.start()
    client = redis_client(proxy.url, 5.0)
    try:
        report = await reconcile(RunStore(client, config, timeout=5.0), dry_run=False)
    finally:
        await client.aclose()
        proxy.stop()
    assert len(started) == 1, "the start did not run between the walk's reads"
    third = started[0]
    # The walk read the pointer after the start moved it, so it took the pointer for
    # stale; the repair, deciding from the set as it is, leaves it at the newest run.
    assert (report.stale, report.written, report.moved) == (1, 0, 1)
    assert (await redis.hget(KEYS.pointer("k"), "run")).decode() == third
    again = await store.start_run("sync", {}, "k", on_live_match="cancel_existing")
    assert again.rerun_of == third
    runs, _ = await store.list_runs("sync", key="k")
    assert [(r.id, r.phase) for r in runs] == [
        (again.run_id, "running"),
        (third, "cancelled"),
        (second.run_id, "cancelled"),
        (first.run_id, "cancelled"),
    ]


# -- the key index: a walk reads its workflow's keys, not the keyspace ----------

PARTITIONED = """
version: 1
workflows:
  hot:
    steps: [go]
    partitions: 4
"""


async def _key_index(redis: Redis, keys: Keys = KEYS) -> dict[str, int]:
    return {m.decode(): int(s) for m, s in await redis.zrange(keys.key_index(), 0, -1,
                                                              withscores=True)}  # fmt: skip


async def _calls(redis: Redis) -> dict[str, int]:
    """Commands the server ran since the last CONFIG RESETSTAT, by name."""
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


async def test_every_claim_that_writes_a_pointer_indexes_its_key_at_the_claims_time(
    store: RunStore, redis: Redis
):
    before = await redis.time()
    a = await store.start_run("sync", {}, "a")
    await store.start_run("sync", {})  # no key: nothing to index
    await store.start_run_batch(
        "sync", [{"idempotency_key": "b"}, {"idempotency_key": "c"}, {"idempotency_key": "a"}]
    )
    await store.start_run("deploy", {"repo": "o/r", "sha": "abcdef0"}, "d")
    first = await _key_index(redis)
    assert set(first) == {"a", "b", "c"}
    assert set(await _key_index(redis, Keys("realm", "deploy"))) == {"d"}
    # Scored like the run index: the server's time in µs at the claim.
    assert first["a"] >= before[0] * 1_000_000 + before[1]
    assert first["a"] == int(await redis.zscore(KEYS.key_runs("a"), a.run_id))
    # A repeat that starts nothing writes nothing; a rerun claims the key again.
    assert (await store.start_run("sync", {}, "a")).deduped
    await store.cancel_run(a.run_id)
    rerun = await store.start_run("sync", {}, "a", on_terminal_match="rerun")
    second = await _key_index(redis)
    assert second["a"] == int(await redis.zscore(KEYS.key_runs("a"), rerun.run_id)) > first["a"]
    assert {k: second[k] for k in "bc"} == {k: first[k] for k in "bc"}


async def test_a_partitioned_workflow_indexes_each_key_in_its_partition(redis: Redis):
    from gateway.loading import parse_config

    hot = RunStore(redis, parse_config(PARTITIONED, with_triggers=False), timeout=5.0)
    names = [f"key-{i}" for i in range(20)]
    for name in names[:10]:
        await hot.start_run("hot", {}, name)
    await hot.start_run_batch("hot", [{"idempotency_key": n} for n in names[10:]])
    indexed = {}
    for keys in hot.partitions("hot"):
        for name in await _key_index(redis, keys):
            indexed[name] = keys
    assert {n: indexed[n] for n in names} == {n: hot.keys_for_key("hot", n) for n in names}
    await redis.delete(*(hot.keys_for_key("hot", n).pointer(n) for n in names[::2]))
    report = await reconcile(hot, dry_run=False)
    assert (report.groups, report.missing, report.written) == (20, 10, 10)


async def test_reconcile_of_one_workflow_reads_its_own_keys_and_no_other(
    store: RunStore, redis: Redis
):
    """Before the key index, the walk read the whole keyspace (SCAN MATCH) once per workflow."""
    ids = [(await store.start_run("sync", {}, f"s{i}")).run_id for i in range(3)]
    await redis.delete(KEYS.pointer("s1"))
    items = [{"params": {"repo": "o/r", "sha": f"{i:07x}"}, "idempotency_key": f"d{i}"}
             for i in range(300)]  # fmt: skip
    await store.start_run_batch("deploy", items)
    await redis.config_resetstat()

    report = await reconcile(store, workflow="sync", dry_run=True)

    assert report.text().splitlines()[:2] == [
        "Would write 1 pointer across 3 key groups; 2 already current.",
        "Missing pointers: 1; stale pointers: 0.",
    ]
    calls = await _calls(redis)
    assert "scan" not in calls
    # One ZSCAN of the index; per key group one read of its run set and one of its
    # pointer; one EXISTS per run: three keys' worth, none of deploy's 300.
    assert {c: calls.get(c, 0) for c in ("zscan", "zrange", "hget", "exists")} == {
        "zscan": 1, "zrange": 3, "hget": 3, "exists": 3,
    }  # fmt: skip
    assert (await reconcile(store, workflow="sync", dry_run=False)).written == 1
    assert (await redis.hget(KEYS.pointer("s1"), "run")).decode() == ids[1]


async def test_a_dangling_pointer_whose_run_set_is_gone_too_is_found_through_the_index(
    store: RunStore, redis: Redis
):
    """A SCAN for run sets never saw a pointer left without one; the index holds the key."""
    gone = (await store.start_run("sync", {}, "k")).run_id
    await redis.delete(KEYS.run(gone), KEYS.key_runs("k"))

    report = await reconcile(store, dry_run=True)
    assert report.text().splitlines() == [
        "Would write 1 pointer across 1 key group; 0 already current.",
        "Dangling pointers (naming a run that no longer exists): 1.",
        "Duplicate-key groups: 0",
    ]
    repaired = await reconcile(store, dry_run=False)
    assert repaired.text().splitlines()[2] == (
        "Deleted 1 dangling pointer: its key has no run left."
    )
    assert await redis.exists(KEYS.pointer("k")) == 0
    fresh = await store.start_run("sync", {}, "k")
    assert (fresh.deduped, fresh.rerun_of) == (False, None)


async def test_keys_claimed_before_the_index_are_found_by_a_scan_which_indexes_them(
    store: RunStore, redis: Redis
):
    """Data written by a gateway without the key index: the index walk cannot see it;
    ``scan=True`` walks the keyspace as before and, when it repairs, indexes each key."""
    chain = await rerun_chain(store, "dup", 2)
    missing = (await store.start_run("sync", {}, "missing")).run_id
    ok = (await store.start_run("sync", {}, "ok")).run_id
    await store.start_run("deploy", {"repo": "o/r", "sha": "abcdef0"}, "other")
    claimed = await _key_index(redis)
    await redis.delete(KEYS.key_index(), KEYS.pointer("missing"))  # as an old gateway left it

    assert (await reconcile(store, workflow="sync", dry_run=True)).text().splitlines()[0] == (
        "Would write 0 pointers across 0 key groups; 0 already current."
    )
    scanned = await reconcile(store, workflow="sync", dry_run=True, scan=True)
    assert scanned.text().splitlines()[:2] == [
        "Would write 1 pointer across 3 key groups; 2 already current.",
        "Missing pointers: 1; stale pointers: 0.",
    ]
    assert await redis.exists(KEYS.key_index()) == 0, "a dry run writes nothing"

    repaired = await reconcile(store, workflow="sync", dry_run=False, scan=True)
    assert repaired.text().startswith("Wrote 1 pointer across 3 key groups; 2 already current.")
    # Each key indexed at the time of its last claim, as the claim itself would have.
    assert await _key_index(redis) == claimed
    assert (await redis.hget(KEYS.pointer("missing"), "run")).decode() == missing
    after = await reconcile(store, workflow="sync", dry_run=True)
    assert after.text().splitlines()[0] == (
        "Would write 0 pointers across 3 key groups; 3 already current."
    )
    assert {d.canonical for d in after.duplicates} == {chain[1]}
    assert (await redis.hget(KEYS.pointer("ok"), "run")).decode() == ok


async def test_the_cli_takes_scan(store: RunStore, redis: Redis, redis_server, tmp_path):
    from tests.conftest import WORKFLOWS_YAML
    from tests.test_cli import realm

    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    await store.start_run("sync", {}, "k")
    await redis.delete(KEYS.key_index())

    def reconcile_cli(*args: str) -> str:
        done = realm("run", "reconcile", *args, "--redis-url", redis_server.url, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()[0]

    assert reconcile_cli("--dry-run") == (
        "Would write 0 pointers across 0 key groups; 0 already current."
    )
    assert reconcile_cli("--scan") == "Wrote 0 pointers across 1 key group; 1 already current."
    assert reconcile_cli("--dry-run") == (
        "Would write 0 pointers across 1 key group; 1 already current."
    )
