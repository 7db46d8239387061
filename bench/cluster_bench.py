"""Claims per second through `realm listen`: one Redis beside a 3-primary Redis Cluster,
in the same run, with the CPU each side spends per delivery (the basis of docs/scaling.md).

    python bench/cluster_bench.py [--duration 10] [--workers 1,2] [--repeat 3] [--partitions 6]

Everything runs on 127.0.0.1 and stops by itself: a private server, a private cluster
(3 primaries, no replicas: replicas would take CPU from the primaries on this small
machine; they cost the primaries little else), and `realm listen` against each, driven
by wrk with the signed GitHub pushes of bench/listen_bench.py (every delivery id
distinct). The workflow is spread over ``--partitions`` hash tags (`partitions: N`)
on both targets, so the cluster's primaries share the load and the single server
does the same work.

Per round it reads the CPU time the gateway's processes (all workers) and the Redis
processes used, and reports, beside req/s and latency:

* gateway CPU ms per delivery: what one gateway core handles;
* Redis CPU µs per claim, and so claims per second one Redis core (one primary) can
  take: the capacity of a primary, which the single-server row measures directly.

Rounds interleave the two targets (A B A B ...); each row is its median round.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from redis.cluster import RedisCluster  # noqa: E402

from bench.listen_bench import (  # noqa: E402
    App,
    WrkResult,
    distinct_sent,
    gateway_app,
    run_wrk,
    write_requests,
)
from tests.cluster import Cluster  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

TRIGGERS_YAML = """\
version: 1
workflows:
  deploy:
    steps: [fetch, build, release]
    partitions: {partitions}
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {{type: string}}
        sha: {{type: string, pattern: "^[0-9a-f]{{40}}$"}}
triggers:
  github-push:
    workflow: deploy
    path: /hooks/github
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    replay_guard: false
    when:
      - {{header: X-GitHub-Event, equals: push}}
      - {{jsonpath: $.ref, equals: refs/heads/main}}
    event_id: {{header: X-GitHub-Delivery}}
    params:
      repo: $.repository.full_name
      sha: $.after
"""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and their children that have exited
    (uvicorn's workers are children of the listener process)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        for proc in [pid, *children(pid)]:
            try:
                fields = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    found = [int(p) for p in text.split()]
    return found + [g for c in found for g in children(c)]


@dataclass
class Round:
    target: str
    workers: int
    result: WrkResult
    runs: int
    expected: int
    gateway_cpu: float
    redis_cpu: float

    @property
    def claims(self) -> int:
        return self.result.requests


def count_runs(client: redis.Redis | RedisCluster, partitions: int) -> int:
    tags = ["deploy"] if partitions == 1 else [f"deploy#{i}" for i in range(partitions)]
    return sum(int(client.zcard(f"realm:{{{tag}}}:runs")) for tag in tags)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--events", type=int, default=80_000)
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("error: wrk not found on PATH; apt-get install -y wrk", file=sys.stderr)
        return 2

    secret_text = secrets.token_hex(20)
    rows: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="realm-cluster-bench-") as tmp:
        work = Path(tmp)
        reqs = write_requests(
            work / "unique.tsv", args.events, secret_text.encode(), redeliver=False, seed=1,
            threads=args.threads,
        )  # fmt: skip
        config = work / "triggers.yaml"
        config.write_text(TRIGGERS_YAML.format(partitions=args.partitions))
        single = RedisServer(work / "single").start()
        cluster = Cluster(work / "cluster", primaries=3, replicas=0).start()
        clients: dict[str, redis.Redis | RedisCluster] = {
            "1 Redis": redis.Redis.from_url(single.url),
            "cluster": cluster.client(),
        }
        redis_pids = {
            "1 Redis": [single.process.pid],  # type: ignore[union-attr]
            "cluster": [n.server.process.pid for n in cluster.nodes],  # type: ignore[union-attr]
        }
        urls = {"1 Redis": single.url, "cluster": cluster.seeds_url}
        env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
        env.update(GITHUB_WEBHOOK_SECRET=secret_text, PYTHONPATH=str(ROOT))
        try:
            for workers in [int(w) for w in args.workers.split(",")]:
                apps: dict[str, App] = {}
                for target, url in urls.items():
                    app = gateway_app(config, url, workers, env, work)
                    app.name = target
                    app.log = work / f"{target.replace(' ', '-')}-w{workers}.log"
                    apps[target] = app.start()
                try:
                    for round_no in range(1, args.repeat + 1):
                        for target, app in apps.items():
                            run_wrk(app.port, reqs.path, args.warmup, args)
                            flush(clients[target])
                            assert app.proc is not None
                            g0 = cpu_seconds([app.proc.pid])
                            r0 = cpu_seconds(redis_pids[target])
                            result = run_wrk(app.port, reqs.path, args.duration, args)
                            g1 = cpu_seconds([app.proc.pid])
                            r1 = cpu_seconds(redis_pids[target])
                            time.sleep(0.3)  # the last in-flight deliveries land
                            row = Round(
                                target, workers, result,
                                count_runs(clients[target], args.partitions),
                                distinct_sent(reqs.ids, args.threads, result.sent),
                                g1 - g0, r1 - r0,
                            )  # fmt: skip
                            rows.append(row)
                            print(f"  {target:<8} w={workers} [{round_no}/{args.repeat}] "
                                  f"{result.rps:8.0f} req/s  p99 {result.p99_ms:.2f} ms  "
                                  f"runs {row.runs}/{row.expected}", flush=True)  # fmt: skip
                            flush(clients[target])
                finally:
                    for app in apps.values():
                        app.stop()
        finally:
            for client in clients.values():
                client.close()
            cluster.stop()
            single.stop()

    print()
    print(f"machine: {os.cpu_count()} CPUs, wrk on the same CPUs; workflow spread over "
          f"{args.partitions} partitions; cluster: 3 primaries, no replicas")  # fmt: skip
    header = (f"{'target':<8} {'workers':>7} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'non-2xx':>7} {'gw CPU ms/delivery':>19} {'Redis CPU µs/claim':>19} "
              f"{'claims/s per Redis core':>24} {'runs = ids':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for target in ("1 Redis", "cluster"):
        for workers in sorted({r.workers for r in rows}):
            trials = sorted(
                (r for r in rows if r.target == target and r.workers == workers),
                key=lambda r: r.result.rps,
            )
            if not trials:
                continue
            r = trials[(len(trials) - 1) // 2]
            gw_ms = 1000 * r.gateway_cpu / max(r.claims, 1)
            redis_us = 1e6 * r.redis_cpu / max(r.claims, 1)
            per_core = r.claims / r.redis_cpu if r.redis_cpu else float("nan")
            ok = "yes" if r.runs == r.expected else f"NO ({r.runs}/{r.expected})"
            print(f"{target:<8} {workers:>7} {r.result.rps:>8.0f} {r.result.p50_ms:>7.2f} "
                  f"{r.result.p99_ms:>7.2f} {r.result.non_2xx + r.result.socket_errors:>7} "
                  f"{gw_ms:>19.3f} {redis_us:>19.1f} {per_core:>24.0f} {ok:>10}")  # fmt: skip
    return 0


def flush(client: redis.Redis | RedisCluster) -> None:
    if isinstance(client, RedisCluster):
        client.flushall(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.flushall()


if __name__ == "__main__":
    sys.exit(main())
