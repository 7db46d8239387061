"""Time `realm run reconcile` and measure its peak memory on stores of 100 000 and 1 000 000 runs.

    python bench/reconcile_bench.py [--sizes 100000,1000000] [--quick] [--profile]

For each size N, a private redis-server (loopback, free port, `--save ''
--appendonly no`) is flushed and filled with N runs of one workflow through
`RunStore.start_run_batch` (1 000 items per call, a few calls in flight):

* ~90 % of the idempotency keys have one run, ~10 % two: a second batch over
  those keys with `on_live_match="cancel_existing"` cancels the first run and
  starts a new one, so the key group holds two runs;
* damage for reconcile to find: the pointer (`realm:{wf}:key:<key>`) of ~1 % of
  the keys is deleted (missing), and for ~1 % of the two-run keys the pointer's
  `run` field is set back to the older run (stale).

Then `python -m gateway run reconcile` runs as its own child process, three
times: `--dry-run`, the repair (no `--dry-run`), and `--dry-run` again. Each
is started by a tiny launcher process that reaps it with `os.wait4`, whose rusage
belongs to that one child, so its `ru_maxrss` is that process's own peak RSS (see
LAUNCHER for why not straight from this process). The reports are checked: the first
dry run must want to write exactly missing + stale pointers across every key
group; the repair must write them; the last dry run must want to write none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from gateway.config import parse_config  # noqa: E402
from gateway.connection import redis_client  # noqa: E402
from gateway.keys import Keys  # noqa: E402
from gateway.store import RunStore  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

PYTHON = sys.executable
WORKFLOW = "sync"
CHUNK = 1_000  # items per start_run_batch call (the store's own BATCH_CHUNK)
IN_FLIGHT = 4  # start_run_batch calls awaited together
TWO_RUN_SHARE = 0.10  # keys with a second run
MISSING_SHARE = 0.01  # of all keys: pointer deleted
STALE_SHARE = 0.01  # of the two-run keys: pointer set back to the older run
SEED = 20240514

# The reconcile children read this file with the default settings (redis_timeout
# 2 s); the builder uses its own, longer timeout.
TRIGGERS_YAML = f"""\
version: 1
workflows:
  {WORKFLOW}:
    steps: [fetch, apply, notify]
    params_schema:
      type: object
      required: [order, customer]
      properties:
        order: {{type: integer}}
        customer: {{type: string}}
        amount_cents: {{type: integer}}
    retention: 7d
"""

HEAD = re.compile(
    r"^(Would write|Wrote) (\d+) pointer\(s\) across (\d+) key group\(s\); (\d+) already current\."
)
DUPLICATES = re.compile(r"^Duplicate-key groups: (\d+)$", re.M)


# --------------------------------------------------------------------------- building the store


@dataclass
class Built:
    runs: int
    keys: int
    two_run: int
    missing: int
    stale: int
    seconds: float
    redis_keys: int = 0
    used_memory: int = 0


def key_name(i: int) -> str:
    return f"order-{i:07d}"


def params_of(i: int, attempt: int) -> dict:
    return {
        "order": i,
        "customer": f"cus_{i * 7919 % 1_000_003:07d}",
        "amount_cents": 100 + attempt,
    }


async def _batches(store: RunStore, items: list[dict], **policies: str) -> list:
    """start_run_batch over items, CHUNK per call, IN_FLIGHT calls at a time, in order."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(chunk: list[dict]) -> list:
        async with gate:
            return await store.start_run_batch(WORKFLOW, chunk, **policies)

    chunks = [items[s : s + CHUNK] for s in range(0, len(items), CHUNK)]
    results = await asyncio.gather(*(one(c) for c in chunks))
    return [entry for entries in results for entry in entries]


async def build_store(url: str, runs: int, log) -> Built:
    """Fill a flushed Redis with `runs` runs of WORKFLOW, shaped and damaged as the module says."""
    keys_total = round(runs / (1 + TWO_RUN_SHARE))
    two_total = runs - keys_total
    rng = random.Random(SEED + runs)
    two_run = sorted(rng.sample(range(keys_total), two_total))
    missing = set(rng.sample(range(keys_total), round(keys_total * MISSING_SHARE)))
    # Stale among the two-run keys whose pointer is still there: the sets are disjoint.
    candidates = [i for i in two_run if i not in missing]
    stale = set(rng.sample(candidates, round(two_total * STALE_SHARE)))

    config = parse_config(TRIGGERS_YAML, file="bench triggers.yaml", with_triggers=False)
    client = redis_client(url, timeout=60.0)
    store = RunStore(client, config, timeout=120.0)
    keys = Keys(config.settings.key_prefix, WORKFLOW)
    started = time.perf_counter()
    try:
        await client.flushall()
        first = await _batches(
            store,
            [
                {"params": params_of(i, 0), "idempotency_key": key_name(i)}
                for i in range(keys_total)
            ],
        )
        bad = [e for e in first if e.error or e.result.deduped]
        if bad:
            raise SystemExit(f"first batch: {len(bad)} item(s) not started, e.g. {bad[0]}")
        log(f"  first batch: {keys_total} runs in {time.perf_counter() - started:.1f}s")
        second = await _batches(
            store,
            [{"params": params_of(i, 1), "idempotency_key": key_name(i)} for i in two_run],
            on_live_match="cancel_existing",
        )
        bad = [e for e in second if e.error or e.result.deduped or not e.result.rerun_of]
        if bad:
            raise SystemExit(f"second batch: {len(bad)} item(s) did not replace a run: {bad[0]}")
        older = {i: e.result.rerun_of for i, e in zip(two_run, second, strict=True)}
        log(f"  second batch (cancel_existing): {two_total} runs")

        async with client.pipeline(transaction=False) as pipe:
            for i in sorted(missing):
                pipe.delete(keys.pointer(key_name(i)))
            for i in sorted(stale):
                pipe.hset(keys.pointer(key_name(i)), "run", older[i])
            done = await pipe.execute()
        if sum(done[: len(missing)]) != len(missing):
            raise SystemExit("damage: some pointers to delete were not there")
        seconds = time.perf_counter() - started

        stored = await client.zcard(keys.runs())
        if stored != runs:
            raise SystemExit(f"expected {runs} runs in {keys.runs()}, found {stored}")
        info = await client.info("memory")
        return Built(
            runs=runs,
            keys=keys_total,
            two_run=two_total,
            missing=len(missing),
            stale=len(stale),
            seconds=seconds,
            redis_keys=await client.dbsize(),
            used_memory=int(info["used_memory"]),
        )
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- measuring reconcile


@dataclass
class Child:
    argv: list[str]
    seconds: float
    max_rss_kb: int
    stdout: str
    stderr: str
    server: dict[str, tuple[int, int]] = field(default_factory=dict)  # cmd -> (calls, usec)
    floor_kb: int = 0  # the launcher's RSS when it started the command

    @property
    def head(self) -> tuple[str, int, int, int]:
        match = HEAD.match(self.stdout)
        if not match:
            raise SystemExit(f"unexpected reconcile output:\n{self.stdout}\n{self.stderr}")
        verb, pointers, groups, current = match.groups()
        return verb, int(pointers), int(groups), int(current)

    @property
    def duplicate_groups(self) -> int:
        match = DUPLICATES.search(self.stdout)
        return int(match.group(1)) if match else -1


def reconcile_argv(url: str, config: Path, *, dry_run: bool) -> list[str]:
    argv = [
        PYTHON,
        "-m",
        "gateway",
        "run",
        "reconcile",
        "--redis-url",
        url,
        "--config",
        str(config),
    ]
    return [*argv, "--dry-run"] if dry_run else argv


# Peak RSS needs care. On Linux a child's ru_maxrss starts at the RSS high-water mark
# of the process it was forked (or vforked) from: exec folds the old address space's
# peak into it. A reconcile child started straight from this process, which holds the
# store it just built (≈ 1 GB after 1 M runs), would report this process's peak, not
# its own. So a tiny launcher (a bare interpreter, ≈ 10 MB; its own, inherited
# figure is not used) starts the command with posix_spawn, reaps it with wait4, and
# writes that one child's rusage and wall time to a file. The figure is then
# max(launcher RSS at spawn, the command's own peak); the launcher's RSS at spawn is
# reported too, as the floor of what can be seen.
LAUNCHER = """\
import json, os, re, sys, time
floor = int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
started = time.perf_counter()
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - started
with open(sys.argv[1], "w") as out:
    json.dump({"code": os.waitstatus_to_exitcode(status), "seconds": seconds,
               "max_rss_kb": usage.ru_maxrss, "floor_kb": floor}, out)
"""


def run_child(argv: list[str], work: Path, admin: redis.Redis | None, timeout: float) -> Child:
    """Run argv under LAUNCHER: wall time and peak RSS of that one process."""
    if admin is not None:
        admin.config_resetstat()
    out_path, err_path, facts = work / "child.out", work / "child.err", work / "child.json"
    facts.unlink(missing_ok=True)
    with out_path.open("wb") as out, err_path.open("wb") as err:
        launcher = subprocess.Popen(
            [PYTHON, "-c", LAUNCHER, str(facts), *argv],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,  # a timeout kills the launcher and the command
        )
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            raise SystemExit(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from None
    stdout, stderr = out_path.read_text(), err_path.read_text()
    if launcher.returncode != 0 or not facts.exists():
        raise SystemExit(f"launcher failed ({launcher.returncode}): {stderr}")
    measured = json.loads(facts.read_text())
    if measured["code"] != 0:
        raise SystemExit(f"exit {measured['code']}: {' '.join(argv)}\n{stdout}\n{stderr}")
    child = Child(argv, measured["seconds"], measured["max_rss_kb"], stdout, stderr)
    child.floor_kb = measured["floor_kb"]
    if admin is not None:
        for name, stats in admin.info("commandstats").items():
            cmd = name.removeprefix("cmdstat_")
            if cmd not in ("config", "info"):
                child.server[cmd] = (int(stats["calls"]), int(stats["usec"]))
    return child


def profile_child(argv: list[str], out: Path, timeout: float) -> str:
    """py-spy record the child from its start; own-time and inclusive summary."""
    spy = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    if not Path(spy).exists():
        return "py-spy not found (pip install py-spy); no profile"
    raw = out / "reconcile.pyspy.txt"
    cmd = [spy, "record", "--format", "raw", "--rate", "200", "--output", str(raw), "--", *argv]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=timeout)
    if not raw.exists():
        return f"py-spy failed: {done.stderr.decode(errors='replace').strip()}"
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")[1:]]
        total += count
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
    if not total:
        return "py-spy recorded no samples"
    lines = [
        f"py-spy, reconcile --dry-run, {total} samples (idle time not sampled):",
        "  own time (leaf frame):",
    ]
    for name, count in sorted(own.items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"    {100 * count / total:5.1f}%  {name}")
    lines.append("  inclusive, gateway/ and redis/ frames:")
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    for name, count in [kv for kv in ranked if "gateway/" in kv[0] or "redis/" in kv[0]][:20]:
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


def server_summary(child: Child) -> str:
    """Redis-side time per command during one child (INFO commandstats)."""
    total = sum(usec for _, usec in child.server.values())
    parts = [
        f"{cmd} {calls}x {usec / 1e6:.2f}s"
        for cmd, (calls, usec) in sorted(child.server.items(), key=lambda kv: -kv[1][1])
    ]
    return f"Redis busy {total / 1e6:.2f}s of {child.seconds:.2f}s wall: " + ", ".join(parts)


# --------------------------------------------------------------------------- main


@dataclass
class Result:
    built: Built
    dry: Child
    repair: Child
    after: Child
    duplicate_groups: int


def measure(size: int, url: str, admin: redis.Redis, config: Path, work: Path, log) -> Result:
    log(f"\n== {size:,} runs ==")
    built = asyncio.run(build_store(url, size, log))
    log(
        f"  built in {built.seconds:.1f}s: {built.keys} keys ({built.two_run} with two runs), "
        f"{built.missing} pointers deleted, {built.stale} set stale; "
        f"{built.redis_keys} Redis keys, used_memory {built.used_memory / 2**20:.0f} MB"
    )
    timeout = 60 + size / 500
    dry = run_child(reconcile_argv(url, config, dry_run=True), work, admin, timeout)
    log(
        f"  dry run  {dry.seconds:6.2f}s  peak RSS {dry.max_rss_kb / 1024:6.1f} MB  "
        f"{dry.stdout.splitlines()[0]}"
    )
    log(f"    {server_summary(dry)}")
    verb, pointers, groups, _ = dry.head
    expected = built.missing + built.stale
    assert verb == "Would write", dry.stdout
    assert pointers == expected, f"dry run wants {pointers} pointers, damaged {expected}"
    assert groups == built.keys, f"dry run saw {groups} key groups, built {built.keys}"
    assert dry.duplicate_groups == built.two_run, dry.stdout
    missing_stale = f"Missing pointers: {built.missing}; stale pointers: {built.stale}."
    assert missing_stale in dry.stdout, dry.stdout

    repair = run_child(reconcile_argv(url, config, dry_run=False), work, admin, timeout)
    log(
        f"  repair   {repair.seconds:6.2f}s  peak RSS {repair.max_rss_kb / 1024:6.1f} MB  "
        f"{repair.stdout.splitlines()[0]}"
    )
    log(f"    {server_summary(repair)}")
    verb, pointers, groups, _ = repair.head
    assert (verb, pointers, groups) == ("Wrote", expected, built.keys), repair.stdout

    after = run_child(reconcile_argv(url, config, dry_run=True), work, admin, timeout)
    log(
        f"  dry run again {after.seconds:6.2f}s  peak RSS {after.max_rss_kb / 1024:6.1f} MB  "
        f"{after.stdout.splitlines()[0]}"
    )
    verb, pointers, groups, current = after.head
    assert (verb, pointers, groups, current) == ("Would write", 0, built.keys, built.keys), (
        after.stdout
    )
    return Result(built, dry, repair, after, dry.duplicate_groups)


def gateway_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gateway"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return head.stdout.strip() + (" + uncommitted changes in gateway/" if dirty.stdout else "")


def print_table(results: list[Result], baseline: Child) -> None:
    header = (
        f"{'runs':>9} {'key groups':>10} {'dup groups':>10} {'build s':>8} "
        f"{'dry-run s':>9} {'repair s':>8} {'runs/s dry':>10} {'runs/s repair':>13} "
        f"{'RSS dry MB':>10} {'RSS repair MB':>13} {'Redis MB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        b = r.built
        print(
            f"{b.runs:>9} {b.keys:>10} {r.duplicate_groups:>10} {b.seconds:>8.1f} "
            f"{r.dry.seconds:>9.2f} {r.repair.seconds:>8.2f} "
            f"{b.runs / r.dry.seconds:>10.0f} {b.runs / r.repair.seconds:>13.0f} "
            f"{r.dry.max_rss_kb / 1024:>10.1f} {r.repair.max_rss_kb / 1024:>13.1f} "
            f"{b.used_memory / 2**20:>8.0f}"
        )
    print(
        f"(empty store: the same dry run takes {baseline.seconds:.2f}s, "
        f"peak RSS {baseline.max_rss_kb / 1024:.1f} MB: interpreter, imports, connection)"
    )
    floor = max(r.floor_kb for res in results for r in (res.dry, res.repair, res.after))
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"(launcher RSS when it spawned each command: at most {floor / 1024:.1f} MB, the lowest "
        f"peak the column can show; this bench process, which built the stores, peaked at "
        f"{own / 1024:.0f} MB: what a child spawned straight from it would have reported)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="100000,1000000",
        help="comma-separated run counts (default 100000,1000000)",
    )
    parser.add_argument("--quick", action="store_true", help="only 100 000 runs")
    parser.add_argument(
        "--profile", action="store_true", help="one more dry run of the largest size under py-spy"
    )
    args = parser.parse_args()
    sizes = [100_000] if args.quick else [int(s.replace("_", "")) for s in args.sizes.split(",")]

    def log(text: str) -> None:
        print(text, flush=True)

    load_before = os.getloadavg()
    server: RedisServer | None = None
    with tempfile.TemporaryDirectory(prefix="reconcile-bench-") as tmp:
        work = Path(tmp)
        config = work / "triggers.yaml"
        config.write_text(TRIGGERS_YAML)
        try:
            server = RedisServer(work / "redis").start()
            admin = redis.Redis.from_url(server.url, socket_timeout=60)
            version = admin.info("server")["redis_version"]
            log(f"{server.binary} {version} on port {server.port} (--save '' --appendonly no)")
            # An empty database of the same server: what a child costs with nothing to walk.
            empty_url = server.url.rsplit("/", 1)[0] + "/1"
            baseline = run_child(reconcile_argv(empty_url, config, dry_run=True), work, None, 60)
            results = [measure(n, server.url, admin, config, work, log) for n in sizes]
            profile = ""
            if args.profile:
                argv = reconcile_argv(server.url, config, dry_run=True)
                profile = profile_child(argv, work, timeout=120 + max(sizes) / 200)
            admin.flushall()
            admin.close()
        finally:
            if server is not None:
                server.stop()
    load_after = os.getloadavg()

    print()
    print(f"gateway code: {gateway_revision()}")
    print(
        f"machine: {os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, "
        f"after {load_after[0]:.2f} (1 min); Redis {version} on the same CPUs"
    )
    print_table(results, baseline)
    print()
    for r in results:
        print(f"{r.built.runs:>9} runs, dry run: {server_summary(r.dry)}")
        print(f"{r.built.runs:>9} runs, repair:  {server_summary(r.repair)}")
    if profile:
        print()
        print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
