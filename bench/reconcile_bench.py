"""Time `realm run reconcile` and measure its peak memory on stores of 100 000 and 1 000 000 runs.

    python bench/reconcile_bench.py [--sizes 100000,1000000] [--other-keys N]
                                    [--baseline REV] [--quick] [--profile]

For each size N, a private redis-server (loopback, free port, `--save ''
--appendonly no`) is flushed and filled with N runs of one workflow through
`RunStore.start_run_batch` (1 000 items per call, a few calls in flight):

* ~90 % of the idempotency keys have one run, ~10 % two: a second batch over
  those keys with `on_live_match="cancel_existing"` cancels the first run and
  starts a new one, so the key group holds two runs;
* damage for reconcile to find: the pointer (`realm:{wf}:key:<key>`) of ~1 % of
  the keys is deleted (missing), and for ~1 % of the two-run keys the pointer's
  `run` field is set back to the older run (stale);
* other workflows' keys in the same database: `--other-keys` keyed runs (default:
  N) of a second workflow, which a reconcile of the first must not need to read.

Then `python -m gateway run reconcile --workflow sync` runs as its own child
process, three times: `--dry-run`, the repair (no `--dry-run`), and `--dry-run`
again. Each is started by a tiny launcher process that reaps it with `os.wait4`,
whose rusage belongs to that one child, so its `ru_maxrss` is that process's own
peak RSS (see LAUNCHER for why not straight from this process). The reports are
checked: the first dry run must want to write exactly missing + stale pointers
across every key group; the repair must write them; the last dry run must want to
write none. With `--baseline REV` the gateway at git revision REV (a worktree of
it) runs the same three commands on the same store, the damage applied again
before each code's turn, so the two compare side by side; the current code's
`--scan` walk (the upgrade path) is timed too, as one dry run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from gateway.link.connection import redis_client  # noqa: E402
from gateway.loading import parse_config  # noqa: E402
from gateway.store.keys import Keys  # noqa: E402
from gateway.store.runstore import RunStore  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

PYTHON = sys.executable
WORKFLOW = "sync"
OTHER = "other"  # the workflow whose keys are only there to be left alone
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
  {OTHER}:
    steps: [fetch]
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
    other_keys: int = 0
    index_bytes: int = 0  # MEMORY USAGE of the key index of WORKFLOW (0: none)
    # The damage, to apply again before another code's turn: key -> older run ('' = delete).
    damage: dict[str, str] = field(default_factory=dict, repr=False)


def key_name(i: int) -> str:
    return f"order-{i:07d}"


def params_of(i: int, attempt: int) -> dict:
    return {
        "order": i,
        "customer": f"cus_{i * 7919 % 1_000_003:07d}",
        "amount_cents": 100 + attempt,
    }


async def _batches(
    store: RunStore, items: list[dict], workflow: str = WORKFLOW, **policies: str
) -> list:
    """start_run_batch over items, CHUNK per call, IN_FLIGHT calls at a time, in order."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(chunk: list[dict]) -> list:
        async with gate:
            return await store.start_run_batch(workflow, chunk, **policies)

    chunks = [items[s : s + CHUNK] for s in range(0, len(items), CHUNK)]
    results = await asyncio.gather(*(one(c) for c in chunks))
    return [entry for entries in results for entry in entries]


async def build_store(url: str, runs: int, other_keys: int, log) -> Built:
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

        damage = {key_name(i): "" for i in sorted(missing)}
        damage.update({key_name(i): older[i] for i in sorted(stale)})
        if await apply_damage(client, damage) != len(missing):
            raise SystemExit("damage: some pointers to delete were not there")

        if other_keys:
            other = await _batches(
                store,
                [{"params": {}, "idempotency_key": f"evt-{i:07d}"} for i in range(other_keys)],
                OTHER,
            )
            if any(e.error or e.result.deduped for e in other):
                raise SystemExit("other workflow: some items not started")
            log(f"  other workflow '{OTHER}': {other_keys} keyed runs")
        seconds = time.perf_counter() - started

        stored = await client.zcard(keys.runs())
        if stored != runs:
            raise SystemExit(f"expected {runs} runs in {keys.runs()}, found {stored}")
        info = await client.info("memory")
        # SAMPLES 0: every member counted, not an estimate from a sample.
        index_bytes = await client.memory_usage(keys.key_index(), samples=0) or 0
        return Built(
            runs=runs,
            keys=keys_total,
            two_run=two_total,
            missing=len(missing),
            stale=len(stale),
            seconds=seconds,
            redis_keys=await client.dbsize(),
            used_memory=int(info["used_memory"]),
            other_keys=other_keys,
            index_bytes=index_bytes,
            damage=damage,
        )
    finally:
        await client.aclose()


async def apply_damage(client, damage: dict[str, str]) -> int:
    """Delete the missing pointers, set the stale ones back; the pointers deleted."""
    keys = Keys("realm", WORKFLOW)
    async with client.pipeline(transaction=False) as pipe:
        for key, older in damage.items():
            if older:
                pipe.hset(keys.pointer(key), "run", older)
            else:
                pipe.delete(keys.pointer(key))
        done = await pipe.execute()
    return sum(d for (key, older), d in zip(damage.items(), done, strict=True) if not older)


def redamage(url: str, damage: dict[str, str]) -> None:
    async def go() -> None:
        client = redis_client(url, timeout=60.0)
        try:
            await apply_damage(client, damage)
        finally:
            await client.aclose()

    asyncio.run(go())


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


def reconcile_argv(url: str, config: Path, *, dry_run: bool, scan: bool = False) -> list[str]:
    argv = [PYTHON, "-m", "gateway", "run", "reconcile", "--redis-url", url,
            "--config", str(config), "--workflow", WORKFLOW]  # fmt: skip
    if scan:
        argv.append("--scan")
    return [*argv, "--dry-run"] if dry_run else argv


@dataclass(frozen=True)
class Code:
    """A gateway to run the commands of: this checkout, or a worktree of REV."""

    label: str
    tree: Path = ROOT

    @property
    def env(self) -> dict[str, str]:
        # `python -m gateway` from the tree's root imports the tree's own package.
        return {**os.environ, "PYTHONPATH": str(self.tree)}


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


def run_child(
    argv: list[str], work: Path, admin: redis.Redis | None, timeout: float, code: Code = Code("")
) -> Child:
    """Run argv under LAUNCHER: wall time and peak RSS of that one process."""
    if admin is not None:
        admin.config_resetstat()
    out_path, err_path, facts = work / "child.out", work / "child.err", work / "child.json"
    facts.unlink(missing_ok=True)
    with out_path.open("wb") as out, err_path.open("wb") as err:
        launcher = subprocess.Popen(
            [PYTHON, "-c", LAUNCHER, str(facts), *argv],
            cwd=code.tree,
            env=code.env,
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
class Walk:
    """One code's three commands on one store."""

    code: Code
    dry: Child
    repair: Child
    after: Child
    examined: int  # keys the walk's reads went through: the keyspace (SCAN) or the index
    scanned: Child | None = None  # this checkout's --scan dry run


@dataclass
class Result:
    built: Built
    walks: list[Walk]

    @property
    def duplicate_groups(self) -> int:
        return self.walks[0].dry.duplicate_groups


def measure_code(
    code: Code, built: Built, url: str, admin: redis.Redis, config: Path, work: Path, log
) -> Walk:
    """The three commands of one code on the store as built (damage applied again)."""
    redamage(url, built.damage)
    timeout = 60 + (built.runs + built.other_keys) / 500
    label = f"[{code.label}]"
    dry = run_child(reconcile_argv(url, config, dry_run=True), work, admin, timeout, code)
    log(f"  {label} dry run  {dry.seconds:6.2f}s  peak RSS {dry.max_rss_kb / 1024:6.1f} MB  "
        f"{dry.stdout.splitlines()[0]}")  # fmt: skip
    log(f"    {server_summary(dry)}")
    verb, pointers, groups, _ = dry.head
    expected = built.missing + built.stale
    assert verb == "Would write", dry.stdout
    assert pointers == expected, f"dry run wants {pointers} pointers, damaged {expected}"
    assert groups == built.keys, f"dry run saw {groups} key groups, built {built.keys}"
    assert dry.duplicate_groups == built.two_run, dry.stdout
    missing_stale = f"Missing pointers: {built.missing}; stale pointers: {built.stale}."
    assert missing_stale in dry.stdout, dry.stdout

    repair = run_child(reconcile_argv(url, config, dry_run=False), work, admin, timeout, code)
    log(f"  {label} repair   {repair.seconds:6.2f}s  peak RSS {repair.max_rss_kb / 1024:6.1f} MB  "
        f"{repair.stdout.splitlines()[0]}")  # fmt: skip
    log(f"    {server_summary(repair)}")
    verb, pointers, groups, _ = repair.head
    assert (verb, pointers, groups) == ("Wrote", expected, built.keys), repair.stdout

    after = run_child(reconcile_argv(url, config, dry_run=True), work, admin, timeout, code)
    log(f"  {label} dry run again {after.seconds:6.2f}s  peak RSS "
        f"{after.max_rss_kb / 1024:6.1f} MB  {after.stdout.splitlines()[0]}")  # fmt: skip
    verb, pointers, groups, current = after.head
    assert (verb, pointers, groups, current) == ("Would write", 0, built.keys, built.keys), (
        after.stdout
    )
    # What the walk read its way through: SCAN goes over every key of the database;
    # the index walk over the workflow's index (ZSCAN), one member per key.
    if "scan" in dry.server:
        examined = built.redis_keys
    else:
        assert "zscan" in dry.server, dry.server
        examined = built.keys
    return Walk(code, dry, repair, after, examined)


def measure(
    size: int, other_keys: int, codes: list[Code], url: str, admin: redis.Redis,
    config: Path, work: Path, log,
) -> Result:  # fmt: skip
    log(f"\n== {size:,} runs, {other_keys:,} keys of another workflow ==")
    built = asyncio.run(build_store(url, size, other_keys, log))
    log(
        f"  built in {built.seconds:.1f}s: {built.keys} keys ({built.two_run} with two runs), "
        f"{built.missing} pointers deleted, {built.stale} set stale; "
        f"{built.redis_keys} Redis keys, used_memory {built.used_memory / 2**20:.0f} MB; "
        f"key index {built.index_bytes / 2**20:.1f} MB"
    )
    walks = [measure_code(code, built, url, admin, config, work, log) for code in codes]
    current = next(w for w in walks if w.code.tree == ROOT)
    timeout = 60 + (built.runs + built.other_keys) / 500
    scan_argv = reconcile_argv(url, config, dry_run=True, scan=True)
    current.scanned = run_child(scan_argv, work, admin, timeout)
    log(f"  [{current.code.label} --scan] dry run {current.scanned.seconds:6.2f}s  "
        f"{current.scanned.stdout.splitlines()[0]}")  # fmt: skip
    assert current.scanned.head == ("Would write", 0, built.keys, built.keys), (
        current.scanned.stdout
    )
    return Result(built, walks)


@contextlib.contextmanager
def worktree(rev: str, where: Path):
    """A detached git worktree of ``rev``, removed afterwards (bench/listen_bench.py's)."""
    tree = where / "baseline-tree"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=ROOT,
                   check=True, timeout=60)  # fmt: skip
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       check=False, timeout=60)  # fmt: skip


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
        f"{'code':<10} {'runs':>9} {'other keys':>10} {'key groups':>10} {'build s':>8} "
        f"{'dry-run s':>9} {'repair s':>8} {'again s':>7} {'runs/s dry':>10} "
        f"{'keys walked':>11} {'SCAN':>5} {'ZSCAN':>5} {'Redis s':>7} {'RSS MB':>6} "
        f"{'Redis MB':>8} {'index B/key':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        b = r.built
        for w in r.walks:
            busy = sum(usec for _, usec in w.dry.server.values()) / 1e6
            print(
                f"{w.code.label:<10} {b.runs:>9} {b.other_keys:>10} {b.keys:>10} "
                f"{b.seconds:>8.1f} {w.dry.seconds:>9.2f} {w.repair.seconds:>8.2f} "
                f"{w.after.seconds:>7.2f} {b.runs / w.dry.seconds:>10.0f} {w.examined:>11} "
                f"{w.dry.server.get('scan', (0, 0))[0]:>5} "
                f"{w.dry.server.get('zscan', (0, 0))[0]:>5} {busy:>7.2f} "
                f"{max(w.dry.max_rss_kb, w.repair.max_rss_kb) / 1024:>6.1f} "
                f"{b.used_memory / 2**20:>8.0f} {b.index_bytes / b.keys:>11.1f}"
            )
            if w.scanned is not None:
                s = w.scanned
                busy = sum(usec for _, usec in s.server.values()) / 1e6
                print(
                    f"{'  --scan':<10} {b.runs:>9} {b.other_keys:>10} {b.keys:>10} {'':>8} "
                    f"{s.seconds:>9.2f} {'':>8} {'':>7} {b.runs / s.seconds:>10.0f} "
                    f"{b.redis_keys:>11} {s.server.get('scan', (0, 0))[0]:>5} "
                    f"{s.server.get('zscan', (0, 0))[0]:>5} {busy:>7.2f} "
                    f"{s.max_rss_kb / 1024:>6.1f}"
                )
    print(
        f"(empty store: the same dry run takes {baseline.seconds:.2f}s, "
        f"peak RSS {baseline.max_rss_kb / 1024:.1f} MB: interpreter, imports, connection)"
    )
    children = [c for res in results for w in res.walks for c in (w.dry, w.repair, w.after)]
    floor = max(c.floor_kb for c in children)
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
    parser.add_argument(
        "--other-keys",
        type=int,
        default=-1,
        help=f"keyed runs of another workflow ('{OTHER}') in the same database "
        "(default: as many as the size's runs; 0: none)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the gateway at git revision REV (a worktree) on the same stores",
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
    with (
        tempfile.TemporaryDirectory(prefix="reconcile-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        work = Path(tmp)
        config = work / "triggers.yaml"
        config.write_text(TRIGGERS_YAML)
        codes = [Code("gateway")]
        if args.baseline:
            # The baseline first: it reads the store as built, the pointers not yet repaired.
            codes.insert(0, Code(args.baseline, stack.enter_context(worktree(args.baseline, work))))
        try:
            server = RedisServer(work / "redis").start()
            admin = redis.Redis.from_url(server.url, socket_timeout=60)
            version = admin.info("server")["redis_version"]
            log(f"{server.binary} {version} on port {server.port} (--save '' --appendonly no)")
            # An empty database of the same server: what a child costs with nothing to walk.
            empty_url = server.url.rsplit("/", 1)[0] + "/1"
            baseline = run_child(reconcile_argv(empty_url, config, dry_run=True), work, None, 60)
            results = [
                measure(n, n if args.other_keys < 0 else args.other_keys, codes, server.url,
                        admin, config, work, log)
                for n in sizes
            ]  # fmt: skip
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
    if args.baseline:
        print(f"baseline code: {args.baseline} (a worktree of it, same store and settings)")
    print(
        f"machine: {os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, "
        f"after {load_after[0]:.2f} (1 min); Redis {version} on the same CPUs"
    )
    print_table(results, baseline)
    print()
    for r in results:
        for w in r.walks:
            print(f"[{w.code.label}] {r.built.runs:>9} runs, dry run: {server_summary(w.dry)}")
            print(f"[{w.code.label}] {r.built.runs:>9} runs, repair:  {server_summary(w.repair)}")
            if w.scanned is not None:
                print(f"[{w.code.label} --scan] {r.built.runs:>9} runs, dry run: "
                      f"{server_summary(w.scanned)}")  # fmt: skip
    if profile:
        print()
        print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
