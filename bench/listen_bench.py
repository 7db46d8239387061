"""Load-test `realm listen` with wrk on loopback, next to two reference apps, on a
matrix of load shapes.

    python bench/listen_bench.py [--connections 16,64,256] [--bodies 1k,3k,25k]
                                 [--workers 1,2] [--duration 3] [--repeat R]
                                 [--apps ceiling,obvious,gateway,gateway-nolog,gateway-unix]
                                 [--baseline REV|DIR] [--profile] [--quick]

Everything runs on 127.0.0.1 and stops by itself: a private redis-server on a
free port and a unix socket (no persistence), `realm listen` in three variants
(``gateway``: Redis over TCP; ``gateway-nolog``: the same with
``settings.delivery_log: false``; ``gateway-unix``: Redis over the unix socket),
and the two apps of `bench/reference_apps.py` (ceiling: read the body, answer
202; obvious: json.loads + one redis-py EVALSHA of a minimal claim script), all
on the same uvicorn settings: uvloop, httptools, no access log, N workers.

A shape is (workers, wrk connections, body size). For each shape every app runs
in the same interleaved rounds (A B C A B C ...), so a burst of load from
elsewhere on the machine hits every app alike; a row is the app's median round.

The load generator is wrk (Debian package `wrk`), driven by `bench/wrk_github.lua`
with pre-signed GitHub push deliveries of about 1, 3 or 25 KB (wrk cannot compute
an HMAC, so this script writes them to files that the Lua script cycles through):

* unique:      every delivery id distinct (a run that sends more than the file
               holds wraps around; the table shows it: expected < sent).
* redelivered: every delivery id appears twice, the second time 500 deliveries
               later: 50 % of the requests are redeliveries to deduplicate.

After each measured run the runs in Redis are counted and compared with the
number of distinct delivery ids wrk sent, then Redis is flushed. Each run is also
costed per request answered: the app's CPU (its process group, from /proc), Redis's
CPU, the commands Redis ran (those of scripts counted) and the bytes it read.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from tests.servers import RedisServer, free_port  # noqa: E402
from tests.signing import github_headers, hmac_hex  # noqa: E402

PYTHON = sys.executable
LUA = ROOT / "bench" / "wrk_github.lua"
PATH = "/hooks/github"
REDELIVERY_BLOCK = 500  # a redelivered id comes back this many deliveries later
GATEWAY_RUNS = "realm:{deploy}:runs"
OBVIOUS_STREAM = "obvious:stream"
SCENARIO_LABELS = {"unique": "unique", "redelivered": "50% redeliv."}

# The apps, in the order of each round. The gateway variants all count their runs
# the same way; "baseline" is the gateway at another revision (--baseline).
APPS = ("ceiling", "obvious", "gateway", "gateway-nolog", "gateway-unix")
GATEWAYS = ("gateway", "gateway-nolog", "gateway-unix", "baseline")

# The targets, with the gateway's defaults (delivery log on, replay guard on): on every
# shape ≥ TARGET_OBVIOUS x the obvious app's req/s and a p99 no worse than its; on the
# key shapes (one worker, 3 KB, 32 and 64 connections) ≥ KEY_OBVIOUS x obvious and
# ≥ KEY_CEILING x the ceiling; on every 3 KB shape at most TARGET_APP_US of the
# gateway's CPU and TARGET_REDIS_US of Redis's per delivery; and the aim beyond them on
# one shape.
TARGET_OBVIOUS = 1.2
KEY_OBVIOUS, KEY_CEILING = 1.5, 0.35
KEY_SHAPES = ((1, 32, "3k"), (1, 64, "3k"))  # workers, connections, body
TARGET_APP_US, TARGET_REDIS_US = 110, 35
AIM_OBVIOUS, AIM_CEILING = 2.5, 0.6
AIM_SHAPE = (1, 64, "3k")

TRIGGERS_YAML = """\
version: 1
workflows:
  deploy:
    steps: [fetch, build, release]
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {type: string}
        sha: {type: string, pattern: "^[0-9a-f]{40}$"}
triggers:
  github-push:
    workflow: deploy
    path: /hooks/github
    verify: {scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}
    when:
      - {header: X-GitHub-Event, equals: push}
      - {jsonpath: $.ref, equals: refs/heads/main}
    event_id: {header: X-GitHub-Delivery}
    params:
      repo: $.repository.full_name
      sha: $.after
"""
# gateway-nolog: the same, with the delivery log (gateway/deliveries/log.py) off.
NOLOG_YAML = TRIGGERS_YAML + "settings:\n  delivery_log: false\n"

UVICORN = ["--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]


# --------------------------------------------------------------------------- payloads

# Body sizes: how each is made (see push_payload), ≈ its size in bytes.
BODIES: dict[str, dict[str, object]] = {
    # A small push: one branch update with a few commits, lean objects.
    "1k": {"commits": 4, "lean": True},
    # The usual push: 3 commits, full repository, pusher, sender, head_commit.
    "3k": {"commits": 3, "files": 2},
    # A big push: GitHub's 20 commits, each with a long message and many files.
    "25k": {"commits": 20, "files": 8, "lines": 5},
}
# File names in the payloads: made-up, fixed, so every revision's bodies are the same bytes.
_PATHS = ["gateway/delivery.py", "tests/test_delivery.py", "gateway/pipeline.py",
          "docs/scaling.md", "bench/listen_bench.py", "gateway/store.py", "README.md",
          "gateway/lua/start_run.lua"]  # fmt: skip


def push_payload(
    rng: random.Random, n: int, *, commits: int = 3, files: int = 2, lines: int = 1,
    lean: bool = False,
) -> dict:  # fmt: skip
    """A GitHub push event shaped like the real one: ``commits`` commits, each
    touching ``files`` files with a message of ``lines`` lines; ``lean`` keeps
    only a few fields of each object (a 1 KB body)."""

    def sha() -> str:
        return f"{rng.getrandbits(160):040x}"

    repo = ("acme/api", "acme/web", "acme/worker")[n % 3]
    owner, name = repo.split("/")
    user = {"name": "Ada Lovelace", "email": "ada@example.com", "username": "ada"}
    after = sha()
    listed = []
    for i in range(commits):
        cid = after if i == commits - 1 else sha()
        message = f"Fix flaky retry in delivery loop (#{4000 + (n + i) % 997})"
        if lines > 1:
            message += "\n\n" + "\n".join(
                f"Part {j}: the retry loop now waits for its deadline before the next "
                "attempt, so a slow Redis no longer doubles the claims."
                for j in range(1, lines)
            )
        if lean:
            listed.append({"id": cid, "message": message, "author": {"username": "ada"}})
            continue
        listed.append(
            {
                "id": cid,
                "tree_id": sha(),
                "distinct": True,
                "message": message,
                "timestamp": "2024-05-14T09:12:44+02:00",
                "url": f"https://github.com/{repo}/commit/{cid}",
                "author": user,
                "committer": user,
                "added": [],
                "removed": [],
                "modified": _PATHS[:files],
            }
        )
    if lean:
        return {
            "ref": "refs/heads/main",
            "before": sha(),
            "after": after,
            "repository": {
                "id": 1296269 + n % 3,
                "full_name": repo,
                "private": True,
                "default_branch": "main",
            },
            "pusher": {"name": "ada"},
            "sender": {"login": "ada", "id": 1},
            "commits": listed,
            "head_commit": listed[-1],
        }
    return {
        "ref": "refs/heads/main",
        "before": sha(),
        "after": after,
        "repository": {
            "id": 1296269 + n % 3,
            "node_id": "MDEwOlJlcG9zaXRvcnkxMjk2MjY5",
            "name": name,
            "full_name": repo,
            "private": True,
            "owner": {"name": owner, "login": owner, "id": 583231, "type": "Organization"},
            "html_url": f"https://github.com/{repo}",
            "description": "Realm Gateway benchmark repository",
            "fork": False,
            "url": f"https://github.com/{repo}",
            "created_at": 1400000000,
            "updated_at": "2024-05-14T07:12:44Z",
            "pushed_at": 1715670764,
            "default_branch": "main",
            "master_branch": "main",
        },
        "pusher": {"name": "ada", "email": "ada@example.com"},
        "sender": {
            "login": "ada",
            "id": 1,
            "type": "User",
            "site_admin": False,
            "html_url": "https://github.com/ada",
        },
        "created": False,
        "deleted": False,
        "forced": False,
        "base_ref": None,
        "compare": f"https://github.com/{repo}/compare/{after[:12]}...{after[:12]}",
        "commits": listed,
        "head_commit": listed[-1],
    }


def encode(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class RequestFile:
    path: Path
    ids: list[str]  # the delivery id of each line, in file order
    body_bytes: int


def write_requests(
    path: Path, n: int, secret: bytes, *, redeliver: bool, seed: int, body: str = "3k",
    threads: int = 2,
) -> RequestFile:  # fmt: skip
    """n lines "<id>\\t<hex hmac>\\t<body>", cut into ``threads`` contiguous chunks,
    one file each (``path.0``, ``path.1``, ...: wrk's thread i reads ``path.i``).
    With redeliver, each id appears twice: blocks of REDELIVERY_BLOCK new deliveries,
    each followed by its redelivery."""
    rng = random.Random(seed)
    shape = BODIES[body]
    events = []
    for i in range(n // 2 if redeliver else n):
        raw = encode(push_payload(rng, i, **shape))  # type: ignore[arg-type]
        sig = hmac_hex(secret, raw)  # wrk_github.lua adds the sha256= prefix
        events.append((str(uuid.UUID(int=rng.getrandbits(128), version=4)), sig, raw))
    if redeliver:
        ordered = []
        for start in range(0, len(events), REDELIVERY_BLOCK):
            block = events[start : start + REDELIVERY_BLOCK]
            ordered += block + block
        events = ordered
    chunk = len(events) // threads
    events = events[: chunk * threads]
    for i in range(threads):
        with path.with_name(f"{path.name}.{i}").open("wb") as out:
            for delivery, sig, raw in events[i * chunk : (i + 1) * chunk]:
                out.write(f"{delivery}\t{sig}\t".encode() + raw + b"\n")
    sizes = [len(raw) for _, _, raw in events]
    return RequestFile(path, [e[0] for e in events], sum(sizes) // len(sizes))


def events_for(body: str, args: argparse.Namespace) -> int:
    """Deliveries per request file: --events, fewer for big bodies (each wrk thread
    loads the whole file), a multiple of what the scenarios' chunks need."""
    sample = encode(push_payload(random.Random(0), 0, **BODIES[body]))  # type: ignore[arg-type]
    n = min(args.events, int(args.file_mb * 1_000_000 / (len(sample) + 100)))
    unit = args.threads * 2 * REDELIVERY_BLOCK
    return max(unit, n // unit * unit)


def distinct_sent(ids: list[str], threads: int, sent: list[int]) -> int:
    """Distinct delivery ids among what wrk sent: thread i cycles through chunk i.

    wrk calls thread 0's request() once before the run to check the request
    (script_verify_request), so thread 0's first line is never sent; see sent_total.
    """
    chunk = len(ids) // threads
    seen: set[str] = set()
    for i, count in enumerate(sent):
        part = ids[i * chunk : (i + 1) * chunk]
        first = 1 if i == 0 else 0
        if count - first >= len(part):
            seen.update(part)
        else:
            seen.update(part[j % len(part)] for j in range(first, count))
    return len(seen)


def sent_total(sent: list[int]) -> int:
    return sum(sent) - 1  # the verification call of thread 0 (see distinct_sent)


# --------------------------------------------------------------------------- processes


@dataclass
class App:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    cwd: Path = ROOT
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, timeout: float = 30.0) -> App:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: workers are stopped too
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                conn.close()
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer within {timeout}s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # stray workers of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-30:])


def reference_app(name: str, workers: int, env: dict[str, str], logs: Path) -> App:
    port = free_port()
    cmd = [PYTHON, "-m", "uvicorn", "--factory", f"bench.reference_apps:{name}_app",
           "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
           *UVICORN]  # fmt: skip
    return App(name, cmd, env, port, logs / f"{name}-w{workers}.log")


def gateway_app(
    config: Path, redis_url: str, workers: int, env: dict[str, str], logs: Path,
    *, name: str = "gateway",
) -> App:  # fmt: skip
    """`realm listen` (bench/cluster_bench.py and bench/runner_bench.py use it too)."""
    port = free_port()
    cmd = [PYTHON, "-m", "gateway", "listen", "--config", str(config), "--host", "127.0.0.1",
           "--port", str(port), "--redis-url", redis_url, "--workers", str(workers)]  # fmt: skip
    return App(name, cmd, env, port, logs / f"{name}-w{workers}.log")


def baseline_app(
    tree: Path, config: Path, redis_url: str, workers: int, env: dict[str, str], logs: Path
) -> App:
    """The gateway at another revision (a git worktree, or a directory holding a
    copy of the code): measured in the same run, in the same interleaved rounds,
    against the same Redis, so the two compare."""
    app = gateway_app(config, redis_url, workers, {**env, "PYTHONPATH": str(tree)}, logs,
                      name="baseline")  # fmt: skip
    app.cwd = tree
    return app


@contextlib.contextmanager
def baseline_tree(rev: str, where: Path):
    """The code to measure as the baseline: ``rev`` itself when it is a directory
    (a copy of the tree, say with one file put back), else a detached git worktree
    of that revision, removed afterwards."""
    if Path(rev).is_dir():
        yield Path(rev).resolve()
        return
    tree = where / "baseline-tree"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=ROOT,
                   check=True, timeout=60)  # fmt: skip
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       check=False, timeout=60)  # fmt: skip


# --------------------------------------------------------------------------- wrk


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    socket_errors: int
    sent: list[int]


_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)([a-z]+)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS_MS[unit]


def parse_wrk(out: str) -> WrkResult:
    def find(pattern: str) -> re.Match[str]:
        match = re.search(pattern, out, re.M)
        if not match:
            raise RuntimeError(f"unexpected wrk output (no {pattern!r}):\n{out}")
        return match

    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return WrkResult(
        rps=float(find(r"^Requests/sec:\s+([\d.]+)").group(1)),
        p50_ms=_ms(find(r"^\s+50%\s+(\S+)").group(1)),
        p99_ms=_ms(find(r"^\s+99%\s+(\S+)").group(1)),
        requests=int(find(r"^\s+(\d+) requests in").group(1)),
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(g) for g in errors.groups()) if errors else 0,
        sent=[int(n) for n in find(r"^BENCH_SENT ([\d ]+)$").group(1).split()],
    )


def run_wrk(
    port: int, requests: Path, seconds: float, args: argparse.Namespace,
    connections: int | None = None,
) -> WrkResult:  # fmt: skip
    """One wrk run of ``seconds`` with ``args.threads`` threads and ``connections``
    (default ``args.connections``) on the request files ``requests``.<thread>."""
    threads = args.threads
    connections = connections or args.connections
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency",
           "--timeout", "5s", "-s", str(LUA), f"http://127.0.0.1:{port}{PATH}",
           "--", str(requests), str(threads)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return parse_wrk(done.stdout)


# --------------------------------------------------------------------------- checks


def post_one(port: int, secret: bytes, delivery: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = github_headers(body, secret, delivery=delivery)
    conn.request("POST", PATH, body=body, headers=headers)
    resp = conn.getresponse()
    out = (resp.status, resp.read())
    conn.close()
    return out


def smoke_test(apps: list[App], secret: bytes) -> None:
    """One delivery and its redelivery per app: 202 then (with Redis) 200."""
    for n, app in enumerate(apps):
        # A delivery and body of each app's own: the gateways share one Redis, and
        # the replay guard deduplicates a body seen before under another delivery id.
        body = encode(push_payload(random.Random(n), n))
        delivery = str(uuid.uuid4())
        first, text = post_one(app.port, secret, delivery, body)
        again, text2 = post_one(app.port, secret, delivery, body)
        want_again = 202 if app.name == "ceiling" else 200
        if first != 202 or again != want_again:
            raise RuntimeError(f"{app.name}: smoke test got {first} {text!r}, {again} {text2!r}")


def runs_created(r: redis.Redis, app: str) -> int | None:
    if app in GATEWAYS:
        return int(r.zcard(GATEWAY_RUNS))
    if app == "obvious":
        return int(r.xlen(OBVIOUS_STREAM))
    return None


# --------------------------------------------------------------------------- cost accounting

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# The bench's own command between two snapshots: the second INFO, whose bytes Redis
# counts before it answers (its call, and the first INFO's, are left out by name).
_INFO = ("INFO", "all")
_INFO_BYTES = sum(len(part) for part in redis.Connection().pack_command(*_INFO))


def group_cpu(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group ``pgid``: an
    app and its workers (App.start gives each app a group of its own)."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_bytes()
        except OSError:  # gone meanwhile
            continue
        # After "pid (comm) ": state, ppid, pgrp, ... utime and stime are fields 14, 15.
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / _CLOCK_TICKS


@dataclass
class Snapshot:
    app_cpu: float  # seconds
    redis_cpu: float  # seconds
    commands: int  # calls of every command but INFO, those run inside scripts included
    bytes_in: int  # total_net_input_bytes


def snapshot(r: redis.Redis, app: App) -> Snapshot:
    assert app.proc is not None
    info = r.execute_command(*_INFO)  # parsed by redis-py's INFO callback
    calls = sum(
        int(value["calls"])
        for name, value in info.items()
        if name.startswith("cmdstat_") and name != "cmdstat_info"
    )
    return Snapshot(
        group_cpu(app.proc.pid),
        float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
        calls,
        int(info["total_net_input_bytes"]),
    )


@dataclass
class Cost:
    """Per request answered over one measured run."""

    app_us: float  # the app's CPU (every process of it), µs
    redis_us: float  # Redis's CPU, µs
    commands: float
    bytes_in: float

    @staticmethod
    def between(before: Snapshot, after: Snapshot, answered: int) -> Cost | None:
        if answered <= 0:
            return None
        return Cost(
            (after.app_cpu - before.app_cpu) * 1e6 / answered,
            (after.redis_cpu - before.redis_cpu) * 1e6 / answered,
            (after.commands - before.commands) / answered,
            (after.bytes_in - before.bytes_in - _INFO_BYTES) / answered,
        )


# --------------------------------------------------------------------------- redis-benchmark


def redis_benchmark(r: redis.Redis, port: int) -> list[tuple[str, float, float]]:
    """EVALSHA/s of the minimal claim script and of the gateway's start_run, as context."""
    if not shutil.which("redis-benchmark"):
        return []
    from bench.reference_apps import CLAIM_LUA
    from gateway.store.scripts import script_source

    minimal = r.script_load(CLAIM_LUA)
    start_run = r.script_load(script_source("start_run"))
    params = '{"repo":"acme/api","sha":"' + "a" * 40 + '"}'
    cases = [
        ("minimal claim (GET, SET, HSET, XADD)",
         ["EVALSHA", minimal, "3", "b:key:__rand_int__", "b:run:__rand_int__", "b:stream",
          "run-id", "acme/api", "a" * 40]),
        ("gateway start_run.lua (new key)",
         ["EVALSHA", start_run, "8", "realm:{b}:run:__rand_int__", "realm:{b}:runs",
          "realm:{b}:stream", "realm:{b}:key:__rand_int__", "realm:{b}:keyruns:__rand_int__",
          "realm:{b}:run:__rand_int__", "realm:{b}:run:__rand_int__", "realm:{b}:keys",
          "run-id", "b", "key", params, "f" * 64, '["fetch","build","release"]',
          "use_existing", "reuse", "flag", "604800000", "fetch", "", ""]),
    ]  # fmt: skip
    results = []
    for label, command in cases:
        done = subprocess.run(
            ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "50", "-n", "200000",
             "-r", "100000000", "--csv", *command],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        rows = [line for line in done.stdout.splitlines() if line.startswith('"EVALSHA')]
        if done.returncode != 0 or not rows:
            # Say so rather than leave the row out: a script error shows up here.
            print(f"redis-benchmark failed for {label}: {(done.stderr or done.stdout)[-300:]}")
        else:
            # "test","rps","avg","min","p50","p95","p99","max" (the test name holds quotes)
            fields = [f.strip('"') for f in rows[-1].rsplit('","', 7)]
            results.append((label, float(fields[1]), float(fields[4])))  # rps, p50 ms
        r.flushall()
    return results


# --------------------------------------------------------------------------- py-spy

# A sample whose innermost frame is one of these is the loop waiting for I/O.
_IDLE = {"epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "select"}
# Leaf frames that are system calls, shown with the Python code that made them.
_SYSCALLS = {"write", "writev", "send", "sendto", "sendmsg", "read", "readv", "recv",
             "recvfrom", "getpid", "getrandom", "accept4", "epoll_ctl", "close"}  # fmt: skip
_LOOP = "[uvloop/libuv C code, no Python frame]"


def profile_gateway(
    app: App, reqs: RequestFile, connections: int, args: argparse.Namespace, out: Path,
    title: str,
) -> str:  # fmt: skip
    """Sample the (single-worker) gateway with ``py-spy --native`` during one extra
    wrk run and summarise where its busy time goes (see summarise_profile)."""
    spy = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    if not Path(spy).exists():
        return "py-spy not found (pip install py-spy); no profile"
    assert app.proc is not None
    raw = out / f"{app.name}.pyspy.txt"
    seconds = max(8, int(args.duration))  # enough samples to tell 2 % from noise
    cmd = [spy, "record", "--native", "--format", "raw", "--rate", "250", "--duration",
           str(seconds), "--output", str(raw), "--pid", str(app.proc.pid)]  # fmt: skip
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # py-spy attaches
        run_wrk(app.port, reqs.path, seconds, args, connections)
        _, err = spy_proc.communicate(timeout=seconds + 60)
    finally:
        if spy_proc.poll() is None:
            spy_proc.kill()
            spy_proc.wait()
    if not raw.exists():
        return f"py-spy failed: {err.decode(errors='replace').strip()}"
    return summarise_profile(raw.read_text(), title)


def _frame(frame: str) -> tuple[str, bool]:
    """'func (path/to/file.py:12)' -> ('func (pkg/file.py)', is Python code)."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame, False
    func, path = match.groups()
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{func} ({short})", path.endswith(".py")


def summarise_profile(raw: str, title: str) -> str:
    """py-spy's raw (collapsed) stacks, summarised over the busy samples (those not
    waiting in epoll): own time by Python function, counting the C code it calls
    (a socket write, orjson, HMAC) as its own; the system calls by the Python code
    that made them (a write to Redis and a write of a response are told apart this
    way); and inclusive time of the gateway's and uvicorn's functions."""
    own: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = idle = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")[1:]]  # [0] is the process/thread
        total += count
        leaf = frames[-1][0].split(" (")[0] if frames else ""
        if leaf in _IDLE:
            idle += count
            continue
        python = [name for name, is_python in frames if is_python]
        # Only the runner's frame above uvloop's C: the loop's own work (polling,
        # reading sockets, running callbacks' C parts).
        owner = python[-1] if python and "asyncio/runners.py" not in python[-1] else _LOOP
        own[owner] += count
        if leaf in _SYSCALLS:
            calls[f"{leaf} <- {owner}"] += count
        for name in set(python):
            inclusive[name] += count
    busy = total - idle
    if not busy:
        return f"py-spy recorded no busy samples ({total} in all)"
    lines = [f"py-spy --native, {title}: {total} samples, {100 * idle / total:.0f}% waiting "
             f"in epoll; below, % of the {busy} busy samples",
             "  own time by Python function (the C code it calls counted in):"]  # fmt: skip
    lines += [f"    {100 * n / busy:5.1f}%  {name}" for name, n in own.most_common(18)]
    lines.append("  system calls (leaf frame), by the Python code that made them:")
    lines += [f"    {100 * n / busy:5.1f}%  {name}" for name, n in calls.most_common(10)]
    lines.append("  inclusive (frame anywhere on the stack), gateway/uvicorn/starlette:")
    interesting = ("gateway/", "http/", "starlette/", "uvicorn/")
    ranked = [kv for kv in inclusive.most_common() if any(k in kv[0] for k in interesting)]
    lines += [f"    {100 * n / busy:5.1f}%  {name}" for name, n in ranked[:20]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- tables


def gateway_revision() -> str:
    """The commit the gateway was measured at, and whether gateway/ had local edits."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gateway"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return head.stdout.strip() + (" + uncommitted changes in gateway/" if dirty.stdout else "")


Shape = tuple[int, int, str, str]  # workers, connections, body, scenario


@dataclass
class Row:
    app: str
    shape: Shape
    result: WrkResult
    created: int | None
    expected: int | None
    spread: float = 0.0  # (max - min) / median req/s of the rounds
    cost: Cost | None = None  # of this round


def median_row(trials: list[Row]) -> Row:
    """The round with the median req/s (the lower middle one for an even count),
    with the spread of all rounds."""
    ranked = sorted(trials, key=lambda row: row.result.rps)
    row = ranked[(len(ranked) - 1) // 2]
    mid = statistics.median(r.result.rps for r in ranked)
    row.spread = (ranked[-1].result.rps - ranked[0].result.rps) / mid if mid else 0.0
    return row


def shape_label(shape: Shape) -> str:
    workers, connections, body, scenario = shape
    return f"w{workers} c{connections:<3} {body:>3} {SCENARIO_LABELS[scenario]}"


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def describe_cost(cost: Cost | None) -> str:
    if cost is None:
        return "no requests answered"
    return (f"app {cost.app_us:.0f} µs, Redis {cost.redis_us:.1f} µs, "
            f"{cost.commands:.1f} commands, {cost.bytes_in:.0f} B per request")  # fmt: skip


def fmt_cost(cost: Cost | None) -> str:
    """The cost columns: app µs, Redis µs, commands, bytes to Redis (per request)."""
    if cost is None:
        return f"{'—':>7} {'—':>8} {'—':>5} {'—':>7}"
    return (f"{cost.app_us:>7.0f} {cost.redis_us:>8.1f} {cost.commands:>5.1f} "
            f"{cost.bytes_in:>7.0f}")  # fmt: skip


def verdicts(row: Row, obvious: Row, ceiling: Row) -> list[tuple[str, bool]]:
    """The targets for one gateway row against the same shape's references."""
    rps, shape = row.result.rps, row.shape[:3]
    checks = [
        (f"≥{TARGET_OBVIOUS}x obvious", rps >= TARGET_OBVIOUS * obvious.result.rps),
        ("p99 ≤ obvious", row.result.p99_ms <= obvious.result.p99_ms),
    ]
    if shape in KEY_SHAPES:
        checks += [
            (f"≥{KEY_OBVIOUS}x obvious", rps >= KEY_OBVIOUS * obvious.result.rps),
            (f"≥{KEY_CEILING}x ceiling", rps >= KEY_CEILING * ceiling.result.rps),
        ]
    if shape[2] == "3k" and row.cost is not None:
        checks += [
            (f"app ≤{TARGET_APP_US} µs", row.cost.app_us <= TARGET_APP_US),
            (f"Redis ≤{TARGET_REDIS_US} µs", row.cost.redis_us <= TARGET_REDIS_US),
        ]
    if shape == AIM_SHAPE:
        checks += [
            (f"aim ≥{AIM_OBVIOUS}x obvious", rps >= AIM_OBVIOUS * obvious.result.rps),
            (f"aim ≥{AIM_CEILING}x ceiling", rps >= AIM_CEILING * ceiling.result.rps),
        ]
    return checks


def print_table(rows: list[Row], repeat: int) -> None:
    index = {(r.app, r.shape): r for r in rows}
    header = (f"{'shape':<24} {'app':<13} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>8} "
              f"{'app µs':>7} {'Redis µs':>8} {'cmds':>5} {'B→Redis':>7} "
              f"{'÷obvious':>8} {'÷ceiling':>8} {'spread':>6} {'non-2xx':>7} "
              f"{'runs created / expected (sent)':>31}")  # fmt: skip
    print(header)
    print("-" * len(header))
    shapes = list(dict.fromkeys(r.shape for r in rows))
    for shape in shapes:
        obvious, ceiling = index.get(("obvious", shape)), index.get(("ceiling", shape))
        for r in (r for r in rows if r.shape == shape):
            to_obv = r.result.rps / obvious.result.rps if obvious else None
            to_ceil = r.result.rps / ceiling.result.rps if ceiling else None
            sent = sent_total(r.result.sent)
            runs = "—" if r.created is None else f"{r.created} / {r.expected} ({sent})"
            spread = f"{100 * r.spread:.0f}%" if repeat > 1 else "—"
            print(f"{shape_label(shape):<24} {r.app:<13} {r.result.rps:>7.0f} "
                  f"{r.result.p50_ms:>7.2f} {r.result.p99_ms:>8.2f} {fmt_cost(r.cost)} "
                  f"{fmt_ratio(to_obv):>8} "
                  f"{fmt_ratio(to_ceil):>8} {spread:>6} "
                  f"{r.result.non_2xx + r.result.socket_errors:>7} {runs:>31}")  # fmt: skip
    print()
    keys = ", ".join(f"w{w} c{c} {b}" for w, c, b in KEY_SHAPES)
    print(f"Targets: on every shape req/s ≥ {TARGET_OBVIOUS} x obvious and p99 ≤ obvious p99; "
          f"on {keys} ≥ {KEY_OBVIOUS} x obvious and ≥ {KEY_CEILING} x ceiling; on 3k "
          f"shapes app ≤ {TARGET_APP_US} µs and Redis ≤ {TARGET_REDIS_US} µs per delivery; "
          f"the aim on w{AIM_SHAPE[0]} c{AIM_SHAPE[1]} {AIM_SHAPE[2]}: ≥ {AIM_OBVIOUS} x "
          f"and ≥ {AIM_CEILING} x")  # fmt: skip
    met = total = 0
    for shape in shapes:
        obvious, ceiling = index.get(("obvious", shape)), index.get(("ceiling", shape))
        if not (obvious and ceiling):
            continue
        for r in (r for r in rows if r.shape == shape and r.app in GATEWAYS):
            checks = verdicts(r, obvious, ceiling)
            if r.app == "gateway":
                total += 1
                met += all(ok for name, ok in checks if not name.startswith("aim"))
            said = "  ".join(f"{name} {'ok' if ok else 'MISSED'}" for name, ok in checks)
            print(f"  {shape_label(shape):<24} {r.app:<13} {said}")
    if total:
        print(f"gateway (TCP, delivery log on): every target met on {met} of {total} shapes")
    for shape in shapes:
        gateway, base = index.get(("gateway", shape)), index.get(("baseline", shape))
        if gateway and base:
            print(f"  {shape_label(shape):<24} gateway ÷ baseline "
                  f"{gateway.result.rps / base.result.rps:.2f}x req/s, p99 "
                  f"{gateway.result.p99_ms:.2f} vs {base.result.p99_ms:.2f} ms")  # fmt: skip


def print_summary(rows: list[Row]) -> None:
    """One line per shape: what the README's table shows."""
    index = {(r.app, r.shape): r for r in rows}
    shapes = list(dict.fromkeys(r.shape for r in rows))
    header = (f"{'shape':<24} {'ceiling':>7} {'obvious':>7} {'gateway':>7} {'÷obv':>5} "
              f"{'÷ceil':>5} {'p99 gw/obv ms':>14} {'nolog':>7} {'unix':>7} "
              f"{'targets':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for shape in shapes:
        get = {app: index.get((app, shape)) for app in (*APPS, "baseline")}
        gateway, obvious, ceiling = get["gateway"], get["obvious"], get["ceiling"]
        if not (gateway and obvious and ceiling):
            continue

        def rps(app: str, get: dict[str, Row | None] = get) -> str:
            row = get[app]
            return f"{row.result.rps:>7.0f}" if row else f"{'—':>7}"

        checks = verdicts(gateway, obvious, ceiling)
        missed = [name for name, ok in checks if not ok and not name.startswith("aim")]
        said = (
            "met"
            if not missed
            else "MISSED "
            + ", ".join(
                n.split()[0].replace("≥", "").replace("x", "") if "p99" not in n else "p99"
                for n in missed
            )
        )
        p99 = f"{gateway.result.p99_ms:.1f}/{obvious.result.p99_ms:.1f}"
        print(f"{shape_label(shape):<24} {rps('ceiling')} {rps('obvious')} {rps('gateway')} "
              f"{gateway.result.rps / obvious.result.rps:>5.2f} "
              f"{gateway.result.rps / ceiling.result.rps:>5.2f} {p99:>14} "
              f"{rps('gateway-nolog')} {rps('gateway-unix')} {said:>8}")  # fmt: skip


# --------------------------------------------------------------------------- main


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measured run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per run")
    parser.add_argument("--connections", default="16,64,256", help="wrk connections, e.g. 16,64")
    parser.add_argument("--bodies", default="1k,3k,25k", help=f"of {', '.join(BODIES)}")
    parser.add_argument("--workers", default="1,2", help="uvicorn worker counts, e.g. 1,2")
    parser.add_argument("--scenarios", default="unique", help="unique,redelivered")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--events", type=int, default=40_000, help="deliveries per request file")
    parser.add_argument(
        "--file-mb", type=float, default=300, help="at most this many MB per request file"
    )
    parser.add_argument("--apps", default=",".join(APPS), help=f"of {', '.join(APPS)}")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds per app, interleaved; rows are medians"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV|DIR",
        help="also measure the gateway at git revision REV (or the copy of the code in "
        "directory DIR), interleaved with the others",
    )
    parser.add_argument(
        "--quick", action="store_true", help="one shape: 1 worker, 64 connections, 3k bodies"
    )
    parser.add_argument("--no-redis-benchmark", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also sample the 1-worker gateway (and baseline) with py-spy on 64 connections, 3k",
    )
    args = parser.parse_args()
    if args.quick:
        args.workers, args.connections, args.bodies = "1", "64", "3k"
    workers_list = [int(w) for w in _csv(args.workers)]
    connections_list = [int(c) for c in _csv(args.connections)]
    bodies = _csv(args.bodies)
    scenarios = _csv(args.scenarios)
    apps = _csv(args.apps)
    if args.baseline:
        apps.append("baseline")
    for kind, given, known in (("body", bodies, BODIES), ("scenario", scenarios, SCENARIO_LABELS),
                               ("app", apps, (*APPS, "baseline"))):  # fmt: skip
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {kind} {unknown[0]!r}; known: {', '.join(known)}")
    if not shutil.which("wrk"):
        print("error: wrk not found on PATH; install it with: apt-get install -y wrk",
              file=sys.stderr)  # fmt: skip
        return 2

    shapes_per_workers = [(c, b, s) for c in connections_list for b in bodies for s in scenarios]
    runs = len(workers_list) * len(shapes_per_workers) * len(apps) * args.repeat
    # Per run: the measured run, wrk loading its file (longer for 25 KB bodies),
    # flushes and counts; per shape and app, a warm-up run.
    estimate = (
        runs * (args.duration + 1.5)
        + runs // args.repeat * (args.warmup + 1.5)  # one warm-up per shape and app
        + len(workers_list) * 15
    )
    print(f"{runs} measured runs ({len(workers_list)} worker counts x "
          f"{len(shapes_per_workers)} shapes x {len(apps)} apps x {args.repeat} rounds): "
          f"≈ {estimate / 60:.0f} min, plus writing the request files")  # fmt: skip
    profile_at = (
        64 if 64 in connections_list else connections_list[0],
        "3k" if "3k" in bodies else bodies[0],
    )

    secret_text = secrets.token_hex(20)
    secret = secret_text.encode()
    rows: list[Row] = []
    mismatches: list[str] = []  # runs where runs created != distinct ids sent
    profiles: list[str] = []
    load_before = os.getloadavg()
    started: list[App] = []
    redis_server: RedisServer | None = None
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="realm-bench-")))
        tree = stack.enter_context(baseline_tree(args.baseline, work)) if args.baseline else None
        try:
            t0 = time.monotonic()
            files: dict[tuple[str, str], RequestFile] = {}
            for body in bodies:
                n = events_for(body, args)
                for seed, scenario in enumerate(scenarios, 1):
                    files[body, scenario] = write_requests(
                        work / f"{body}-{scenario}.tsv", n, secret,
                        redeliver=scenario == "redelivered", seed=seed, body=body,
                        threads=args.threads,
                    )  # fmt: skip
                sizes = files[body, scenarios[0]].body_bytes
                print(f"  {body}: {n} signed push deliveries per scenario, body ≈ {sizes} B")
            print(f"wrote the request files in {time.monotonic() - t0:.1f}s")

            sock = work / "redis.sock"
            redis_server = RedisServer(
                work / "redis", "--unixsocket", str(sock), "--unixsocketperm", "700"
            ).start()
            r = redis.Redis.from_url(redis_server.url)
            config, nolog = work / "triggers.yaml", work / "triggers-nolog.yaml"
            config.write_text(TRIGGERS_YAML)
            nolog.write_text(NOLOG_YAML)
            base_env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
            env = {**base_env, "GITHUB_WEBHOOK_SECRET": secret_text,
                   "BENCH_REDIS_URL": redis_server.url, "PYTHONPATH": str(ROOT)}  # fmt: skip
            unix_url = f"unix://{sock}?db=0"
            print(f"redis-server {redis_server.binary} on port {redis_server.port} and {sock}; "
                  f"wrk -t{args.threads} -d{args.duration:g}s (warm-up {args.warmup:g}s); "
                  f"uvicorn: uvloop, httptools")  # fmt: skip

            for workers in workers_list:
                batch = []
                for name in apps:
                    if name == "gateway":
                        app = gateway_app(config, redis_server.url, workers, env, work)
                    elif name == "gateway-nolog":
                        app = gateway_app(nolog, redis_server.url, workers, env, work, name=name)
                    elif name == "gateway-unix":
                        app = gateway_app(config, unix_url, workers, env, work, name=name)
                    elif name == "baseline":
                        assert tree is not None
                        app = baseline_app(tree, config, redis_server.url, workers, env, work)
                    else:
                        app = reference_app(name, workers, env, work)
                    batch.append(app)
                for app in batch:
                    started.append(app.start())
                smoke_test(batch, secret)
                r.flushall()
                for connections, body, scenario in shapes_per_workers:
                    shape: Shape = (workers, connections, body, scenario)
                    reqs = files[body, scenario]
                    trials: dict[str, list[Row]] = {app.name: [] for app in batch}
                    for round_no in range(1, args.repeat + 1):
                        for app in batch:
                            if round_no == 1:  # warm once per shape: later rounds find it so
                                run_wrk(app.port, reqs.path, args.warmup, args, connections)
                                time.sleep(0.3)  # its last log records, before the flush
                                r.flushall()
                            before = snapshot(r, app)
                            result = run_wrk(app.port, reqs.path, args.duration, args,
                                             connections)  # fmt: skip
                            # The last in-flight deliveries land, and the log's flush
                            # of the last records (every 0.1 s) is inside the cost.
                            time.sleep(0.3)
                            cost = Cost.between(before, snapshot(r, app), result.requests)
                            created = runs_created(r, app.name)
                            expected = (
                                None
                                if created is None
                                else distinct_sent(reqs.ids, args.threads, result.sent)
                            )
                            trials[app.name].append(Row(app.name, shape, result, created,
                                                        expected, cost=cost))  # fmt: skip
                            if created != expected:
                                where = f"{app.name} {shape_label(shape)} round {round_no}"
                                mismatches.append(f"{where}: {created} runs, {expected} ids")
                            print(f"  {shape_label(shape):<24} {app.name:<13} "
                                  f"[{round_no}/{args.repeat}]: {result.rps:7.0f} req/s  "
                                  f"p50 {result.p50_ms:6.2f} ms  p99 {result.p99_ms:7.2f} ms  "
                                  f"{describe_cost(cost)}  load {os.getloadavg()[0]:.1f}",
                                  flush=True)  # fmt: skip
                            r.flushall()
                    rows += [median_row(trials[app.name]) for app in batch]
                    if (args.profile and workers == 1 and (connections, body) == profile_at
                            and scenario == scenarios[0]):  # fmt: skip
                        for app in batch:
                            if app.name in ("gateway", "baseline"):
                                title = (f"{app.name} (1 worker, {connections} connections, "
                                         f"{body} bodies, {scenario})")  # fmt: skip
                                profiles.append(profile_gateway(app, reqs, connections, args,
                                                                work, title))  # fmt: skip
                                r.flushall()
                for app in batch:
                    app.stop()

            bench = [] if args.no_redis_benchmark else redis_benchmark(r, redis_server.port)
        finally:
            for app in started:
                app.stop()
            if redis_server:
                redis_server.stop()

    print()
    load_after = os.getloadavg()
    print(f"gateway code: {gateway_revision()}")
    if args.baseline:
        print(f"baseline code: {args.baseline} (same settings, TCP, delivery log as it has)")
    print(f"machine: {os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, "
          f"after {load_after[0]:.2f} (1 min); wrk runs on the same CPUs as the apps")  # fmt: skip
    if args.repeat > 1:
        print(f"each row: the median of {args.repeat} interleaved rounds (by req/s); "
              "spread: (max - min) / median req/s of its rounds")  # fmt: skip
    print_table(rows, args.repeat)
    print()
    print_summary(rows)
    print()
    if mismatches:
        print("runs created != distinct delivery ids sent in:", *mismatches, sep="\n  ")
    else:
        print("every round of every app: runs created = distinct delivery ids sent")
    if bench:
        print()
        print("Redis alone (redis-benchmark -c 50, EVALSHA with fresh keys), for context:")
        for label, rps, p50 in bench:
            print(f"  {label:<40} {rps:>9.0f} EVALSHA/s  p50 {p50:.3f} ms")
    for profile in profiles:
        print()
        print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
