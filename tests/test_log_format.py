"""One log format throughout, chosen by ``--log-format``: real ``realm listen`` and
``realm work`` processes, every line of their stderr read back. ``json`` (the default):
each line one object with ``event``, ``ts`` and ``level`` first (the delivery log,
the ``realm`` loggers, uvicorn's, the runner's, the banner). ``text``: plain lines."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync

from gateway.ingest.observe import JsonFormatter, TextFormatter, delivery_text, timestamp
from tests.listener import Listener
from tests.servers import RedisServer

CONFIG = """
version: 1
workflows:
  job:
    steps: [one]
    handlers:
      one: {command: ["sh", "-c", "cat >/dev/null; echo '{}'"], timeout: 10s}
triggers:
  job-hook:
    workflow: job
    path: /hooks/job
    verify: {scheme: token, header: X-Token, secret_env: JOB_TOKEN}
    event_id: {header: Idempotency-Key}
"""
TOKEN = "job-token-5e2a9c"
TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as the JSON object it must be, with its first three keys
    checked: event, ts (UTC, milliseconds), level."""
    lines = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{text[-3000:]}") from None
        assert list(record)[:3] == ["event", "ts", "level"], line
        assert TS.fullmatch(record["ts"]), line
        lines.append(record)
    return lines


def messages(records: list[dict[str, Any]], logger: str) -> list[str]:
    return [r["message"] for r in records if r["event"] == "log" and r["logger"] == logger]


def deliver(listener: Listener, key: str) -> None:
    reply = httpx.post(f"{listener.base_url}/hooks/job", content=b"{}", timeout=10,
                       headers={"X-Token": TOKEN, "Idempotency-Key": key})  # fmt: skip
    assert reply.status_code == 202, reply.text


def wait_for(what: str, check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_listen_logs_json_lines_with_a_timestamp_throughout(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    listener = Listener(tmp_path, CONFIG, redis_url=module_redis.url, env={"JOB_TOKEN": TOKEN})
    listener.start()
    try:
        deliver(listener, "json-1")
        # The delivery log is flushed every 0.2 s: its line, once written.
        wait_for("the delivery line", lambda: '"event":"delivery"' in listener.log())
    finally:
        listener.stop()
    records = json_lines(listener.log())
    banner = messages(records, "realm")
    assert banner[0] == f"realm listen: http://127.0.0.1:{listener.port} (1 worker)"
    assert "/v1 (admin API) and /ui (inspector): off; set REALM_API_TOKEN to turn them on" in (
        banner
    )
    assert "Application startup complete." in messages(records, "uvicorn.error")
    (delivery,) = [r for r in records if r["event"] == "delivery"]
    assert (delivery["level"], delivery["path"], delivery["status"]) == ("info", "/hooks/job", 202)
    assert delivery["results"][0]["outcome"] == "started"


@pytest.mark.slow
def test_listen_logs_plain_text_throughout_its_workers_too(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    listener = Listener(tmp_path, CONFIG, redis_url=module_redis.url, workers=2,
                        env={"JOB_TOKEN": TOKEN, "REALM_API_TOKEN": "api-token-31f0c2"},
                        args=("--log-format", "text"))  # fmt: skip
    listener.start()
    try:
        wait_for("both workers", lambda: listener.log().count("Application startup complete.") == 2)
        deliver(listener, "text-1")
        wait_for("the delivery line", lambda: "delivery /hooks/job 202 (" in listener.log())
    finally:
        listener.stop()
    log = listener.log()
    assert not [line for line in log.splitlines() if line.startswith("{")], log
    lines = log.splitlines()
    assert lines[0] == f"realm listen: http://127.0.0.1:{listener.port} (2 workers)"
    assert "/v1 (admin API) and /ui (inspector): on, behind REALM_API_TOKEN" in lines
    (line,) = [line for line in lines if line.startswith("delivery /hooks/job")]
    assert re.fullmatch(
        r"delivery /hooks/job 202 \([\d.]+ ms\): job-hook started run [0-9a-f-]{36} "
        r"\(event id text-1\)",
        line,
    ), line


def work(workdir: Path, redis: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--config", str(workdir / "triggers.yaml"),
         "--redis-url", redis.url],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def start_run(workdir: Path, redis: RedisServer) -> str:
    (workdir / "triggers.yaml").write_text(CONFIG)
    started = work(workdir, redis, "run", "start", "job", "--json")
    assert started.returncode == 0, started.stderr
    return json.loads(started.stdout)["run_id"]


def test_work_logs_json_lines_by_default(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    run_id = start_run(tmp_path, module_redis)
    out = work(tmp_path, module_redis, "work", "--drain")
    assert out.returncode == 0, out.stderr
    records = json_lines(out.stderr)
    steps = messages(records, "realm.runner")
    assert len(steps) == 1 and re.fullmatch(
        rf"run {run_id} step one attempt 1: ok \(\d+ ms\)", steps[0]
    ), steps
    said = messages(records, "realm")
    assert said[0] == f"using Redis at {module_redis.url}"
    assert said[-1].startswith("work: stopped (1 ok, 0 failed"), said


def test_work_logs_plain_text_when_asked(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    run_id = start_run(tmp_path, module_redis)
    out = work(tmp_path, module_redis, "work", "--drain", "--log-format", "text")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == f"using Redis at {module_redis.url}"
    assert (
        sum(
            bool(re.fullmatch(rf"run {run_id} step one attempt 1: ok \(\d+ ms\)", line))
            for line in lines
        )
        == 1
    ), lines
    assert lines[-1].startswith("work: stopped (1 ok, 0 failed"), lines
    assert not [line for line in lines if line.startswith("{")], lines


def test_a_bad_log_format_is_a_usage_error(tmp_path: Path, module_redis: RedisServer) -> None:
    (tmp_path / "triggers.yaml").write_text(CONFIG)
    out = work(tmp_path, module_redis, "work", "--log-format", "xml")
    assert out.returncode == 2
    assert "'xml' is not one of 'json', 'text'" in out.stderr and "Traceback" not in out.stderr


# --------------------------------------------------------------------------- the formatters


def _record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    record = logging.LogRecord("realm", level, __file__, 1, message, None, None)
    record.created = 1767225600.5  # 2026-01-01T00:00:00.500Z
    return record


def test_a_message_that_is_a_json_object_keeps_its_fields_with_event_first() -> None:
    message = '{"event":"config_reload","level":"error","result":"refused","pid":7}'
    line = JsonFormatter().format(_record(message, logging.ERROR))
    assert line == (
        '{"event":"config_reload","ts":"2026-01-01T00:00:00.500Z","level":"error",'
        '"result":"refused","pid":7}'
    )
    assert TextFormatter().format(_record(message)) == "config_reload: result=refused pid=7"


def test_a_plain_message_is_one_object_naming_its_logger() -> None:
    line = JsonFormatter().format(_record('a "quoted"\nmessage', logging.WARNING))
    assert json.loads(line) == {
        "event": "log", "ts": "2026-01-01T00:00:00.500Z", "level": "warning",
        "logger": "realm", "message": 'a "quoted"\nmessage',
    }  # fmt: skip
    assert "\n" not in line


def test_a_delivery_line_in_text_escapes_what_the_sender_chose() -> None:
    record = {
        "event": "delivery", "ts": timestamp(0.25), "level": "warning", "path": "/hooks/job",
        "status": 409, "ms": 1.5,
        "results": [{"trigger": "job-hook", "workflow": "job", "event_id": "e-1\ndelivery x",
                     "outcome": "refused", "run_id": None,
                     "code": "STATE_IDEMPOTENCY_KEY_CONFLICT", "params_mismatch": True}],
    }  # fmt: skip
    assert record["ts"] == "1970-01-01T00:00:00.250Z"
    assert delivery_text(record) == (
        "warning: delivery /hooks/job 409 (1.5 ms): job-hook refused "
        'STATE_IDEMPOTENCY_KEY_CONFLICT (event id "e-1\\ndelivery x") params mismatch'
    )
