"""`realm work` as a real process: handlers from triggers.yaml, SIGTERM, and a webhook
that becomes a run whose steps a runner does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
import redis as redis_sync

from tests.listener import Listener
from tests.servers import RedisServer, free_port

CONFIG = """
version: 1
workflows:
  job:
    steps: [one, two]
    handlers:
      one:
        command:
          - sh
          - -c
          - >-
            touch started; sleep 1; echo "one $REALM_RUN_ID" >> lines; echo '{"n": 1}'
      two:
        command: ["sh", "-c", "echo \\"two $REALM_RUN_ID $(cat)\\" >> lines"]
        timeout: 10s
triggers:
  job-hook:
    workflow: job
    path: /hooks/job
    verify: {scheme: token, header: X-Token, secret_env: JOB_TOKEN}
    event_id: {header: Idempotency-Key}
"""
TOKEN = "job-token-8c1d2e"


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    out["PYTHONUNBUFFERED"] = "1"
    return out


def realm(workdir: Path, redis: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--config", str(workdir / "triggers.yaml"),
         "--redis-url", redis.url],
        cwd=workdir, env=env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def start_work(workdir: Path, redis: RedisServer, *args: str) -> subprocess.Popen[str]:
    log = (workdir / "work.log").open("a")
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "work", *args, "--config",
         str(workdir / "triggers.yaml"), "--redis-url", redis.url],
        cwd=workdir, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s")


def phase(db: redis_sync.Redis, run_id: str) -> str:
    return db.hget(f"realm:{{job}}:run:{run_id}", "phase") or ""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "triggers.yaml").write_text(CONFIG)
    return tmp_path


def test_work_refuses_a_workflow_without_handlers_in_one_line(
    workdir: Path, module_redis: RedisServer
) -> None:
    (workdir / "triggers.yaml").write_text(
        "version: 1\nworkflows:\n  job:\n    steps: [one, two]\n"
        "    handlers: {one: {command: [x]}}\n  other:\n    steps: [a]\n"
    )
    out = realm(workdir, module_redis, "work", "other")
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {workdir / 'triggers.yaml'}: workflow 'other': field 'handlers': "
        "has no handlers: nothing to run its steps"
    )
    (workdir / "triggers.yaml").write_text("version: 1\nworkflows:\n  job:\n    steps: [one]\n")
    out = realm(workdir, module_redis, "work")
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {workdir / 'triggers.yaml'}: no workflow has handlers: to run"
    )


@pytest.mark.slow
def test_sigterm_finishes_the_step_in_hand_and_takes_no_more(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    started = realm(workdir, module_redis, "run", "start", "job", "--json")
    assert started.returncode == 0, started.stderr
    run_id = orjson.loads(started.stdout)["run_id"]
    work = start_work(workdir, module_redis)
    try:
        wait_for((workdir / "started").exists, 20, "the handler of step one started")
        work.send_signal(signal.SIGTERM)
        assert work.wait(timeout=20) == 0
    finally:
        if work.poll() is None:
            work.kill()
    log = (workdir / "work.log").read_text()
    # Step one finished and was recorded; step two, ready after the stop, was not taken.
    assert (workdir / "lines").read_text() == f"one {run_id}\n"
    assert f"run {run_id} step one attempt 1: ok (" in log, log
    assert "step two" not in log, log
    assert phase(db, run_id) == "running"
    assert db.hget(f"realm:{{job}}:run:{run_id}", "step") == "two"
    assert "Traceback" not in log, log


@pytest.mark.slow
def test_a_webhook_becomes_a_run_whose_steps_realm_work_does_once(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    listener = Listener(
        workdir, CONFIG, redis_url=module_redis.url, env={"JOB_TOKEN": TOKEN}
    ).start()
    try:
        headers = {"X-Token": TOKEN, "Idempotency-Key": "delivery-1"}
        first = httpx.post(f"{listener.base_url}/hooks/job", json={"a": 1}, headers=headers)
        again = httpx.post(f"{listener.base_url}/hooks/job", json={"a": 1}, headers=headers)
    finally:
        listener.stop()
    assert first.status_code == 202, first.text
    [started] = first.json()["results"]
    [repeat] = again.json()["results"]
    run_id = started["run_id"]
    assert (again.status_code, repeat["outcome"], repeat["run_id"]) == (
        200, "deduplicated", run_id)  # fmt: skip

    # --drain: handle what is ready, then exit 0 once nothing is ready or in hand.
    work = start_work(workdir, module_redis, "job", "--drain", "--concurrency", "2")
    try:
        assert work.wait(timeout=30) == 0
    finally:
        if work.poll() is None:
            work.kill()
    log = (workdir / "work.log").read_text()
    lines = (workdir / "lines").read_text().splitlines()
    assert lines[0] == f"one {run_id}"
    assert len(lines) == 2, lines
    two, doc = lines[1].split(" ", 2)[:2], orjson.loads(lines[1].split(" ", 2)[2])
    assert two == ["two", run_id]
    assert doc == {"run_id": run_id, "workflow": "job", "step": "two", "attempt": 1,
                   "params": {}, "output": {"n": 1}}  # fmt: skip
    assert phase(db, run_id) == "completed"
    assert log.count(f"run {run_id} step one attempt 1: ok") == 1, log
    assert log.count(f"run {run_id} step two attempt 1: ok") == 1, log


def test_realm_work_serves_its_metrics(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    port = free_port()
    work = start_work(workdir, module_redis, "--metrics-port", str(port))
    try:
        started = realm(workdir, module_redis, "run", "start", "job", "--json")
        assert started.returncode == 0, started.stderr
        wait_for(lambda: "step two attempt 1: ok" in (workdir / "work.log").read_text(), 30,
                 "both steps done")  # fmt: skip
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        work.send_signal(signal.SIGTERM)
        work.wait(timeout=20)
    for step in ("one", "two"):
        assert f'realm_steps_total{{outcome="ok",step="{step}",workflow="job"}} 1.0' in metrics
    assert "realm_handler_seconds_bucket" in metrics
