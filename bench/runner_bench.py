"""Runners: steps per second through N runner processes, and the latency from a
webhook's 202 to its run's first step handler starting, beside `realm listen`.

    python bench/runner_bench.py [--runners 1,2,4] [--concurrency 8] [--runs 2000]
                                 [--rates 1,100,300] [--seconds 5] [--samples 60] [--quick]

Everything runs on 127.0.0.1 and stops by itself: a private redis-server on a free
port (no persistence) and runner processes, each one in-process ``Runner``
(gateway/runners/runner.py) of ``--concurrency`` handlers whose handlers do nothing but
return a small output (what is measured is the runner machinery: take with a lease,
record with the lease, the next step queued).

1. Throughput: for each N in ``--runners``, N runner processes are started and
   idle; ``--runs`` runs of the 3-step workflow are started in batches, and the
   clock runs from the first batch to the last step recorded (runs x 3 steps).
2. Latency, in the same run as the listener: `realm listen` (1 worker, the bench
   config of bench/listen_bench.py) takes signed GitHub push deliveries from a
   minimal asyncio sender at a fixed rate (``--rates``, per second, for ``--seconds``, or
   longer at a low rate, to send ``--samples`` deliveries at least), with 2 runner
   processes taking the steps. At 1 per second the runners are idle between
   deliveries: what is measured is how soon an idle runner starts a step that became
   ready. For each delivery answered 202 the time
   the reply arrived is joined (by run id) with the time the run's ``fetch``
   handler started, on the same host clock: p50, p99 and max of the difference.
   A negative difference (the handler started before the sender read the 202) is
   counted as it is.

``--runners ''`` skips the throughput part, ``--rates ''`` the latency part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.listen_bench import PATH, TRIGGERS_YAML, App, gateway_app, push_payload  # noqa: E402
from tests.servers import RedisServer  # noqa: E402
from tests.signing import github_signature  # noqa: E402

PYTHON = sys.executable
WORKFLOW = "deploy"
STEPS = 3  # fetch, build, release (TRIGGERS_YAML)
SENDER_CONNECTIONS = 32
RUN_ID = re.compile(rb'"run_id":"([0-9a-f-]{36})"')


# --------------------------------------------------------------------------- a runner process


def runner_process(args: argparse.Namespace) -> None:
    """One runner process: a Runner over the bench workflow; counts recorded steps in
    ``--count-file`` (rewritten every 50 ms) and appends ``<run id> <wall time>`` to
    ``--starts-file`` when a run's first step handler starts."""
    from gateway.link.connection import redis_client
    from gateway.loading import load_config
    from gateway.runners.runner import Runner, StepOutcome
    from gateway.store.runstore import RunStore

    starts = os.open(args.starts_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    recorded = 0

    async def fetch(step) -> dict:
        os.write(starts, f"{step.run_id} {time.time():.6f}\n".encode())
        return {"step": step.step}

    async def other(step) -> dict:
        return {"step": step.step}

    def counted(outcome: StepOutcome) -> None:
        nonlocal recorded
        recorded += outcome.result == "ok"

    async def main() -> None:
        config = load_config(args.config, with_triggers=False)
        store = RunStore(redis_client(args.redis_url, 5.0), config, timeout=5.0)
        runner = Runner(store, WORKFLOW, {"fetch": fetch, "build": other, "release": other},
                        concurrency=args.concurrency, on_outcome=counted)  # fmt: skip
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, runner.stop)
        task = asyncio.create_task(runner.run())
        count_file = Path(args.count_file)
        while not task.done():
            tmp = count_file.with_suffix(".tmp")
            tmp.write_text(str(recorded))
            tmp.replace(count_file)
            await asyncio.wait([task], timeout=0.05)
        await task

    asyncio.run(main())


class Runners:
    """N runner processes of this script, each with its count and starts files."""

    def __init__(self, folder: Path, redis_url: str, config: Path, n: int, concurrency: int):
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []
        self.counts = [folder / f"count{i}" for i in range(n)]
        self.starts = [folder / f"starts{i}" for i in range(n)]
        for i in range(n):
            cmd = [PYTHON, __file__, "--runner-process", "--redis-url", redis_url,
                   "--config", str(config), "--concurrency", str(concurrency),
                   "--count-file", str(self.counts[i]),
                   "--starts-file", str(self.starts[i])]  # fmt: skip
            with (folder / f"runner{i}.log").open("ab") as log:
                self.procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                )

    def recorded(self) -> int | None:
        """Steps recorded by all runners; None until every runner is up."""
        total = 0
        for i, path in enumerate(self.counts):
            if self.procs[i].poll() is not None:
                log = (self.folder / f"runner{i}.log").read_text(errors="replace")
                raise RuntimeError(f"runner {i} exited {self.procs[i].returncode}:\n{log[-2000:]}")
            try:
                total += int(path.read_text() or 0)
            except FileNotFoundError:
                return None
        return total

    def wait(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not within {timeout} s: {what}")
            time.sleep(0.01)

    def started(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for path in self.starts:
            if path.exists():
                for line in path.read_text().splitlines():
                    run_id, at = line.split()
                    out.setdefault(run_id, float(at))
        return out

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------- measurements


def throughput(server: RedisServer, config: Path, folder: Path, n: int, args) -> float:
    """Steps per second through n runner processes: runs x 3 steps / seconds."""
    import redis as redis_sync

    from gateway.link.connection import redis_client
    from gateway.loading import load_config
    from gateway.store.runstore import RunStore

    with redis_sync.Redis.from_url(server.url) as db:
        db.flushall()
    here = folder / f"throughput-{n}"
    here.mkdir()
    runners = Runners(here, server.url, config, n, args.concurrency)
    try:
        runners.wait("runners up", lambda: runners.recorded() is not None, 60)

        async def start_all() -> None:
            store = RunStore(redis_client(server.url, 10.0),
                             load_config(config, with_triggers=False), timeout=10.0)  # fmt: skip
            rng = random.Random(n)
            for first in range(0, args.runs, 500):
                items = [{"params": {"repo": "acme/api", "sha": f"{rng.getrandbits(160):040x}"}}
                         for _ in range(min(500, args.runs - first))]  # fmt: skip
                await store.start_run_batch(WORKFLOW, items)
            await store.redis.aclose()

        t0 = time.monotonic()
        asyncio.run(start_all())
        want = args.runs * STEPS
        runners.wait("every step recorded", lambda: (runners.recorded() or 0) >= want, 300)
        return want / (time.monotonic() - t0)
    finally:
        runners.stop()


async def send_at_rate(port: int, secret: bytes, rate: int, seconds: float):
    """Signed push deliveries at ``rate`` per second over keep-alive connections of a
    minimal HTTP/1.1 client of asyncio streams (pre-built requests: the sender must
    cost far less than the listener, on a 2-core machine): [(wall time the 202 was
    read, run id)], and each 202's reply latency (ms) as the sender saw it."""
    rng = random.Random(rate)
    requests = []
    for i in range(int(rate * seconds)):
        body = json.dumps(push_payload(rng, i), separators=(",", ":")).encode()
        head = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Content-Type: application/json\r\nX-GitHub-Event: push\r\n"
                f"X-GitHub-Delivery: {uuid.uuid4()}\r\n"
                f"X-Hub-Signature-256: {github_signature(secret, body)}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        requests.append(head.encode() + body)
    got: list[tuple[float, str]] = []
    reply_ms: list[float] = []
    other: list[int] = []
    free: asyncio.Queue = asyncio.Queue()
    for _ in range(SENDER_CONNECTIONS):
        free.put_nowait(await asyncio.open_connection("127.0.0.1", port))

    async def one(conn, request: bytes, sent: float) -> None:
        reader, writer = conn
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        body = await reader.readexactly(int(length.group(1)) if length else 0)
        at = time.time()
        free.put_nowait(conn)
        status = int(head.split(b" ", 2)[1])
        if status != 202:
            other.append(status)
            return
        reply_ms.append((time.monotonic() - sent) * 1000)
        got.append((at, RUN_ID.search(body).group(1).decode()))

    t0 = time.monotonic()
    tasks = []
    for i, request in enumerate(requests):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        conn = await free.get()
        tasks.append(asyncio.create_task(one(conn, request, time.monotonic())))
    await asyncio.gather(*tasks)
    while not free.empty():
        free.get_nowait()[1].close()
    if other:
        print(f"  {len(other)} replies were not 202: {sorted(set(other))}")
    return got, reply_ms


def latency(server: RedisServer, config: Path, folder: Path, rate: int, args) -> dict:
    import redis as redis_sync

    with redis_sync.Redis.from_url(server.url) as db:
        db.flushall()
    here = folder / f"latency-{rate}"
    here.mkdir()
    secret = os.urandom(16).hex().encode()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    env["GITHUB_WEBHOOK_SECRET"] = secret.decode()
    app: App = gateway_app(config, server.url, 1, env, here)
    runners = Runners(here, server.url, config, 2, args.concurrency)
    try:
        app.start()
        runners.wait("runners up", lambda: runners.recorded() is not None, 60)
        seconds = max(args.seconds, args.samples / rate)
        got, reply_ms = asyncio.run(send_at_rate(app.port, secret, rate, seconds))
        want = len(got) * STEPS
        runners.wait("every step recorded", lambda: (runners.recorded() or 0) >= want, 120)
        started = runners.started()
        waits = sorted((started[run_id] - at) * 1000 for at, run_id in got)
        return {"rate": rate, "accepted": len(got), "reply_ms": sorted(reply_ms),
                "waits": waits, "negative": sum(w < 0 for w in waits)}  # fmt: skip
    finally:
        runners.stop()
        app.stop()


def pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rates", default="1,100,300")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--samples",
        type=int,
        default=60,
        help="deliveries per rate at least (a low rate sends for longer)",
    )
    parser.add_argument("--quick", action="store_true", help="small numbers: a smoke run")
    parser.add_argument("--runner-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--count-file", help=argparse.SUPPRESS)
    parser.add_argument("--starts-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner_process:
        runner_process(args)
        return 0
    if args.quick:
        args.runners, args.runs, args.rates, args.seconds = "1,2", 300, "50", 2.0
        args.samples = 0

    with tempfile.TemporaryDirectory(prefix="runner-bench-") as tmp:
        folder = Path(tmp)
        config = folder / "triggers.yaml"
        config.write_text(TRIGGERS_YAML)
        server = RedisServer(folder / "redis").start()
        try:
            print(f"runner bench: {os.cpu_count()} cores, {args.runs} runs x {STEPS} steps, "
                  f"{args.concurrency} handlers per runner process, no-op handlers\n")  # fmt: skip
            print(f"{'runner processes':>17} | {'steps/s':>8} | {'runs/s':>7}")
            print(f"{'-' * 17}-+-{'-' * 8}-+-{'-' * 7}")
            for n in (int(x) for x in args.runners.split(",") if x):
                rate = throughput(server, config, folder, n, args)
                print(f"{n:>17} | {rate:>8.0f} | {rate / STEPS:>7.0f}", flush=True)
            rates = [int(x) for x in args.rates.split(",") if x]
            if not rates:
                return 0
            print(f"\nwebhook 202 -> first step handler started, `realm listen` (1 worker) + "
                  f"2 runner processes, {args.seconds:g} s per rate (at least "
                  f"{args.samples} deliveries)\n")  # fmt: skip
            head = (f"{'rate/s':>6} | {'202s':>5} | {'reply p50':>9} | {'reply p99':>9} | "
                    f"{'start p50':>9} | {'start p99':>9} | {'start max':>9} | neg")  # fmt: skip
            print(head)
            print("-" * len(head))
            for r in rates:
                row = latency(server, config, folder, r, args)
                w, rep = row["waits"], row["reply_ms"]
                print(f"{r:>6} | {row['accepted']:>5} | {pct(rep, 50):>7.1f}ms | "
                      f"{pct(rep, 99):>7.1f}ms | {pct(w, 50):>7.1f}ms | {pct(w, 99):>7.1f}ms | "
                      f"{w[-1]:>7.1f}ms | {row['negative']}", flush=True)  # fmt: skip
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
