"""The spool's cost and speed (gateway/spool/, gateway/ingest/drain.py), on loopback.

    python bench/spool_bench.py [--rounds 3] [--duration 3] [--spool 5000] [--capped 1000]
                                [--quick]

(a) The hot path with the spool on but idle (Redis answers, nothing is spooled)
    beside ``settings.spool: false``: `realm listen` (1 worker) on each, driven by
    wrk with the signed 3 KB GitHub pushes of bench/listen_bench.py on 64
    connections, in interleaved rounds (off on, on off, off on, ...); each row is its
    median round by req/s. After each round the runs in Redis are counted against
    the distinct delivery ids wrk sent.
(b) The drain. Redis is killed and ``--spool`` distinct deliveries are posted on 64
    keep-alive connections (and 500 more on one connection: one fsync each, no
    group commit), every one answered 202 ``accepted``: the spool's append rate.
    Then Redis is started again on its port, and the runs are counted 20 times a
    second until every spooled delivery has its run: the drain rate, with
    ``drain_rate: 100000`` (as fast as it goes) and with the default 200 a second
    (``--capped`` deliveries), which must hold.

Everything runs on 127.0.0.1 and stops by itself: a private redis-server on a free
port (tests/servers.py), the gateways in their own process groups (bench/listen_bench.py's
``App``), wrk with a timeout. The load generator of (b) is a small asyncio client
in this process (wrk sends for a time, not a count): it shares the machine's CPUs
with the gateway and Redis, as wrk does in (a).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import os
import random
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.listen_bench import (  # noqa: E402
    BODIES,
    GATEWAY_RUNS,
    PATH,
    TRIGGERS_YAML,
    App,
    WrkResult,
    distinct_sent,
    encode,
    gateway_app,
    gateway_revision,
    push_payload,
    run_wrk,
    write_requests,
)
from tests.servers import RedisServer  # noqa: E402
from tests.signing import github_headers  # noqa: E402

CONNECTIONS = 64
SERIAL = 500  # deliveries spooled on one connection: one fsync each


def config(spool: str) -> str:
    return f"{TRIGGERS_YAML}settings:\n  spool: {spool}\n"


def start_gateway(name: str, spool: str, redis_url: str, env: dict[str, str], work: Path) -> App:
    """`realm listen`, 1 worker, run in ``work`` (its data folder, `.realm`, is there)."""
    folder = work / name
    folder.mkdir()
    path = folder / "triggers.yaml"
    path.write_text(config(spool))
    app = gateway_app(path, redis_url, 1, env, folder, name=name)
    app.cwd = folder
    return app.start()


def spool_metric(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = [float(v) for v in re.findall(rf"^{name} (\S+)$", text, re.M)]
    if not values:
        raise RuntimeError(f"/metrics has no {name}")
    return sum(values)


# --------------------------------------------------------------------------- (a) hot path


@dataclass
class Round:
    app: str
    result: WrkResult
    runs: int
    expected: int


def hot_path(args: argparse.Namespace, r: redis.Redis, apps: list[App], reqs: Path,
             ids: list[str]) -> dict[str, list[Round]]:  # fmt: skip
    wrk = SimpleNamespace(threads=2, connections=CONNECTIONS)
    rounds: dict[str, list[Round]] = {app.name: [] for app in apps}
    for app in apps:  # warm once: later rounds find it warm
        run_wrk(app.port, reqs, args.warmup, wrk)
        r.flushall()
    for n in range(1, args.rounds + 1):
        # A B, B A, A B ...: whatever favours the first (or second) run of a round
        # favours each app alike.
        for app in apps if n % 2 else apps[::-1]:
            result = run_wrk(app.port, reqs, args.duration, wrk)
            time.sleep(0.3)  # the last in-flight deliveries land
            got = Round(app.name, result, int(r.zcard(GATEWAY_RUNS)),
                        distinct_sent(ids, wrk.threads, result.sent))  # fmt: skip
            rounds[app.name].append(got)
            print(f"  (a) {app.name:<11} [{n}/{args.rounds}] {result.rps:7.0f} req/s  "
                  f"p50 {result.p50_ms:5.2f} ms  p99 {result.p99_ms:6.2f} ms  runs "
                  f"{got.runs}/{got.expected}  load {os.getloadavg()[0]:.1f}",
                  flush=True)  # fmt: skip
            r.flushall()
    return rounds


def median(rounds: list[Round]) -> tuple[Round, float]:
    """The median round by req/s, and the spread: (max - min) / median."""
    ranked = sorted(rounds, key=lambda x: x.result.rps)
    mid = statistics.median(x.result.rps for x in ranked)
    return ranked[(len(ranked) - 1) // 2], (ranked[-1].result.rps - ranked[0].result.rps) / mid


# --------------------------------------------------------------------------- (b) drain


def signed_requests(n: int, port: int, secret: str, seed: int) -> list[bytes]:
    """``n`` distinct 3 KB GitHub pushes as raw HTTP/1.1 requests."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = encode(push_payload(rng, i, **BODIES["3k"]))  # type: ignore[arg-type]
        delivery = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        headers = github_headers(body, secret, delivery=delivery)
        head = [f"POST {PATH} HTTP/1.1", f"Host: 127.0.0.1:{port}",
                f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
        out.append(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return out


@dataclass
class Sent:
    seconds: float
    latencies: list[float]
    replies: list[tuple[int, bytes]]


async def post_all(port: int, requests: list[bytes], connections: int) -> Sent:
    """Each request once, on ``connections`` keep-alive connections."""
    queue = iter(requests)
    latencies: list[float] = []
    replies: list[tuple[int, bytes]] = []

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for raw in queue:
            t = time.perf_counter()
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: (\d+)", head)
            body = await reader.readexactly(int(length.group(1)) if length else 0)
            latencies.append(time.perf_counter() - t)
            replies.append((int(head[9:12]), body))
        writer.close()

    start = time.perf_counter()
    async with asyncio.timeout(300):
        await asyncio.gather(*(connection() for _ in range(connections)))
    return Sent(time.perf_counter() - start, latencies, replies)


def spool_phase(port: int, requests: list[bytes], connections: int) -> Sent:
    sent = asyncio.run(post_all(port, requests, connections))
    bad = [(s, b[:200]) for s, b in sent.replies if s != 202 or b'"outcome":"accepted"' not in b]
    if bad:
        raise RuntimeError(f"{len(bad)} deliveries not accepted into the spool, e.g. {bad[0]}")
    return sent


@dataclass
class Drain:
    records: int
    wait_s: float  # Redis back -> first run claimed (the drain's backoff, at most 5 s)
    seconds: float  # first run -> last run

    @property
    def rate(self) -> float:
        return (self.records - 1) / self.seconds if self.seconds else 0.0


def drain_phase(app: App, r: redis.Redis, server: RedisServer, records: int) -> Drain:
    server.start()  # the same port: the gateway reconnects by itself
    back = time.monotonic()
    first = None
    deadline = back + 60 + records / 100
    while (runs := int(r.zcard(GATEWAY_RUNS))) < records:
        now = time.monotonic()
        if first is None and runs:
            first = now
        if now > deadline:
            raise RuntimeError(f"{app.name}: {runs} of {records} drained in {now - back:.0f} s")
        time.sleep(0.05)
    last = time.monotonic()
    left = spool_metric(app.port, "realm_spool_records")
    if runs != records or left:
        raise RuntimeError(f"{app.name}: {runs} runs for {records} deliveries, {left} left")
    first = first or last
    return Drain(records, first - back, last - first)


def p(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(int(q * len(ranked)), len(ranked) - 1)] * 1000


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="(a) interleaved rounds per app")
    parser.add_argument("--duration", type=float, default=3.0, help="(a) seconds per wrk run")
    parser.add_argument("--warmup", type=float, default=1.0, help="(a) seconds of warm-up")
    parser.add_argument("--spool", type=int, default=5000, help="(b) deliveries spooled")
    parser.add_argument("--capped", type=int, default=1000,
                        help="(b) deliveries drained at the default drain_rate, 200/s")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 2 s; 1000 and 400 deliveries (≈ 20 s)")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.spool, args.capped = 1, 2.0, 1000, 400
    if not shutil.which("wrk"):
        print("error: wrk not found on PATH; install it with: apt-get install -y wrk",
              file=sys.stderr)  # fmt: skip
        return 2
    secret = secrets.token_hex(20)
    load_before = os.getloadavg()
    started: list[App] = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="realm-spool-")))
        server = RedisServer(work / "redis")
        stack.callback(server.stop)
        server.start()
        r = redis.Redis.from_url(server.url)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("REALM_")},
               "GITHUB_WEBHOOK_SECRET": secret, "PYTHONPATH": str(ROOT)}  # fmt: skip
        try:
            # (a)
            reqs = write_requests(work / "3k.tsv", 20_000, secret.encode(), redeliver=False,
                                  seed=1, body="3k", threads=2)  # fmt: skip
            apps = [start_gateway("spool-off", "false", server.url, env, work),
                    start_gateway("spool-idle", "true", server.url, env, work)]  # fmt: skip
            started += apps
            rounds = hot_path(args, r, apps, reqs.path, reqs.ids)
            for app in apps:
                app.stop()
            # (b)
            drains: list[tuple[str, int, Sent | None, Sent | None, Drain]] = []
            for name, rate, n in (("drain-fast", 100_000, args.spool),
                                  ("drain-default", 200, args.capped)):  # fmt: skip
                app = start_gateway(name, f"{{drain_rate: {rate}}}", server.url, env, work)
                started.append(app)
                r.flushall()
                server.kill()
                many = spool_phase(app.port, signed_requests(n, app.port, secret, seed=n),
                                   CONNECTIONS)  # fmt: skip
                one = None
                if name == "drain-fast":
                    one = spool_phase(app.port, signed_requests(SERIAL, app.port, secret, 7), 1)
                    n += SERIAL
                print(f"  (b) {name}: {n} deliveries spooled; Redis back", flush=True)
                drains.append((name, rate, many, one, drain_phase(app, r, server, n)))
                app.stop()
        finally:
            for app in started:
                app.stop()

    print()
    print(f"gateway code: {gateway_revision()}; machine: {os.cpu_count()} CPUs, load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")  # fmt: skip
    print(f"(a) hot path, Redis up: 1 worker, wrk -t2 -c{CONNECTIONS} {args.duration:g} s, "
          f"3 KB pushes; median of {args.rounds} interleaved round(s)")  # fmt: skip
    print(f"{'spool':<12} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'spread':>7} {'runs/ids':>8}")
    medians = {}
    for name, got in rounds.items():
        row, spread = medians[name] = median(got)
        same = "equal" if all(x.runs == x.expected for x in got) else "DIFFER"
        print(f"{name:<12} {row.result.rps:>7.0f} {row.result.p50_ms:>7.2f} "
              f"{row.result.p99_ms:>7.2f} {100 * spread:>6.1f}% {same:>8}")  # fmt: skip
    (off, off_spread), (on, on_spread) = medians["spool-off"], medians["spool-idle"]
    # Each round's two runs are adjacent in time: their ratio cancels the machine's drift.
    pairs = zip(rounds["spool-idle"], rounds["spool-off"], strict=True)
    paired = sorted(idle.result.rps / off_.result.rps for idle, off_ in pairs)
    ratio = statistics.median(paired)
    print(f"spool idle vs off: {100 * (ratio - 1):+.1f}% req/s (median of the rounds' paired "
          f"ratios; they range {100 * (paired[0] - 1):+.1f}% to {100 * (paired[-1] - 1):+.1f}%); "
          f"p99 {on.result.p99_ms:.2f} vs {off.result.p99_ms:.2f} ms; each app's spread "
          f"{100 * on_spread:.1f}% and {100 * off_spread:.1f}%")  # fmt: skip
    print()
    print(f"(b) spool and drain: 3 KB pushes, 1 worker; appended on {CONNECTIONS} connections "
          f"(and {SERIAL} on 1)")  # fmt: skip
    print(f"{'drain_rate':>10} {'records':>7} {'append/s':>8} {'p99 ms':>7} {'1-conn/s':>8} "
          f"{'wait s':>6} {'drain s':>7} {'drained/s':>9}")  # fmt: skip
    for _, rate, many, one, drain in drains:
        assert many is not None
        serial = f"{SERIAL / one.seconds:>8.0f}" if one else f"{'—':>8}"
        print(f"{rate:>10} {drain.records:>7} {len(many.replies) / many.seconds:>8.0f} "
              f"{p(many.latencies, 0.99):>7.2f} {serial} {drain.wait_s:>6.2f} "
              f"{drain.seconds:>7.2f} {drain.rate:>9.0f}")  # fmt: skip
    capped = drains[-1][-1]
    verdict = "holds" if capped.rate <= 200 * 1.02 else "EXCEEDED"
    print(f"the default cap (200/s): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
