"""Reconcile repairing in a loop while three OS processes rerun keys.

Three processes start runs on 120 keys with ``cancel_existing`` (a live run is
cancelled and replaced in the claim's own script) and ``rerun`` (an ended run is
replaced), so every start supersedes the key's run. A fourth process loops
``reconcile(dry_run=False)`` (two walks at a time) beside a client that keeps the
server busy with a short read-only script, as other tenants of a shared Redis do.

The window: a walk reads each key's run set and pointer in one pipeline, and the
keys are long (1 KiB, the limit), so the pipeline spans several of the 16 KiB
chunks Redis reads a client's commands in; between two chunks Redis serves the
other clients (the busy script, and the starts that arrive meanwhile). A start
landing between a key's set and its pointer made the walk take the pointer for
stale, and the old repair then pointed the key back at the run that start had
just cancelled: the next start reran that one, and the live run was never ended.

The store is consistent throughout (every start is one atomic claim), so at the
end: no repair wrote anything, no run was superseded twice, no key has more than
one live run, and every pointer names the newest run of its key. The test prints
``FIGURES reconcile-stress: ...`` (docs/reliability.md quotes it).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from collections import Counter
from multiprocessing.synchronize import Barrier

import pytest
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.errors import StoreUnavailable
from gateway.store.keys import Keys
from gateway.store.reconcile import reconcile
from gateway.store.runstore import RunStore

STARTERS = 3
# Long keys (the limit is 1 KiB): a walk's reads span several 16 KiB chunks.
HOT_KEYS = [f"hot-{i}-" + "k" * 1000 for i in range(120)]
DURATION = 12.0  # seconds of racing; each process also stops after MAX_CALLS
MAX_CALLS = 200_000
REPAIR_LOOPS = 2  # concurrent reconcile walks in the repairing process
START_LOOPS = 2  # concurrent starts in each starting process
KEYS = Keys("realm", "sync")
BUSY_LUA = """#!lua flags=no-writes
local i = 0
while i < tonumber(ARGV[1]) do i = i + 1 end
return i
"""
BUSY_SPINS = 30_000  # a few milliseconds of Lua (3.4 ms on the CI machine kind)
# A 1 s retention keeps the store small (superseded runs expire), so one repair
# pass reads every hot key in one or two ZSCAN batches of the key index, many passes
# a second.
CONFIG = """
version: 1
workflows:
  sync:
    steps: [fetch, load]
    retention: 1s
"""


def _store(url: str) -> tuple[Redis, RunStore]:
    client = redis_client(url, 10.0)
    return client, RunStore(client, parse_config(CONFIG, with_triggers=False), timeout=10)


def _starter(url: str, seed: int, barrier: Barrier, out: multiprocessing.Queue) -> None:
    async def loop(store: RunStore, rng: random.Random, end: float, superseded: list[str]) -> None:
        starts = 0
        while time.monotonic() < end and starts < MAX_CALLS:
            result = await store.start_run(
                "sync", {}, rng.choice(HOT_KEYS),
                on_live_match="cancel_existing", on_terminal_match="rerun",
            )  # fmt: skip
            starts += 1
            superseded.append(result.rerun_of or "")

    async def main() -> list[str]:
        client, store = _store(url)
        await client.ping()
        barrier.wait(timeout=60)
        end = time.monotonic() + DURATION
        superseded: list[str] = []  # per start, the run it superseded ('' = none)
        await asyncio.gather(
            *(loop(store, random.Random(seed * 100 + n), end, superseded)
              for n in range(START_LOOPS))
        )  # fmt: skip
        await client.aclose()
        return superseded

    out.put(("starts", asyncio.run(main())))


def _repairer(url: str, barrier: Barrier, out: multiprocessing.Queue) -> None:
    async def loop(store: RunStore, end: float, tally: list[int]) -> None:
        passes = 0
        while time.monotonic() < end and passes < MAX_CALLS:
            try:
                report = await reconcile(store, workflow="sync", dry_run=False)
            except StoreUnavailable:
                tally[3] += 1
                continue
            passes += 1
            tally[0] += 1
            tally[1] += report.written
            tally[2] += report.moved

    async def busy(client: Redis, end: float) -> None:
        # Other work on the server, as a shared Redis has: a read-only script of a
        # few milliseconds, again and again. Redis runs it between two chunks of a walk's
        # reads, and the starts that arrive meanwhile run there too.
        spin = client.register_script(BUSY_LUA)
        calls = 0
        while time.monotonic() < end and calls < MAX_CALLS:
            await spin(args=[BUSY_SPINS])
            calls += 1

    async def main() -> list[int]:
        client, store = _store(url)
        await client.ping()
        barrier.wait(timeout=60)
        end = time.monotonic() + DURATION
        tally = [0, 0, 0, 0]  # passes, written, moved, unavailable
        await asyncio.gather(
            busy(client, end), *(loop(store, end, tally) for _ in range(REPAIR_LOOPS))
        )
        await client.aclose()
        return tally

    out.put(("repairs", asyncio.run(main())))


async def _live_runs(redis: Redis, key: str) -> tuple[list[str], list[str]]:
    """The key's run ids, oldest first, and those of them that are live."""
    members = [m.decode() for m in await redis.zrange(KEYS.key_runs(key), 0, -1)]
    async with redis.pipeline(transaction=False) as pipe:
        for run_id in members:
            pipe.hget(KEYS.run(run_id), "phase")
        phases = await pipe.execute()
    return members, [r for r, p in zip(members, phases, strict=True) if p == b"running"]


@pytest.mark.slow
async def test_repairs_racing_reruns_never_leave_two_live_runs_or_an_old_pointer(
    redis: Redis, redis_server
):
    store = RunStore(redis, parse_config(CONFIG, with_triggers=False), timeout=10)
    for key in HOT_KEYS:
        await store.start_run("sync", {}, key)

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(STARTERS + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_starter, args=(redis_server.url, seed, barrier, out))
        for seed in range(STARTERS)
    ] + [ctx.Process(target=_repairer, args=(redis_server.url, barrier, out))]
    for p in procs:
        p.start()
    results = [out.get(timeout=DURATION + 90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    superseded = [r for kind, runs in results if kind == "starts" for r in runs]
    starts = len(superseded)
    # Every start supersedes the key's newest run: a run superseded twice means a
    # start found the key pointing at a run that an earlier start had superseded.
    twice = sum(n > 1 for run, n in Counter(superseded).items() if run)
    passes, written, moved, unavailable = next(r for kind, r in results if kind == "repairs")
    two_live = 0
    old_pointer = 0
    for key in HOT_KEYS:
        members, live = await _live_runs(redis, key)
        two_live += len(live) > 1
        pointer = (await redis.hget(KEYS.pointer(key), "run")).decode()
        old_pointer += pointer != members[-1]
    print(
        f"\nFIGURES reconcile-stress: duration={DURATION:g}s starters={STARTERS}x{START_LOOPS} "
        f"hot_keys={len(HOT_KEYS)} starts={starts} "
        f"repair_loops={REPAIR_LOOPS} repair_passes={passes} written={written} moved={moved} "
        f"unavailable={unavailable} "
        f"runs_superseded_twice={twice} keys_with_two_live_runs={two_live} "
        f"pointers_not_at_newest={old_pointer}"
    )
    assert starts > 0 and passes > 0
    # The store was consistent all along (every start is one atomic claim), so a
    # repair that wrote anything pointed a key away from its newest run.
    assert (written, twice, two_live, old_pointer) == (0, 0, 0, 0)
    # Each key's newest run is its one live run (every start superseded the last).
    for key in HOT_KEYS:
        members, live = await _live_runs(redis, key)
        assert live == [members[-1]]
