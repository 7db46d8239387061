"""Runners' steps in the store: taken under a lease, completed or failed
once, retried with backoff, never handed out for a run that ended. Real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import RealmError
from gateway.store.keys import Keys
from gateway.store.runs import TakenStep
from gateway.store.runstore import RunStore
from gateway.store.steps import RUNNERS_GROUP
from gateway.store.sweep import sweep

YAML = """
version: 1
workflows:
  job:
    steps: [fetch, build, ship]
    max_attempts: 2
    retry_backoff: 1s
    lease: 30s
    retention: 1h
  wide:
    steps: [only]
    partitions: 3
"""
STREAM = Keys("realm", "job").stream()


@pytest.fixture
def job_config() -> Config:
    return parse_config(YAML, file="job.yaml", with_triggers=False)


@pytest.fixture
async def jobs(redis: Redis, job_config: Config) -> RunStore:
    return RunStore(redis, job_config, timeout=5.0)


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def pending(redis: Redis, stream: str = STREAM) -> int:
    return int((await redis.xpending(stream, RUNNERS_GROUP))["pending"])


async def test_a_run_goes_step_by_step_with_outputs_handed_on(jobs: RunStore, redis) -> None:
    run = await jobs.start_run("job", {"repo": "acme/app"})
    outputs = []
    for step, output in (("fetch", {"sha": "abc"}), ("build", {"image": "x:1"}), ("ship", None)):
        [taken] = await jobs.take_steps("job", "r1")
        assert (taken.run_id, taken.step, taken.attempt) == (run.run_id, step, 1)
        assert taken.params == {"repo": "acme/app"}
        outputs.append(taken.output)
        await jobs.complete_step(run.run_id, step, lease=taken.lease, output=output,
                                 entry_id=taken.entry_id)  # fmt: skip
    assert outputs == [None, {"sha": "abc"}, {"image": "x:1"}]
    assert (await jobs.get_run(run.run_id)).phase == "completed"
    assert await jobs.take_steps("job", "r1") == []
    assert await pending(redis) == 0, "every entry acknowledged"


async def test_a_held_step_is_not_handed_out_twice(jobs: RunStore) -> None:
    await jobs.start_run("job", {})
    first = await jobs.take_steps("job", "r1")
    assert len(first) == 1
    assert await jobs.take_steps("job", "r2") == []


async def test_a_lapsed_lease_goes_to_another_runner_and_the_late_result_is_discarded(
    jobs: RunStore,
) -> None:
    run = await jobs.start_run("job", {})
    [stalled] = await jobs.take_steps("job", "r1", lease_ms=100)
    again: list = []

    async def retaken() -> bool:
        again.extend(await jobs.take_steps("job", "r2"))
        return bool(again)

    await until(retaken)
    [fresh] = again
    assert (fresh.run_id, fresh.step, fresh.attempt) == (run.run_id, "fetch", 2)
    with pytest.raises(RealmError) as late:
        await jobs.complete_step(run.run_id, "fetch", lease=stalled.lease)
    assert late.value.code == "STATE_STEP_NOT_CURRENT"
    assert "newer lease" in late.value.message
    done = await jobs.complete_step(run.run_id, "fetch", lease=fresh.lease)
    assert done.next_step == "build"
    # One result recorded: one entry for the next step.
    assert [e[1][b"step"] for e in await jobs.redis.xrange(STREAM)] == [b"fetch", b"build"]


async def test_a_run_cancelled_while_its_step_runs_discards_the_result(
    jobs: RunStore, redis: Redis
) -> None:
    run = await jobs.start_run("job", {})
    [taken] = await jobs.take_steps("job", "r1")
    assert await jobs.cancel_run(run.run_id) == 1
    with pytest.raises(RealmError) as late:
        await jobs.complete_step(run.run_id, "fetch", lease=taken.lease, entry_id=taken.entry_id)
    assert late.value.code == "STATE_RUN_NOT_LIVE"
    assert await redis.xlen(STREAM) == 1, "no next step was queued"
    assert await pending(redis) == 0


async def test_a_step_of_an_ended_run_is_never_handed_out(jobs: RunStore, redis: Redis) -> None:
    await jobs.ensure_groups("job")
    run = await jobs.start_run("job", {})
    await jobs.cancel_run(run.run_id)
    other = await jobs.start_run("job", {})
    taken = await jobs.take_steps("job", "r1", count=10)
    assert [t.run_id for t in taken] == [other.run_id]
    assert await pending(redis) == 1  # only the live run's step


async def test_a_failed_attempt_is_retried_after_its_backoff_then_the_run_fails(
    jobs: RunStore,
) -> None:
    run = await jobs.start_run("job", {})
    [first] = await jobs.take_steps("job", "r1")
    failure = await jobs.fail_step(run.run_id, "fetch", "boom 1", lease=first.lease)
    assert (failure.phase, failure.attempt) == ("running", 1)
    assert failure.retry_at_ms is not None
    assert await jobs.take_steps("job", "r2") == [], "not before the backoff"
    again: list = []

    async def retried() -> bool:
        again.extend(await jobs.take_steps("job", "r2"))
        return bool(again)

    await until(retried)
    assert again[0].attempt == 2
    last = await jobs.fail_step(run.run_id, "fetch", "boom 2", lease=again[0].lease)
    assert (last.phase, last.retry_at_ms) == ("failed", None)
    ended = await jobs.get_run(run.run_id)
    assert (ended.phase, ended.error) == ("failed", "boom 2")


async def test_a_heartbeat_keeps_the_step(jobs: RunStore) -> None:
    run = await jobs.start_run("job", {})
    [taken] = await jobs.take_steps("job", "r1", lease_ms=200)
    until_ms = await jobs.extend_lease(run.run_id, "fetch", taken.lease, 60_000)
    assert until_ms > taken.lease_until_ms
    await asyncio.sleep(1.3)  # past the first lease and the autoclaim idle time
    assert await jobs.take_steps("job", "r2") == []


async def test_output_is_bounded_and_json(jobs: RunStore) -> None:
    run = await jobs.start_run("job", {})
    [taken] = await jobs.take_steps("job", "r1")
    with pytest.raises(RealmError) as big:
        await jobs.complete_step(run.run_id, "fetch", lease=taken.lease, output="x" * 70_000)
    assert big.value.code == "VALIDATION_PARAMS" and "at most" in big.value.message


async def test_the_sweep_never_trims_a_step_not_yet_acknowledged(jobs: RunStore, redis) -> None:
    """Entries waiting for a runner or in a runner's hands stay, however old."""
    await jobs.ensure_groups("job")
    runs = [await jobs.start_run("job", {"n": n}) for n in range(6)]
    taken = await jobs.take_steps("job", "r1", count=3)
    wf = jobs.config.workflows["job"]
    object.__setattr__(wf, "stream_retention_ms", 1)  # everything is "old"
    await asyncio.sleep(0.01)
    await sweep(jobs, "job")
    assert await redis.xlen(STREAM) == 6
    for t in taken:
        await jobs.complete_step(t.run_id, "fetch", lease=t.lease, entry_id=t.entry_id)
    rest = await jobs.take_steps("job", "r1", count=3)  # the other three fetches
    assert {t.step for t in rest} == {"fetch"}
    for t in rest:
        await jobs.complete_step(t.run_id, t.step, lease=t.lease, entry_id=t.entry_id)
    await asyncio.sleep(0.01)
    await sweep(jobs, "job")
    # The six fetch entries were acknowledged and trimmed; the six build ones wait.
    assert await redis.xlen(STREAM) == 6
    assert {e[1][b"step"] for e in await redis.xrange(STREAM)} == {b"build"}
    assert len(runs) == 6


async def test_steps_of_a_partitioned_workflow_are_taken_from_every_partition(
    jobs: RunStore,
) -> None:
    started = {(await jobs.start_run("wide", {"n": n})).run_id for n in range(30)}
    taken = set()
    for _ in range(10):
        for step in await jobs.take_steps("wide", "r1", count=30):
            taken.add(step.run_id)
            await jobs.complete_step(step.run_id, "only", lease=step.lease)
        if taken == started:
            break
    assert taken == started


async def test_a_second_runner_process_finds_the_group_there(
    redis: Redis, job_config: Config
) -> None:
    """The group exists (BUSYGROUP): not Redis's BUSY, so a second store takes steps."""
    first, second = (RunStore(redis, job_config, timeout=5.0) for _ in range(2))
    run = await first.start_run("job", {})
    assert await first.take_steps("job", "r1") != []
    await first.complete_step(run.run_id, "fetch", lease=(await _lease_of(redis, run.run_id)))
    [taken] = await second.take_steps("job", "r2")
    assert (taken.run_id, taken.step) == (run.run_id, "build")


async def _lease_of(redis: Redis, run_id: str) -> str:
    return (await redis.hget(Keys("realm", "job").run(run_id), "lease")).decode()


async def _taken_once_ready(store: RunStore, runner: str, lease_ms: int) -> TakenStep:
    """The next take of ``runner`` that gets a step (a lapsed lease is due soon)."""
    got: list[TakenStep] = []

    async def taken() -> bool:
        got.extend(await store.take_steps("job", runner, lease_ms=lease_ms))
        return bool(got)

    await until(taken)
    [step] = got
    return step


async def test_a_lease_that_lapses_on_the_last_attempt_fails_the_run(
    jobs: RunStore, redis: Redis
) -> None:
    """A runner that never reports (killed by its handler, a poison payload) uses an
    attempt each time its lease lapses: past max_attempts (2) the run fails, and the
    step is never handed out a third time."""
    run = await jobs.start_run("job", {}, "order-9")
    [first] = await jobs.take_steps("job", "r1", lease_ms=100)
    second = await _taken_once_ready(jobs, "r2", lease_ms=100)
    assert (first.attempt, second.attempt) == (1, 2)
    deadline = time.monotonic() + 10
    while (ended := await jobs.get_run(run.run_id)).phase == "running":
        again = await jobs.take_steps("job", "r3", lease_ms=100)
        assert again == [], f"handed out past max_attempts: attempt {again[0].attempt}"
        assert time.monotonic() < deadline, "the run did not fail"
        await asyncio.sleep(0.05)
    assert ended.phase == "failed"
    assert ended.error == (
        "the lease on step 'fetch' lapsed on its last attempt (2 of 2): its runner "
        "neither reported nor extended it in time"
    )
    pointer = Keys("realm", "job").pointer("order-9")
    assert await redis.hget(pointer, "phase") == b"failed", "the key's pointer says so too"
    assert await pending(redis) == 0, "the step's entry was acknowledged"
    assert await jobs.take_steps("job", "r3") == []
    with pytest.raises(RealmError) as late:
        await jobs.complete_step(run.run_id, "fetch", lease=second.lease)
    assert late.value.code == "STATE_RUN_NOT_LIVE"


async def test_a_new_step_is_taken_first_however_many_steps_others_hold(
    jobs: RunStore, redis: Redis
) -> None:
    """200 steps held under valid leases, idle long enough to be looked at again: the
    one new step goes to the next take, and no held step changes hands."""
    await jobs.start_run_batch("job", [{"params": {"n": n}} for n in range(200)])
    held = await jobs.take_steps("job", "holder", count=200, lease_ms=60_000)
    assert len(held) == 200

    async def all_idle() -> bool:  # past the idle time after which entries were re-claimed
        rows = await redis.xpending_range(STREAM, RUNNERS_GROUP, "-", "+", 200)
        return min(row["time_since_delivered"] for row in rows) > 1_100

    await until(all_idle)
    fresh = await jobs.start_run("job", {"n": "new"})
    [taken] = await jobs.take_steps("job", "r2")
    assert (taken.run_id, taken.attempt) == (fresh.run_id, 1)
    assert await jobs.take_steps("job", "r3") == []
    owners = await _pending_by_consumer(redis)
    assert owners == {"holder": 200, "r2": 1}, "a held step was re-claimed"


async def _pending_by_consumer(redis: Redis) -> dict[str, int]:
    summary = await redis.xpending(STREAM, RUNNERS_GROUP)
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"]}


async def test_a_step_completed_without_output_hands_null_to_the_next(jobs: RunStore) -> None:
    run = await jobs.start_run("job", {})
    [fetch] = await jobs.take_steps("job", "r1")
    await jobs.complete_step(run.run_id, "fetch", lease=fetch.lease, output={"sha": "abc"})
    [build] = await jobs.take_steps("job", "r1")
    assert build.output == {"sha": "abc"}
    await jobs.complete_step(run.run_id, "build", lease=build.lease)  # no output
    [ship] = await jobs.take_steps("job", "r1")
    assert (ship.step, ship.output) == ("ship", None)
