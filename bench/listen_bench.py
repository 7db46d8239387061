"""Load-test `realm listen` with wrk on loopback, next to two reference apps.

    python bench/listen_bench.py [--duration 10] [--connections 64] [--workers 1,2] [--quick]
                                 [--repeat R] [--baseline REV]

Everything runs on 127.0.0.1 and stops by itself: a private redis-server on a
free port (no persistence), `realm listen` with a bench triggers.yaml, and the
two apps of `bench/reference_apps.py` (ceiling: read the body, answer 202;
obvious: json.loads + one redis-py EVALSHA of a minimal claim script), all on
the same uvicorn settings: uvloop, httptools, no access log, N workers.

The load generator is wrk (Debian package `wrk`), driven by `bench/wrk_github.lua`
with pre-signed GitHub push deliveries of about 3 KB (wrk cannot compute an
HMAC, so this script writes them to a file that the Lua script cycles through):

* unique:      every delivery id distinct (the file is longer than what one run
               sends, unless the app is very fast; the table shows the repeat rate).
* redelivered: every delivery id appears twice, the second time 500 deliveries
               later: 50 % of the requests are redeliveries to deduplicate.

After each measured run the runs in Redis are counted and compared with the
number of distinct delivery ids wrk sent, then Redis is flushed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from tests.servers import RedisServer, free_port  # noqa: E402

PYTHON = sys.executable
LUA = ROOT / "bench" / "wrk_github.lua"
PATH = "/hooks/github"
REDELIVERY_BLOCK = 500  # a redelivered id comes back this many deliveries later
GATEWAY_RUNS = "realm:{deploy}:runs"
OBVIOUS_STREAM = "obvious:stream"

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

UVICORN = ["--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]


# --------------------------------------------------------------------------- payloads


def push_payload(rng: random.Random, n: int) -> dict:
    """A GitHub push event of about 3 KB, shaped like the real one."""

    def sha() -> str:
        return f"{rng.getrandbits(160):040x}"

    repo = ("acme/api", "acme/web", "acme/worker")[n % 3]
    owner, name = repo.split("/")
    user = {"name": "Ada Lovelace", "email": "ada@example.com", "username": "ada"}
    after = sha()
    commits = []
    for i in range(3):
        cid = after if i == 2 else sha()
        commits.append(
            {
                "id": cid,
                "tree_id": sha(),
                "distinct": True,
                "message": f"Fix flaky retry in delivery loop (#{4000 + n % 997})",
                "timestamp": "2024-05-14T09:12:44+02:00",
                "url": f"https://github.com/{repo}/commit/{cid}",
                "author": user,
                "committer": user,
                "added": [],
                "removed": [],
                "modified": ["gateway/delivery.py", "tests/test_delivery.py"],
            }
        )
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
        "commits": commits,
        "head_commit": commits[-1],
    }


@dataclass
class RequestFile:
    path: Path
    ids: list[str]  # the delivery id of each line, in file order
    body_bytes: int


def write_requests(path: Path, n: int, secret: bytes, *, redeliver: bool, seed: int) -> RequestFile:
    """n lines "<id>\\t<hex hmac>\\t<body>". With redeliver, each id appears twice:
    blocks of REDELIVERY_BLOCK new deliveries, each followed by its redelivery."""
    rng = random.Random(seed)
    events = []
    for i in range(n // 2 if redeliver else n):
        body = json.dumps(push_payload(rng, i), separators=(",", ":")).encode()
        sig = hmac.new(secret, body, hashlib.sha256).hexdigest()
        events.append((str(uuid.UUID(int=rng.getrandbits(128), version=4)), sig, body))
    if redeliver:
        ordered = []
        for start in range(0, len(events), REDELIVERY_BLOCK):
            block = events[start : start + REDELIVERY_BLOCK]
            ordered += block + block
        events = ordered
    with path.open("wb") as out:
        for delivery, sig, body in events:
            out.write(f"{delivery}\t{sig}\t".encode() + body + b"\n")
    sizes = [len(body) for _, _, body in events]
    return RequestFile(path, [e[0] for e in events], sum(sizes) // len(sizes))


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


def gateway_app(config: Path, redis_url: str, workers: int, env: dict[str, str], logs: Path) -> App:
    port = free_port()
    cmd = [PYTHON, "-m", "gateway", "listen", "--config", str(config), "--host", "127.0.0.1",
           "--port", str(port), "--redis-url", redis_url, "--workers", str(workers)]  # fmt: skip
    return App("gateway", cmd, env, port, logs / f"gateway-w{workers}.log")


def baseline_app(
    tree: Path, config: Path, redis_url: str, workers: int, env: dict[str, str], logs: Path
) -> App:
    """The gateway at another commit (a git worktree): measured in the same run, in
    the same interleaved rounds, against the same Redis, so the two compare."""
    app = gateway_app(config, redis_url, workers, {**env, "PYTHONPATH": str(tree)}, logs)
    app.name, app.cwd, app.log = "baseline", tree, logs / f"baseline-w{workers}.log"
    return app


@contextlib.contextmanager
def worktree(rev: str, where: Path):
    """A detached git worktree of ``rev``, removed afterwards."""
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


def run_wrk(port: int, requests: Path, seconds: float, args: argparse.Namespace) -> WrkResult:
    cmd = ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{seconds:g}s", "--latency",
           "--timeout", "5s", "-s", str(LUA), f"http://127.0.0.1:{port}{PATH}",
           "--", str(requests), str(args.threads)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return parse_wrk(done.stdout)


# --------------------------------------------------------------------------- checks


def post_one(port: int, secret: bytes, delivery: str, body: bytes) -> tuple[int, bytes]:
    sig = hmac.new(secret, body, hashlib.sha256).hexdigest()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {
        "Content-Type": "application/json",
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": delivery,
        "X-Hub-Signature-256": f"sha256={sig}",
    }
    conn.request("POST", PATH, body=body, headers=headers)
    resp = conn.getresponse()
    out = (resp.status, resp.read())
    conn.close()
    return out


def smoke_test(apps: list[App], secret: bytes) -> None:
    """One delivery and its redelivery per app: 202 then (with Redis) 200."""
    body = json.dumps(push_payload(random.Random(1), 0), separators=(",", ":")).encode()
    for app in apps:
        # A delivery of each app's own: the gateway and its baseline share one Redis.
        delivery = str(uuid.uuid4())
        first, text = post_one(app.port, secret, delivery, body)
        again, text2 = post_one(app.port, secret, delivery, body)
        want_again = 202 if app.name == "ceiling" else 200
        if first != 202 or again != want_again:
            raise RuntimeError(f"{app.name}: smoke test got {first} {text!r}, {again} {text2!r}")


def runs_created(r: redis.Redis, app: str) -> int | None:
    if app in ("gateway", "baseline"):
        return int(r.zcard(GATEWAY_RUNS))
    if app == "obvious":
        return int(r.xlen(OBVIOUS_STREAM))
    return None


# --------------------------------------------------------------------------- redis-benchmark


def redis_benchmark(r: redis.Redis, port: int) -> list[tuple[str, float, float]]:
    """EVALSHA/s of the minimal claim script and of the gateway's start_run, as context."""
    if not shutil.which("redis-benchmark"):
        return []
    from bench.reference_apps import CLAIM_LUA
    from gateway.scripts import script_source

    minimal = r.script_load(CLAIM_LUA)
    start_run = r.script_load(script_source("start_run"))
    params = '{"repo":"acme/api","sha":"' + "a" * 40 + '"}'
    cases = [
        ("minimal claim (GET, SET, HSET, XADD)",
         ["EVALSHA", minimal, "3", "b:key:__rand_int__", "b:run:__rand_int__", "b:stream",
          "run-id", "acme/api", "a" * 40]),
        ("gateway start_run.lua (new key)",
         ["EVALSHA", start_run, "7", "realm:{b}:run:__rand_int__", "realm:{b}:runs",
          "realm:{b}:stream", "realm:{b}:key:__rand_int__", "realm:{b}:keyruns:__rand_int__",
          "realm:{b}:run:__rand_int__", "realm:{b}:run:__rand_int__",
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


def profile_gateway(app: App, reqs: RequestFile, args: argparse.Namespace, out: Path) -> str:
    """Sample the (single-worker) gateway with py-spy during one extra wrk run and
    summarise where its CPU time goes: by own time (leaf frame) and inclusive."""
    spy = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    if not Path(spy).exists():
        return "py-spy not found (pip install py-spy); no profile"
    assert app.proc is not None
    raw = out / "gateway.pyspy.txt"
    seconds = max(3, int(args.duration))
    cmd = [spy, "record", "--format", "raw", "--rate", "250", "--duration", str(seconds),
           "--output", str(raw), "--pid", str(app.proc.pid)]  # fmt: skip
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # py-spy attaches
        run_wrk(app.port, reqs.path, seconds, args)
        _, err = spy_proc.communicate(timeout=seconds + 60)
    finally:
        if spy_proc.poll() is None:
            spy_proc.kill()
            spy_proc.wait()
    if not raw.exists():
        return f"py-spy failed: {err.decode(errors='replace').strip()}"
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")[1:]]  # [0] is the process/thread
        total += count
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
    if not total:
        return "py-spy recorded no samples"
    lines = [f"py-spy, gateway (1 worker, unique ids), {total} samples of busy time:",
             "  own time (leaf frame):"]  # fmt: skip
    for name, count in sorted(own.items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"    {100 * count / total:5.1f}%  {name}")
    lines.append("  inclusive (frame anywhere on the stack), gateway/starlette/redis/uvicorn:")
    interesting = ("gateway/", "starlette/", "redis/", "uvicorn/", "orjson", "hmac", "json")
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    for name, count in [kv for kv in ranked if any(k in kv[0] for k in interesting)][:25]:
        lines.append(f"    {100 * count / total:5.1f}%  {name}")
    return "\n".join(lines)


def _frame(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func (pkg/file.py)', lines merged."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    func, path = match.groups()
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{func} ({short})"


# --------------------------------------------------------------------------- main


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


@dataclass
class Row:
    app: str
    scenario: str
    workers: int
    result: WrkResult
    created: int | None
    expected: int | None


def median_row(trials: list[Row]) -> Row:
    """The round with the median req/s (the lower middle one for an even count)."""
    ranked = sorted(trials, key=lambda row: row.result.rps)
    return ranked[(len(ranked) - 1) // 2]


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    index = {(r.app, r.scenario, r.workers): r for r in rows}
    header = (f"{'app':<8} {'scenario':<14} {'workers':>7} {'req/s':>8} {'p50 ms':>7} "
              f"{'p99 ms':>7} {'÷obvious':>9} {'÷ceiling':>9} {'non-2xx':>7} "
              f"{'runs created / expected (sent)':>32}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        obvious = index.get(("obvious", r.scenario, r.workers))
        ceiling = index.get(("ceiling", r.scenario, r.workers))
        to_obv = r.result.rps / obvious.result.rps if obvious else None
        to_ceil = r.result.rps / ceiling.result.rps if ceiling else None
        sent = sent_total(r.result.sent)
        runs = "—" if r.created is None else f"{r.created} / {r.expected} ({sent})"
        label = {"unique": "unique", "redelivered": "50% redeliv."}[r.scenario]
        print(f"{r.app:<8} {label:<14} {r.workers:>7} {r.result.rps:>8.0f} "
              f"{r.result.p50_ms:>7.2f} {r.result.p99_ms:>7.2f} {fmt_ratio(to_obv):>9} "
              f"{fmt_ratio(to_ceil):>9} {r.result.non_2xx + r.result.socket_errors:>7} "
              f"{runs:>32}")  # fmt: skip
    print()
    print("Targets for the gateway (same scenario and workers): req/s ≥ 1.5 x obvious, "
          "req/s ≥ 0.4 x ceiling, p99 ≤ obvious p99")  # fmt: skip
    for r in rows:
        if r.app != "gateway":
            continue
        obvious = index.get(("obvious", r.scenario, r.workers))
        ceiling = index.get(("ceiling", r.scenario, r.workers))
        if not (obvious and ceiling):
            continue
        checks = [
            ("≥1.5xobvious", r.result.rps >= 1.5 * obvious.result.rps),
            ("≥0.4xceiling", r.result.rps >= 0.4 * ceiling.result.rps),
            ("p99≤obvious", r.result.p99_ms <= obvious.result.p99_ms),
        ]
        verdict = "  ".join(f"{name} {'ok' if ok else 'MISSED'}" for name, ok in checks)
        print(f"  {r.scenario:<12} workers={r.workers}: {verdict}")
    for r in rows:
        base = index.get(("baseline", r.scenario, r.workers))
        if r.app == "gateway" and base:
            print(f"  {r.scenario:<12} workers={r.workers}: gateway ÷ baseline "
                  f"{r.result.rps / base.result.rps:.2f}x req/s, p99 {r.result.p99_ms:.2f} "
                  f"vs {base.result.p99_ms:.2f} ms")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measured run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--workers", default="1,2", help="uvicorn worker counts, e.g. 1,2")
    parser.add_argument("--events", type=int, default=80_000, help="deliveries per request file")
    parser.add_argument("--apps", default="ceiling,obvious,gateway")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds per app, interleaved; rows are medians"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure the gateway at git revision REV, interleaved with the others",
    )
    parser.add_argument("--quick", action="store_true", help="3 s runs, 1 worker only")
    parser.add_argument("--no-redis-benchmark", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="also sample the 1-worker gateway with py-spy"
    )
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup, args.workers = 3.0, 1.0, "1"
    workers_list = [int(w) for w in args.workers.split(",")]
    apps = args.apps.split(",")
    if args.baseline:
        apps.append("baseline")

    if not shutil.which("wrk"):
        print("error: wrk not found on PATH; install it with: apt-get install -y wrk",
              file=sys.stderr)  # fmt: skip
        return 2

    unit = args.threads * 2 * REDELIVERY_BLOCK
    events = max(unit, args.events // unit * unit)
    secret_text = secrets.token_hex(20)
    secret = secret_text.encode()
    rows: list[Row] = []
    mismatches: list[str] = []  # runs where runs created != distinct ids sent
    profile = ""
    load_before = os.getloadavg()
    started: list[App] = []
    redis_server: RedisServer | None = None
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="realm-bench-")))
        tree = stack.enter_context(worktree(args.baseline, work)) if args.baseline else None
        try:
            t0 = time.monotonic()
            files = {
                "unique": write_requests(work / "unique.tsv", events, secret, redeliver=False,
                                         seed=1),
                "redelivered": write_requests(work / "redelivered.tsv", events, secret,
                                              redeliver=True, seed=2),
            }  # fmt: skip
            took = time.monotonic() - t0
            print(f"wrote {events} signed push deliveries per scenario "
                  f"(body ≈ {files['unique'].body_bytes} B) in {took:.1f}s")  # fmt: skip

            redis_server = RedisServer(work / "redis").start()
            r = redis.Redis.from_url(redis_server.url)
            config = work / "triggers.yaml"
            config.write_text(TRIGGERS_YAML)
            base_env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
            env = {**base_env, "GITHUB_WEBHOOK_SECRET": secret_text,
                   "BENCH_REDIS_URL": redis_server.url, "PYTHONPATH": str(ROOT)}  # fmt: skip
            print(f"redis-server {redis_server.binary} on port {redis_server.port}; "
                  f"wrk -t{args.threads} -c{args.connections} -d{args.duration:g}s "
                  f"(warm-up {args.warmup:g}s); uvicorn: uvloop, httptools")  # fmt: skip

            for workers in workers_list:
                batch = []
                for name in apps:
                    if name == "gateway":
                        batch.append(gateway_app(config, redis_server.url, workers, env, work))
                    elif name == "baseline":
                        assert tree is not None
                        batch.append(
                            baseline_app(tree, config, redis_server.url, workers, env, work)
                        )
                    else:
                        batch.append(reference_app(name, workers, env, work))
                for app in batch:
                    started.append(app.start())
                smoke_test(batch, secret)
                r.flushall()
                for scenario, reqs in files.items():
                    # Rounds interleave the apps (A B C A B C ...), so a burst of load
                    # from elsewhere on the machine hits every app alike; each app's
                    # row is its median round.
                    trials: dict[str, list[Row]] = {app.name: [] for app in batch}
                    for round_no in range(1, args.repeat + 1):
                        for app in batch:
                            run_wrk(app.port, reqs.path, args.warmup, args)
                            r.flushall()
                            result = run_wrk(app.port, reqs.path, args.duration, args)
                            time.sleep(0.3)  # let the last in-flight deliveries land
                            created = runs_created(r, app.name)
                            expected = (
                                None
                                if created is None
                                else distinct_sent(reqs.ids, args.threads, result.sent)
                            )
                            trials[app.name].append(
                                Row(app.name, scenario, workers, result, created, expected)
                            )
                            if created != expected:
                                where = f"{app.name} {scenario} w={workers} round {round_no}"
                                mismatches.append(f"{where}: {created} runs, {expected} ids")
                            print(f"  {app.name:<8} {scenario:<12} w={workers} "
                                  f"[{round_no}/{args.repeat}]: {result.rps:8.0f} req/s  "
                                  f"p50 {result.p50_ms:.2f} ms  p99 {result.p99_ms:.2f} ms",
                                  flush=True)  # fmt: skip
                            r.flushall()
                    rows += [median_row(trials[app.name]) for app in batch]
                if args.profile and workers == 1 and "gateway" in apps:
                    gateway = next(a for a in batch if a.name == "gateway")
                    profile = profile_gateway(gateway, files["unique"], args, work)
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
        print(f"baseline code: {args.baseline} (a worktree of it, same settings)")
    print(f"machine: {os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, "
          f"after {load_after[0]:.2f} (1 min); wrk runs on the same CPUs as the apps")  # fmt: skip
    if args.repeat > 1:
        print(f"each row: the median of {args.repeat} interleaved rounds (by req/s)")
    print_table(rows, args)
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
    if profile:
        print()
        print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
