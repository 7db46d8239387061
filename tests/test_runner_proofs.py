"""Runners against real processes on loopback.

Each runner is a process of its own (tests/runner_worker.py) that loops take_steps →
handler effect → complete_step on the store's runner API, with several tasks, and
writes what it did to an append-only file per process: ``begin``, ``effect`` (written
before complete_step, as a real side effect would be), ``done`` (accepted) or
``discarded`` (refused, with the code). The tests read those files, the runs and the
streams, and assert:

1. many runs through 4 runners of 4 tasks: every step's effect happens exactly once,
   each run completes, each (run, step) is completed once and queued once;
2. a runner killed with SIGKILL in the middle of a step: after its lease another
   runner runs the step, as attempt 2, and exactly one result is recorded;
3. a run cancelled while its step executes: the late result is discarded
   (STATE_RUN_NOT_LIVE) and the runner told; no next step is queued; a step of a run
   cancelled before any runner took it is never handed out;
4. two runners racing on one step after a lease expiry (the first SIGSTOPped past its
   lease): one result recorded, the other told STATE_STEP_NOT_CURRENT;
5. Redis killed with SIGKILL (appendfsync always) and restarted during the work, and a
   Sentinel failover with ``durability: {replicas: 1}``: no step lost, none completed
   twice;
6. the stream stays bounded: the sweep trims acknowledged entries to none, and never a
   pending one.

Sizes are small so the module stays within about a minute on 2 cores (see N_RUNS).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as redis_sync

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.store.runstore import RunStore
from gateway.store.sweep import sweep
from tests.sentinel import SentinelDeployment
from tests.servers import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.faults]

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "runner_worker.py"
GROUP = "runners"

# Proof 1's size. The issue asks for 1 000 runs; 1 000 runs of 2 steps (2 000 steps)
# through 4 runner processes take about 5-10 s on this 2-core machine.
N_RUNS = 1000
LEASE_MS = 1000  # short leases: a lapsed one is seen within a second

CONFIG = """\
version: 1
workflows:
  chain:
    steps: [fetch, build]
    retention: 1h
    partitions: 2
  trio:
    steps: [fetch, build, release]
    retention: 1h
  trim:
    steps: [fetch, build]
    retention: 1h
    stream_retention: 1s
    partitions: 2
"""
DURABLE = CONFIG + "settings:\n  durability: {replicas: 1}\n"


# --------------------------------------------------------------------------- runners


@dataclass
class Record:
    kind: str  # begin, effect, done, discarded
    runner: str
    run: str
    step: str
    attempt: int
    rest: list[str]


@dataclass
class Runners:
    """Runner processes of one test, each with its own log; all stopped at the end."""

    folder: Path
    url: str
    config: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(
        self,
        name: str,
        workflow: str,
        *,
        concurrency: int = 4,
        hold: str = "",
        release: Path | None = None,
        runner: bool = False,
    ) -> subprocess.Popen[bytes]:
        """``runner``: the product's Runner (gateway/runners/runner.py) drives the handler,
        instead of the worker's own take/complete loop on the store."""
        cmd = [sys.executable, str(WORKER), "--redis-url", self.url, "--config",
               str(self.config), "--workflow", workflow, "--name", name,
               "--log", str(self.folder / f"{name}.log"), "--concurrency", str(concurrency),
               "--lease-ms", str(LEASE_MS), "--hold", hold, "--max-seconds", "90"]  # fmt: skip
        if release is not None:
            cmd += ["--release", str(release)]
        if runner:
            cmd.append("--runner")
        with (self.folder / f"{name}.err").open("ab") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        self.procs[name] = proc
        return proc

    def records(self) -> list[Record]:
        out: list[Record] = []
        for name in self.procs:
            path = self.folder / f"{name}.log"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                kind, run, step, attempt, *rest = line.split(" ")
                out.append(Record(kind, name, run, step, int(attempt), rest))
        return out

    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records() if r.kind == kind]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode not in (0, -9):
                err = (self.folder / f"{name}.err").read_text(errors="replace")[-3000:]
                raise AssertionError(f"runner {name} exited {proc.returncode}:\n{err}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[name].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def runners_at(tmp_path: Path) -> Iterator[Callable[[str, str], Runners]]:
    made: list[Runners] = []

    def make(url: str, config_text: str = CONFIG) -> Runners:
        config = tmp_path / "triggers.yaml"
        config.write_text(config_text)
        made.append(Runners(tmp_path, url, config))
        return made[-1]

    yield make
    for runners in made:
        runners.stop()


async def until(what: str, check: Callable[[], object], timeout: float, runners: Runners) -> None:
    """Poll ``check`` (sync or async) until it is truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        runners.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


def finished(runners: Runners, last_step: str) -> int:
    """Runs whose last step a runner recorded."""
    return sum(1 for r in runners.of("done") if r.step == last_step)


def make_store(url: str, text: str = CONFIG) -> RunStore:
    config: Config = parse_config(text, file="test.yaml", with_triggers=False)
    return RunStore(redis_client(url, 5.0), config, timeout=5.0)


@pytest.fixture
async def store(module_redis: RedisServer, db: redis_sync.Redis) -> AsyncIterator[RunStore]:
    made = make_store(module_redis.url)
    yield made
    await made.redis.aclose()


async def start_runs(store: RunStore, workflow: str, n: int) -> list[str]:
    ids: list[str] = []
    for first in range(0, n, 500):
        entries = await store.start_run_batch(workflow, [{}] * min(500, n - first))
        ids += [e.result.run_id for e in entries if e.result is not None]
    assert len(ids) == n
    return ids


# --------------------------------------------------------------------------- checks


def streams(db: redis_sync.Redis, store: RunStore, workflow: str) -> list[str]:
    return [keys.stream() for keys in store.partitions(workflow)]


def queued(db: redis_sync.Redis, store: RunStore, workflow: str) -> Counter[tuple[str, str]]:
    """(run, step) → stream entries: one per time a step was made ready."""
    seen: Counter[tuple[str, str]] = Counter()
    for stream in streams(db, store, workflow):
        for _, entry in db.xrange(stream):
            seen[(entry["run_id"], entry["step"])] += 1
    return seen


def pending(db: redis_sync.Redis, store: RunStore, workflow: str) -> int:
    return sum(int(db.xpending(s, GROUP)["pending"]) for s in streams(db, store, workflow))


def phases(db: redis_sync.Redis, store: RunStore, workflow: str, ids: list[str]) -> Counter[str]:
    pipe = db.pipeline(transaction=False)
    for run_id in ids:
        pipe.hget(store.keys_for_run(workflow, run_id).run(run_id), "phase")
    return Counter(pipe.execute())


def assert_exactly_once(
    db: redis_sync.Redis,
    store: RunStore,
    runners: Runners,
    workflow: str,
    ids: list[str],
    *,
    strict_effects: bool,
) -> None:
    """Every run completed; every (run, step) queued once, completed once, its effect
    done (exactly once with ``strict_effects``); each step saw its predecessor's output;
    nothing left pending."""
    steps = store.config.workflows[workflow].steps
    want = {(run_id, step) for run_id in ids for step in steps}
    assert phases(db, store, workflow, ids) == Counter({"completed": len(ids)})
    assert queued(db, store, workflow) == Counter(dict.fromkeys(want, 1)), "queued twice"
    records = runners.records()
    done = Counter((r.run, r.step) for r in records if r.kind == "done")
    assert done == Counter(dict.fromkeys(want, 1)), "a step recorded twice or never"
    effects = Counter((r.run, r.step) for r in records if r.kind == "effect")
    assert set(effects) == want, "a step's effect never happened"
    if strict_effects:
        assert max(effects.values()) == 1, "an effect happened twice with no fault"
    for r in records:
        if r.kind == "effect":
            i = steps.index(r.step)
            assert r.rest[0] == ("-" if i == 0 else steps[i - 1]), f"output not handed on: {r}"
    assert pending(db, store, workflow) == 0


def server_ms(db: redis_sync.Redis) -> int:
    seconds, micros = db.time()
    return seconds * 1000 + micros // 1000


def run_hash(db: redis_sync.Redis, store: RunStore, workflow: str, run_id: str) -> dict:
    return db.hgetall(store.keys_for_run(workflow, run_id).run(run_id))


# --------------------------------------------------------------------------- proofs


# store: the worker's own loop on the store API; runner: the product's Runner.
modes = pytest.mark.parametrize("runner", [False, True], ids=["store", "runner"])


@modes
async def test_many_runs_through_four_runners_each_step_once(
    store: RunStore, db: redis_sync.Redis, module_redis: RedisServer, runners_at, runner: bool
) -> None:
    runners = runners_at(module_redis.url)
    ids = await start_runs(store, "chain", N_RUNS)
    t0 = time.monotonic()
    for i in range(4):
        runners.start(f"r{i}", "chain", concurrency=4, runner=runner)
    await until(
        "every run completed",
        lambda: finished(runners, "build") >= N_RUNS,
        60,
        runners,
    )
    elapsed = time.monotonic() - t0
    runners.stop()
    assert_exactly_once(db, store, runners, "chain", ids, strict_effects=True)
    by_runner = Counter(r.runner for r in runners.of("done"))
    assert len(by_runner) == 4, f"every runner took steps: {by_runner}"
    how = "Runner" if runner else "store loop"
    print(f"FIGURES runners ({how}): {N_RUNS} runs x 2 steps through 4 runners x 4 tasks in "
          f"{elapsed:.1f} s (incl. start-up), by runner {dict(by_runner)}")  # fmt: skip


@modes
async def test_runner_killed_mid_step_another_runs_it_as_attempt_two(
    store: RunStore, db: redis_sync.Redis, module_redis: RedisServer, runners_at, runner: bool
) -> None:
    runners = runners_at(module_redis.url)
    [run_id] = await start_runs(store, "trio", 1)
    # It blocks in fetch's handler, forever (the Runner extends the lease meanwhile).
    runners.start("dies", "trio", hold="fetch", runner=runner)
    await until("the step began", lambda: runners.of("begin"), 20, runners)
    runners.kill("dies")
    held = run_hash(db, store, "trio", run_id)
    assert (held["step"], held["attempt"]) == ("fetch", "1")
    runners.start("takes-over", "trio", runner=runner)
    await until(
        "the run completed",
        lambda: run_hash(db, store, "trio", run_id).get("phase") == "completed",
        20,
        runners,
    )
    runners.stop()
    begins = [(r.runner, r.step, r.attempt) for r in runners.of("begin")]
    assert begins == [("dies", "fetch", 1), ("takes-over", "fetch", 2),
                      ("takes-over", "build", 1), ("takes-over", "release", 1)]  # fmt: skip
    # Not taken before the dead runner's lease lapsed (server clock).
    taken_again = next(r for r in runners.of("begin") if r.runner == "takes-over")
    assert int(taken_again.rest[0]) >= int(held["lease_until"])
    done = [(r.runner, r.step, r.attempt) for r in runners.of("done")]
    assert done == [("takes-over", "fetch", 2), ("takes-over", "build", 1),
                    ("takes-over", "release", 1)]  # fmt: skip
    assert not [r for r in runners.of("effect") if r.runner == "dies"]
    assert_exactly_once(db, store, runners, "trio", [run_id], strict_effects=True)


async def test_run_cancelled_while_its_step_runs_discards_the_late_result(
    store: RunStore, db: redis_sync.Redis, module_redis: RedisServer, runners_at, tmp_path: Path
) -> None:
    runners = runners_at(module_redis.url)
    # A run cancelled before any runner looked: its step must never be handed out.
    [early] = await start_runs(store, "trio", 1)
    assert await store.cancel_run(early) == 1
    [run_id] = await start_runs(store, "trio", 1)
    release = tmp_path / "release"
    runners.start("slow", "trio", concurrency=2, hold="fetch", release=release)
    await until("the step began", lambda: runners.of("begin"), 20, runners)
    assert await store.cancel_run(run_id) == 1
    release.touch()
    await until("the runner was told", lambda: runners.of("discarded"), 20, runners)
    # The other task went through the early run's entry too: acknowledged, not handed out.
    await until("nothing pending", lambda: pending(db, store, "trio") == 0, 20, runners)
    runners.stop()
    [told] = runners.of("discarded")
    assert (told.run, told.step, told.rest) == (run_id, "fetch", ["STATE_RUN_NOT_LIVE"])
    assert [r.run for r in runners.of("effect")] == [run_id]  # the handler did run
    assert runners.of("done") == []
    assert [r.run for r in runners.of("begin")] == [run_id]  # never the early one
    assert queued(db, store, "trio") == Counter({(early, "fetch"): 1, (run_id, "fetch"): 1})
    assert phases(db, store, "trio", [early, run_id]) == Counter({"cancelled": 2})


async def test_two_runners_race_after_a_lease_lapses_one_result_recorded(
    store: RunStore, db: redis_sync.Redis, module_redis: RedisServer, runners_at, tmp_path: Path
) -> None:
    runners = runners_at(module_redis.url)
    [run_id] = await start_runs(store, "trio", 1)
    first, second = tmp_path / "release-first", tmp_path / "release-second"
    runners.start("stalls", "trio", concurrency=1, hold="fetch", release=first)
    await until("the step began", lambda: runners.of("begin"), 20, runners)
    runners.kill("stalls", signal.SIGSTOP)
    lease_until = int(run_hash(db, store, "trio", run_id)["lease_until"])
    await until("the lease lapsed", lambda: server_ms(db) > lease_until, 10, runners)
    runners.start("newer", "trio", concurrency=1, hold="fetch", release=second)
    await until(
        "the second runner holds the step",
        lambda: [r for r in runners.of("begin") if r.runner == "newer"],
        20,
        runners,
    )
    # Both are in fetch's handler now; the stalled one finishes first.
    first.touch()
    runners.kill("stalls", signal.SIGCONT)
    await until("the stalled runner was told", lambda: runners.of("discarded"), 20, runners)
    second.touch()
    await until(
        "the run completed",
        lambda: run_hash(db, store, "trio", run_id).get("phase") == "completed",
        20,
        runners,
    )
    runners.stop()
    [told] = runners.of("discarded")
    assert (told.runner, told.step, told.attempt, told.rest) == (
        "stalls", "fetch", 1, ["STATE_STEP_NOT_CURRENT"]
    )  # fmt: skip
    fetch_done = [(r.runner, r.attempt) for r in runners.of("done") if r.step == "fetch"]
    assert fetch_done == [("newer", 2)]
    # Both handlers ran fetch (at least once is the promise); one result counts.
    assert sorted(r.runner for r in runners.of("effect") if r.step == "fetch") == [
        "newer", "stalls"
    ]  # fmt: skip
    assert_exactly_once(db, store, runners, "trio", [run_id], strict_effects=False)


async def work_through_a_fault(
    store: RunStore,
    runners: Runners,
    n: int,
    fault: Callable[[], None],
    name: str,
) -> list[str]:
    """n runs through 2 runners; ``fault`` once a third of the steps are done."""
    ids = await start_runs(store, "chain", n)
    runners.start("a", "chain")
    runners.start("b", "chain")
    await until("a third done", lambda: len(runners.of("done")) >= 2 * n // 3, 30, runners)
    before = len(runners.of("done"))
    t0 = time.monotonic()
    fault()
    await until(
        "every run completed",
        lambda: finished(runners, "build") >= n,
        45,
        runners,
    )
    runners.stop()
    assert before < 2 * n, "the fault came after the work"
    effects = Counter((r.run, r.step) for r in runners.of("effect"))
    print(f"FIGURES runners-{name}: {n} runs x 2 steps; fault at {before} steps done; "
          f"all done {time.monotonic() - t0:.1f} s later; "
          f"{sum(c > 1 for c in effects.values())} effects repeated")  # fmt: skip
    return ids


async def test_redis_killed_and_restarted_during_work_no_step_lost_or_doubled(
    start_redis: Callable[..., RedisServer], runners_at
) -> None:
    server = start_redis("--appendfsync", "always", appendonly=True)
    runners = runners_at(server.url)
    store = make_store(server.url)

    def restart() -> None:
        server.kill()
        server.start()

    try:
        ids = await work_through_a_fault(store, runners, 300, restart, "restart")
        with redis_sync.Redis.from_url(server.url, decode_responses=True) as db:
            assert_exactly_once(db, store, runners, "chain", ids, strict_effects=False)
    finally:
        await store.redis.aclose()


async def test_sentinel_failover_during_work_durable_no_step_lost_or_doubled(
    sentinel: SentinelDeployment, sentinel_db: redis_sync.Redis, runners_at
) -> None:
    runners = runners_at(sentinel.url(), DURABLE)
    store = make_store(sentinel.url(), DURABLE)

    def failover() -> None:
        old = sentinel.kill_primary()
        sentinel.wait_for_promotion(old.port)

    try:
        ids = await work_through_a_fault(store, runners, 200, failover, "failover")
        with sentinel.client() as db:
            assert_exactly_once(db, store, runners, "chain", ids, strict_effects=False)
    finally:
        await store.redis.aclose()


async def test_stream_is_trimmed_to_nothing_but_pending_entries(
    store: RunStore, db: redis_sync.Redis, module_redis: RedisServer, runners_at
) -> None:
    runners = runners_at(module_redis.url)
    ids = await start_runs(store, "trim", 200)
    runners.start("a", "trim")
    await until(
        "every run completed",
        lambda: finished(runners, "build") >= 200,
        30,
        runners,
    )
    runners.stop()
    assert sum(db.xlen(s) for s in streams(db, store, "trim")) == 400
    # One more run, whose step this test takes and holds.
    [held_id] = await start_runs(store, "trim", 1)
    [held] = await store.take_steps("trim", "holder", lease_ms=60_000)
    assert held.run_id == held_id
    newest = max(int(entry[0].split("-")[0]) for s in streams(db, store, "trim")
                 for entry in db.xrevrange(s, count=1))  # fmt: skip
    await until("past stream_retention", lambda: server_ms(db) > newest + 1100, 10, runners)
    await sweep(store, "trim")
    left = [e for s in streams(db, store, "trim") for e in db.xrange(s)]
    assert [e[0] for e in left] == [held.entry_id], "only the pending entry stays"
    assert pending(db, store, "trim") == 1
    await store.complete_step(held.run_id, held.step, lease=held.lease)
    [last] = await store.take_steps("trim", "holder")
    await store.complete_step(last.run_id, last.step, lease=last.lease)
    assert run_hash(db, store, "trim", held_id)["phase"] == "completed"
    newest = server_ms(db)
    await until("past stream_retention", lambda: server_ms(db) > newest + 1100, 10, runners)
    await sweep(store, "trim")
    assert sum(db.xlen(s) for s in streams(db, store, "trim")) == 0
    assert pending(db, store, "trim") == 0
    assert phases(db, store, "trim", ids) == Counter({"completed": 200})
