"""The in-process Runner and the handlers of triggers.yaml (gateway/runners/runner.py,
gateway/runners/handlers.py), against a real Redis server."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.errors import ConfigError
from gateway.runners.handlers import (
    CommandHandler,
    HandlerFailed,
    build_handlers,
    command_env,
    parse_handlers,
    run_command,
)
from gateway.runners.runner import Runner, StepOutcome
from gateway.signatures.spec import VerifySpec
from gateway.signatures.verify import verify
from gateway.store.runs import TakenStep
from gateway.store.runstore import RunStore

YAML = """
version: 1
workflows:
  sync:
    steps: [fetch, transform, load]
    max_attempts: 2
    retry_backoff: 1s
  once:
    steps: [only]
    max_attempts: 1
  spread:
    steps: [a, b]
    partitions: 4
"""
SECRET = "whsec_c2VjcmV0LWtleS1mb3ItdGVzdHM="  # base64 of "secret-key-for-tests"


@pytest.fixture
async def rstore(redis: Redis) -> RunStore:
    return RunStore(redis, parse_config(YAML, file="t.yaml", with_triggers=False), timeout=5.0)


async def until(check: Any, timeout: float = 10.0) -> Any:
    """Poll an async condition until it holds (or fail at the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"not true within {timeout}s")


async def run_until_ended(runner: Runner, store: RunStore, run_id: str, timeout: float = 10.0):
    outcomes: list[StepOutcome] = []

    async def ended() -> bool:
        outcomes.extend(await runner.run_once())
        return (await store.get_run(run_id)).phase != "running"

    await until(ended, timeout)
    return outcomes, await store.get_run(run_id)


def taken(step: str = "fetch", attempt: int = 1, output: Any = None) -> TakenStep:
    return TakenStep(run_id="r-1", workflow="sync", step=step, attempt=attempt,
                     params={"repo": "a/b"}, output=output, lease="l", lease_until_ms=0,
                     entry_id="1-0")  # fmt: skip


# --------------------------------------------------------------------------- Runner


async def test_the_runner_completes_a_three_step_run_passing_each_output_to_the_next(
    rstore: RunStore,
) -> None:
    seen: list[tuple[str, int, Any, dict]] = []

    async def handler(step: TakenStep) -> Any:
        seen.append((step.step, step.attempt, step.output, dict(step.params)))
        return {"after": step.step, "n": (step.output or {"n": 0})["n"] + 1}

    start = await rstore.start_run("sync", {"x": 1})
    runner = Runner(rstore, "sync", {"fetch": handler, "transform": handler, "load": handler})
    outcomes, run = await run_until_ended(runner, rstore, start.run_id)
    assert run.phase == "completed"
    assert seen == [
        ("fetch", 1, None, {"x": 1}),
        ("transform", 1, {"after": "fetch", "n": 1}, {"x": 1}),
        ("load", 1, {"after": "transform", "n": 2}, {"x": 1}),
    ]
    assert [(o.step, o.result) for o in outcomes] == [
        ("fetch", "ok"), ("transform", "ok"), ("load", "ok")]  # fmt: skip
    assert runner.counts["ok"] == 3


async def test_the_runner_takes_steps_from_every_partition_of_a_workflow(rstore: RunStore) -> None:
    done: list[tuple[str, str]] = []

    async def handler(step: TakenStep) -> None:
        done.append((step.run_id, step.step))

    ids = [(await rstore.start_run("spread", {}, f"k{i}")).run_id for i in range(12)]
    assert len({i[-4:] for i in ids}) > 1  # the keys fell in several partitions
    runner = Runner(rstore, "spread", {"a": handler, "b": handler}, concurrency=4)
    await asyncio.wait_for(runner.run(until_idle=True), 20)
    assert sorted(done) == sorted((i, s) for i in ids for s in ("a", "b"))
    assert {(await rstore.get_run(i)).phase for i in ids} == {"completed"}


async def test_a_failing_handler_is_retried_up_to_max_attempts_then_the_run_fails(
    rstore: RunStore,
) -> None:
    attempts: list[int] = []

    async def fetch(step: TakenStep) -> Any:
        attempts.append(step.attempt)
        raise RuntimeError(f"upstream down (attempt {step.attempt})")

    async def never(step: TakenStep) -> Any:
        raise AssertionError("a later step never runs")

    start = await rstore.start_run("sync", {})
    runner = Runner(rstore, "sync", {"fetch": fetch, "transform": never, "load": never})
    outcomes, run = await run_until_ended(runner, rstore, start.run_id)
    assert attempts == [1, 2]  # max_attempts: 2
    assert [o.result for o in outcomes] == ["failed", "failed"]
    assert run.phase == "failed"
    assert run.error == "upstream down (attempt 2)"


async def test_an_output_the_store_refuses_fails_the_step_and_says_why(rstore: RunStore) -> None:
    async def huge(step: TakenStep) -> Any:
        return "x" * 70_000

    start = await rstore.start_run("once", {})
    runner = Runner(rstore, "once", {"only": huge})
    outcomes, run = await run_until_ended(runner, rstore, start.run_id)
    assert [o.result for o in outcomes] == ["failed"]
    assert run.phase == "failed"
    assert run.error and run.error.startswith("output refused: output is ")


async def test_a_runner_needs_a_handler_for_one_step_of_each_workflow_at_least(
    rstore: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    async def h(step: TakenStep) -> None:
        return None

    with pytest.raises(ValueError, match=r"^workflow 'sync': no handler for any of its steps$"):
        Runner(rstore, "sync", {"other:fetch": h, "only": h})
    caplog.set_level(logging.INFO, "realm.runner")
    Runner(rstore, ["sync", "once"], {"sync:fetch": h, "transform": h, "only": h},
           runner_id="r-part")  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "no handler here" in r.getMessage()]
    assert said == ["runner r-part: no handler here for step load of workflow 'sync': left to "
                    "runners that have one"]  # fmt: skip


async def test_runners_with_handlers_for_some_steps_each_take_only_theirs(
    rstore: RunStore,
) -> None:
    """Each step is handled by the runner that has its handler, once, as attempt 1: a
    runner that reads another's step leaves it, with no lease and no attempt counted."""
    seen: list[tuple[str, str, str, int]] = []

    def handler(runner: str) -> Any:
        async def handle(step: TakenStep) -> Any:
            seen.append((runner, step.run_id, step.step, step.attempt))
            return {"by": runner}

        return handle

    first = Runner(rstore, "sync", {"fetch": handler("first"), "load": handler("first")})
    second = Runner(rstore, "sync", {"transform": handler("second")})
    ids = [(await rstore.start_run("sync", {}, f"k{i}")).run_id for i in range(3)]
    tasks = [asyncio.create_task(r.run()) for r in (first, second)]
    try:

        async def all_completed() -> bool:
            return {(await rstore.get_run(i)).phase for i in ids} == {"completed"}

        await until(all_completed, 30)
    finally:
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    owner = {"fetch": "first", "transform": "second", "load": "first"}
    assert sorted(seen) == sorted((owner[s], i, s, 1) for i in ids for s in owner)
    assert first.counts == {"ok": 6, "failed": 0, "discarded": 0, "unrecorded": 0}
    assert second.counts == {"ok": 3, "failed": 0, "discarded": 0, "unrecorded": 0}


async def test_a_step_unknown_to_a_runners_config_is_left_to_one_that_knows_it(
    redis: Redis,
) -> None:
    """A runner still on an older triggers.yaml (no step `two`) meets a run started with
    the newer one: it leaves step two alone, and the runner that has its handler takes
    it at once as attempt 1, not after the old runner's lease lapsed (30 s)."""
    old = RunStore(redis, parse_config("version: 1\nworkflows:\n  job:\n    steps: [one]\n",
                                       with_triggers=False), timeout=5.0)  # fmt: skip
    new = RunStore(redis, parse_config(
        "version: 1\nworkflows:\n  job:\n    steps: [one, two]\n", with_triggers=False),
        timeout=5.0)  # fmt: skip

    async def handle(step: TakenStep) -> Any:
        return step.step

    start = await new.start_run("job", {})
    behind = Runner(old, "job", {"one": handle})
    [one] = await behind.run_once()
    assert (one.step, one.result) == ("one", "ok")
    for _ in range(5):  # the old runner keeps looking: step two is not for it
        assert await behind.run_once() == []
    current = Runner(new, "job", {"one": handle, "two": handle})

    async def taken() -> list[StepOutcome]:
        return await current.run_once()

    [two] = await until(taken, 10)  # well within the 30 s lease
    assert (two.step, two.attempt, two.result) == ("two", 1, "ok")
    assert (await new.get_run(start.run_id)).phase == "completed"


async def test_reconfigure_swaps_the_handlers_between_takes_and_a_step_in_hand_keeps_its_own(
    rstore: RunStore,
) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    ran: list[tuple[str, str]] = []

    async def v1(step: TakenStep) -> Any:
        started.set()
        await release.wait()
        ran.append(("v1", step.run_id))

    async def v2(step: TakenStep) -> Any:
        ran.append(("v2", step.run_id))

    first = await rstore.start_run("once", {})
    runner = Runner(rstore, "once", {"only": v1}, concurrency=2)
    task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(started.wait(), 10)
        runner.reconfigure({"only": v2})
        with pytest.raises(ValueError, match="no handler for any of its steps"):
            runner.reconfigure({"fetch": v2})  # refused: the last good one stays
        second = await rstore.start_run("once", {})
        await until(lambda: _phase_is(rstore, second.run_id, "completed"))
        release.set()
        await until(lambda: _phase_is(rstore, first.run_id, "completed"))
    finally:
        runner.stop()
        await asyncio.wait_for(task, 10)
    assert ran == [("v2", second.run_id), ("v1", first.run_id)]


async def test_stop_finishes_the_step_in_hand_and_takes_no_more(rstore: RunStore) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow(step: TakenStep) -> Any:
        started.set()
        await release.wait()
        return {"done": True}

    async def fast(step: TakenStep) -> Any:
        return None

    first = await rstore.start_run("sync", {})
    runner = Runner(rstore, "sync", {"fetch": slow, "transform": fast, "load": fast})
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(started.wait(), 10)
    runner.stop()
    second = await rstore.start_run("sync", {})  # ready after the stop: not taken
    release.set()
    await asyncio.wait_for(task, 10)
    assert (await rstore.get_run(first.run_id)).step == "transform"  # fetch recorded
    assert (await rstore.get_run(second.run_id)).step == "fetch"
    assert runner.counts == {"ok": 1, "failed": 0, "discarded": 0, "unrecorded": 0}


async def test_a_run_cancelled_while_its_handler_runs_is_discarded_and_the_handler_cancelled(
    rstore: RunStore,
) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def endless(step: TakenStep) -> Any:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    start = await rstore.start_run("once", {})
    # A short lease: the runner extends it every 0.2 s and so learns of the cancel.
    runner = Runner(rstore, "once", {"only": endless}, lease=0.4)
    outcome = asyncio.create_task(runner.run_once())
    await asyncio.wait_for(started.wait(), 10)
    assert await rstore.cancel_run(start.run_id) == 1
    [result] = await asyncio.wait_for(outcome, 10)
    assert cancelled.is_set()
    assert (result.result, result.error) == ("discarded", "STATE_RUN_NOT_LIVE")
    run = await rstore.get_run(start.run_id)
    assert (run.phase, run.step) == ("cancelled", "only")
    assert await runner.run_once() == []  # nothing of it is handed out again


async def test_a_long_handler_keeps_its_lease_so_no_other_runner_takes_the_step(
    rstore: RunStore,
) -> None:
    async def slow(step: TakenStep) -> Any:
        await asyncio.sleep(1.5)  # several leases of 0.4 s
        return "ok"

    start = await rstore.start_run("once", {})
    runner = Runner(rstore, "once", {"only": slow}, lease=0.4)
    other = Runner(rstore, "once", {"only": slow}, lease=0.4)
    first = asyncio.create_task(runner.run_once())
    await asyncio.sleep(0)
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:  # the other runner keeps looking, finds nothing
        assert await other._take(1) == []
        await asyncio.sleep(0.1)
    [outcome] = await first
    assert outcome.result == "ok"
    assert (await rstore.get_run(start.run_id)).phase == "completed"


async def test_the_runner_rides_out_redis_going_away_and_coming_back(
    start_redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_redis(appendonly=True)
    client = redis_client(server.url, 1.0)
    store = RunStore(client, parse_config(YAML, file="t.yaml", with_triggers=False), timeout=1.0)
    done: list[str] = []

    async def only(step: TakenStep) -> None:
        done.append(step.run_id)

    runner = Runner(store, "once", {"only": only})
    task = asyncio.create_task(runner.run())
    try:
        first = (await store.start_run("once", {})).run_id
        await until(lambda: _true(done == [first]))
        await asyncio.to_thread(server.stop)
        caplog.set_level(logging.WARNING, "realm.runner")
        await until(lambda: _true("store unavailable" in caplog.text), 15)
        assert not task.done()  # still looping, with its backoff
        await asyncio.to_thread(server.start)  # same port, same append-only file
        second = (await store.start_run("once", {})).run_id
        await until(lambda: _true(done == [first, second]), 15)
        # The handler has returned; the runner's completion of the step follows it.
        await until(lambda: _phase_is(store, second, "completed"))
    finally:
        runner.stop()
        await asyncio.wait_for(task, 10)
        await client.aclose()


async def _true(value: bool) -> bool:
    return value


async def _phase_is(store: RunStore, run_id: str, phase: str) -> bool:
    return (await store.get_run(run_id)).phase == phase


# --------------------------------------------------------------------------- command


def test_handlers_config_errors_are_one_line_naming_file_workflow_and_field() -> None:
    def error(handlers: str) -> str:
        text = f"version: 1\nworkflows:\n  w:\n    steps: [a, b]\n    handlers: {handlers}\n"
        with pytest.raises(ConfigError) as info:
            parse_config(text, file="x.yaml", with_triggers=False)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert error("{c: {command: [x]}}") == (
        "x.yaml: workflow 'w': field 'handlers.c': names no step of the workflow (steps: a, b)"
    )
    assert error("{a: {command: []}}").startswith(
        "x.yaml: workflow 'w': field 'handlers.a.command': must be a non-empty list"
    )
    assert "needs exactly one of 'command' and 'http'" in error(
        "{a: {command: [x], http: 'http://h/'}}"
    )
    assert "field 'handlers.a.timeout': must be a duration" in error(
        "{a: {command: [x], timeout: soon}}"
    )
    assert "field 'handlers.a.secret_env': is required" in error("{a: {http: 'http://h/'}}")
    assert "field 'handlers.a.http': must be an http://" in error(
        "{a: {http: 'ftp://h/', secret_env: S}}"
    )
    assert "field 'handlers.a.retries': unknown field" in error("{a: {command: [x], retries: 3}}")
    assert "field 'handlers.a.env': must be a list of environment variable names" in error(
        "{a: {command: [x], env: AWS_PROFILE}}"
    )
    assert error("{a: {command: [x], env: ['s3cr3t value']}}").endswith(
        "field 'handlers.a.env': entries must be environment variable names (letters, digits "
        "and _, not starting with a digit), not values"
    )  # and the value is not echoed
    assert "field 'handlers.a.env': A is listed twice" in error("{a: {command: [x], env: [A, A]}}")
    assert "field 'handlers.a.env': REALM_REDIS_URL: the gateway's own variables" in error(
        "{a: {command: [x], env: [REALM_REDIS_URL]}}"
    )
    assert "field 'handlers.a.env': is for command handlers only" in error(
        "{a: {http: 'http://h/', secret_env: S, env: [A]}}"
    )
    # A secret the file names elsewhere: an http handler's, another workflow's trigger's.
    assert error("{a: {command: [x], env: [HOOK]}, b: {http: 'http://h/', secret_env: HOOK}}") == (
        "x.yaml: workflow 'w': field 'handlers.a.env': HOOK holds a secret this file names (a "
        "secret_env); secrets are never passed to a command"
    )
    with pytest.raises(ConfigError, match=r"'handlers\.a\.env': OLD holds a secret"):
        parse_config(
            "version: 1\nworkflows:\n  w:\n    steps: [a]\n"
            "    handlers: {a: {command: [x], env: [PATH, OLD]}}\n"
            "triggers:\n  t:\n    workflow: w\n    path: /t\n"
            "    verify: {scheme: github, secret_env: [NEW, OLD]}\n",
            file="x.yaml", with_triggers=False,  # realm work does not load the triggers
        )  # fmt: skip
    specs = parse_handlers({"a": {"command": ["x"], "timeout": "500ms", "env": ["AWS_PROFILE"]}},
                           file="f", workflow="w", steps=["a"])  # fmt: skip
    assert specs["a"] == CommandHandler(argv=("x",), timeout=0.5, env=("AWS_PROFILE",))
    with pytest.raises(ConfigError, match="S_UNSET is not set"):
        build_handlers({"w": parse_handlers({"a": {"http": "http://h/", "secret_env": "S_UNSET"}},
                                            file="f", workflow="w", steps=["a"])},
                       file="f", env={})  # fmt: skip


async def test_a_command_gets_the_step_as_json_on_stdin_and_its_names_in_the_environment(
    tmp_path: Path,
) -> None:
    script = (
        "import json, os, sys\n"
        "doc = json.load(sys.stdin)\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('REALM_')}\n"
        "print(json.dumps({'doc': doc, 'env': env}))\n"
    )
    spec = CommandHandler(argv=(sys.executable, "-c", script), timeout=10)
    out = await run_command(spec, taken("transform", 2, {"rows": 3}))
    assert out["doc"] == {"run_id": "r-1", "workflow": "sync", "step": "transform", "attempt": 2,
                          "params": {"repo": "a/b"}, "output": {"rows": 3}}  # fmt: skip
    assert out["env"] == {"REALM_RUN_ID": "r-1", "REALM_WORKFLOW": "sync",
                          "REALM_STEP": "transform", "REALM_ATTEMPT": "2"}  # fmt: skip
    text = CommandHandler(argv=("sh", "-c", "cat >/dev/null; echo plain words"), timeout=10)
    assert await run_command(text, taken()) == "plain words"
    empty = CommandHandler(argv=("true",), timeout=10)
    assert await run_command(empty, taken()) is None


async def test_a_command_failing_or_timing_out_is_a_failure_and_its_process_group_dies(
    tmp_path: Path,
) -> None:
    fails = CommandHandler(argv=("sh", "-c", "echo partial; echo 'no route to db' >&2; exit 3"),
                           timeout=10)  # fmt: skip
    with pytest.raises(HandlerFailed, match=r"^exit 3: no route to db$"):
        await run_command(fails, taken())
    missing = CommandHandler(argv=(str(tmp_path / "nope"),), timeout=10)
    with pytest.raises(HandlerFailed, match="cannot start"):
        await run_command(missing, taken())

    pidfile = tmp_path / "child.pid"
    hangs = CommandHandler(argv=("sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"), timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(HandlerFailed, match=r"^timed out after 0.5s$"):
        await run_command(hangs, taken())
    assert time.monotonic() - t0 < 5
    child = int(pidfile.read_text())

    async def gone() -> bool:  # the grandchild too: the whole group was killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return _zombie(child)

    await until(gone, 5)


def test_a_commands_environment_is_the_minimal_one_and_what_its_env_lists() -> None:
    runner_env = {
        "PATH": "/bin", "HOME": "/home/r", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC",
        "TMPDIR": "/tmp/r", "AWS_PROFILE": "ci", "OTHER": "x", "REALM_API_TOKEN": "t",
        "REALM_REDIS_URL": "redis://:pw@h/0", "HOOK_SECRET": "whsec_x", "REALM_STEP": "forged",
    }  # fmt: skip
    spec = CommandHandler(argv=("env",), env=("AWS_PROFILE", "REALM_API_TOKEN", "UNSET"))
    assert command_env(spec, taken("load", 3), runner_env) == {
        "PATH": "/bin", "HOME": "/home/r", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC",
        "TMPDIR": "/tmp/r", "AWS_PROFILE": "ci", "REALM_RUN_ID": "r-1",
        "REALM_WORKFLOW": "sync", "REALM_STEP": "load", "REALM_ATTEMPT": "3",
    }  # fmt: skip


async def test_a_command_that_closed_its_output_still_times_out_and_its_group_dies(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "sleeper.pid"
    closed = CommandHandler(
        argv=("sh", "-c", f"exec >/dev/null 2>&1; sleep 30 & echo $! > {pidfile}; wait"),
        timeout=0.5,
    )
    t0 = time.monotonic()
    with pytest.raises(HandlerFailed, match=r"^timed out after 0.5s$"):
        await asyncio.wait_for(run_command(closed, taken()), 10)
    assert time.monotonic() - t0 < 5
    child = int(pidfile.read_text())
    await until(lambda: _true(_gone(child)), 5)


async def test_a_command_that_leaves_a_process_holding_its_output_ends_when_it_exits(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "daemon.pid"
    # The background sleep inherits stdout and stderr, and keeps them open for 30 s.
    daemonises = CommandHandler(
        argv=("sh", "-c", f"sleep 30 & echo $! > {pidfile}; echo started; echo note >&2"),
        timeout=5,
    )
    t0 = time.monotonic()
    try:
        assert await asyncio.wait_for(run_command(daemonises, taken()), 10) == "started"
        assert time.monotonic() - t0 < 3
        # Left running: a normal exit does not kill what the command started.
        assert not _gone(int(pidfile.read_text()))
    finally:
        os.kill(int(pidfile.read_text()), 9)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


async def test_the_runner_runs_a_command_handler_from_triggers_yaml(
    rstore: RunStore, tmp_path: Path
) -> None:
    log = tmp_path / "lines"
    specs = parse_handlers(
        {"only": {"command": ["sh", "-c", f'echo "$REALM_RUN_ID $REALM_STEP" >> {log}']}},
        file="f", workflow="once", steps=["only"],
    )  # fmt: skip
    handlers = build_handlers({"once": specs}, file="f")
    start = await rstore.start_run("once", {})
    runner = Runner(rstore, "once", handlers.handlers)
    _, run = await run_until_ended(runner, rstore, start.run_id)
    await handlers.aclose()
    assert run.phase == "completed"
    assert log.read_text() == f"{start.run_id} only\n"


# --------------------------------------------------------------------------- http


class Receiver:
    """A small HTTP server of the test's own: verifies each request's Standard Webhooks
    signature with gateway.signatures.verify and answers the status its path names."""

    def __init__(self) -> None:
        self.spec = VerifySpec(scheme="standard", secret_env=("S",), secrets=(SECRET,))
        self.received: list[tuple[str, dict[str, str], bytes, str | None]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> Receiver:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        path = lines[0].split()[1]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))

        class H:
            def getlist(self, key: str) -> list[str]:
                return [headers[key]] if key in headers else []

        rejected = verify(self.spec, H(), body, time.time())
        self.received.append((path, headers, body, rejected))
        if path == "/hang":
            await asyncio.sleep(3)  # past the handler's timeout
        status = 401 if rejected else int(path.strip("/") or 200)
        reply = b'{"built": "yes"}' if status == 200 else b"refused: bad params"
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d"
                     b"\r\nConnection: close\r\n\r\n%s" % (status, len(reply), reply))  # fmt: skip
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self.server
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = await Receiver().start()
    yield server
    await server.stop()


def http_handlers(url: str, timeout: str = "5s") -> Any:
    specs = parse_handlers({"only": {"http": url, "secret_env": "HOOK_SECRET", "timeout": timeout}},
                           file="f", workflow="once", steps=["only"])  # fmt: skip
    return build_handlers({"once": specs}, file="f", env={"HOOK_SECRET": SECRET})


async def test_an_http_handler_posts_the_step_signed_and_a_2xx_body_is_the_output(
    rstore: RunStore, receiver: Receiver
) -> None:
    handlers = http_handlers(receiver.url + "/200")
    start = await rstore.start_run("once", {"sha": "abc"})
    got: list[Any] = []
    runner = Runner(rstore, "once", handlers.handlers, on_outcome=got.append)
    _, run = await run_until_ended(runner, rstore, start.run_id)
    await handlers.aclose()
    assert run.phase == "completed"
    [(_, headers, body, rejected)] = receiver.received
    assert rejected is None  # the signature verifies with the receiver's secret
    assert headers["webhook-id"].startswith("msg_")
    assert orjson.loads(body) == {
        "run_id": start.run_id, "workflow": "once", "step": "only", "attempt": 1,
        "params": {"sha": "abc"}, "output": None,
    }  # fmt: skip
    assert [o.result for o in got] == ["ok"]


async def test_an_http_4xx_fails_the_run_at_once_and_a_5xx_is_retried(
    rstore: RunStore, receiver: Receiver
) -> None:
    handlers = http_handlers(receiver.url + "/422")
    start = await rstore.start_run("once", {})
    runner = Runner(rstore, "once", handlers.handlers)
    outcomes, run = await run_until_ended(runner, rstore, start.run_id)
    assert [o.result for o in outcomes] == ["failed"]
    assert run.phase == "failed"
    assert run.error == f"{receiver.url}/422 answered 422: refused: bad params"

    five = http_handlers(receiver.url + "/503")
    with pytest.raises(HandlerFailed) as info:
        await five.handlers["once:only"](taken())
    assert type(info.value) is HandlerFailed  # retryable, unlike PermanentFailure
    # One attempt, one webhook-id; its resend would carry the same id, the next
    # attempt another.
    ids = {h["webhook-id"] for _, h, _, _ in receiver.received}
    assert len(ids) == 2

    hangs = http_handlers(receiver.url + "/hang", timeout="500ms")
    t0 = time.monotonic()
    with pytest.raises(HandlerFailed, match=r"/hang: no reply in 0.5s$") as info:
        await hangs.handlers["once:only"](taken())
    assert type(info.value) is HandlerFailed and time.monotonic() - t0 < 2.5
    await hangs.aclose()
    await handlers.aclose()
    await five.aclose()
