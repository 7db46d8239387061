"""`realm work` as a real process, on what its command handlers may do to it: close
their output and hang on, print their environment, be cancelled mid-run; and on the
runner's own life: `--drain` and retries, SIGHUP reloading the handlers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import redis as redis_sync

from tests.servers import RedisServer

# What the runner's environment holds that no command may see.
API_TOKEN = "api-token-3f9c1b7e"
TRIGGER_TOKEN = "trigger-token-5d2a8c41"
OLD_TRIGGER_TOKEN = "trigger-token-old-77e0a2"
HOOK_SECRET = "whsec_c2VjcmV0LWtleS1mb3ItdGVzdHM="
SECRETS = (API_TOKEN, TRIGGER_TOKEN, OLD_TRIGGER_TOKEN, HOOK_SECRET)


class Work:
    """A `realm work` process of the test's, its log in the work folder."""

    def __init__(self, workdir: Path, redis: RedisServer, *args: str, **env: str) -> None:
        self.workdir = workdir
        self.log_path = workdir / "work.log"
        log = self.log_path.open("a")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "work", *args, "--config",
             str(workdir / "triggers.yaml"), *redis_args(redis, env)],
            cwd=workdir, env=environment(**env), stdout=log, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 20, count: int = 1) -> None:
        wait_for(lambda: self.log().count(text) >= count, timeout, f"{text!r} in the log")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"realm work still running after {timeout}s:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def environment(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    out.update(PYTHONUNBUFFERED="1", REALM_LOG_FORMAT="text", **extra)
    return out


def redis_args(redis: RedisServer, env: dict[str, str]) -> list[str]:
    """--redis-url, unless the test hands the URL over in REALM_REDIS_URL."""
    return [] if "REALM_REDIS_URL" in env else ["--redis-url", redis.url]


def realm(
    workdir: Path, redis: RedisServer, *args: str, config: str = "triggers.yaml"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--config", str(workdir / config),
         "--redis-url", redis.url],
        cwd=workdir, env=environment(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def start_run(
    workdir: Path, redis: RedisServer, workflow: str, config: str = "triggers.yaml"
) -> str:
    out = realm(workdir, redis, "run", "start", workflow, "--json", config=config)
    assert out.returncode == 0, out.stderr
    return str(orjson.loads(out.stdout)["run_id"])


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s")


def run_hash(db: redis_sync.Redis, workflow: str, run_id: str) -> dict[str, str]:
    return db.hgetall(f"realm:{{{workflow}}}:run:{run_id}")


def gone(pid: int) -> bool:
    """The process ended (or is a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    # A command a failing test left behind: its pid, written by the test's command.
    for pidfile in tmp_path.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def write_config(workdir: Path, text: str) -> None:
    (workdir / "triggers.yaml").write_text(text)


# --------------------------------------------------------------------------- commands


@pytest.mark.slow
def test_a_command_that_closed_its_output_and_hangs_on_times_out_and_drain_exits(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, """
version: 1
workflows:
  job:
    steps: [one]
    max_attempts: 1
    lease: 1s
    handlers:
      one:
        command: ["sh", "-c", "echo $$ > sleeper.pid; exec >/dev/null 2>&1; exec sleep 60"]
        timeout: 1s
""")  # fmt: skip
    run_id = start_run(workdir, module_redis, "job")
    work = Work(workdir, module_redis, "--drain")
    try:
        assert work.wait(30) == 1, work.log()  # 1: the run failed
    finally:
        work.kill()
    run = run_hash(db, "job", run_id)
    assert (run["phase"], run["error"]) == ("failed", "timed out after 1s")
    assert f"run {run_id} step one attempt 1: failed, the run failed (" in work.log()
    wait_for(lambda: gone(int((workdir / "sleeper.pid").read_text())), 5, "the command killed")


@pytest.mark.slow
def test_a_command_sees_a_minimal_environment_and_never_a_secret(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, """
version: 1
workflows:
  envs:
    steps: [show, leak]
    max_attempts: 1
    handlers:
      show: {command: ["env"], env: [PASSED_ON]}
      leak: {command: ["sh", "-c", "env >&2; exit 1"], env: [PASSED_ON]}
  hooked:
    steps: [send]
    handlers:
      send: {http: "http://127.0.0.1:9/send", secret_env: HOOK_SECRET}
triggers:
  envs-hook:
    workflow: envs
    path: /hooks/envs
    verify: {scheme: token, header: X-Token, secret_env: [TRIGGER_TOKEN, OLD_TRIGGER_TOKEN]}
""")  # fmt: skip
    given = {
        "REALM_API_TOKEN": API_TOKEN,
        "REALM_REDIS_URL": module_redis.url,  # the runner's store comes from here
        "TRIGGER_TOKEN": TRIGGER_TOKEN,
        "OLD_TRIGGER_TOKEN": OLD_TRIGGER_TOKEN,
        "HOOK_SECRET": HOOK_SECRET,
        "PASSED_ON": "listed-in-env",
        "NOT_LISTED": "not-listed-value",
        "LC_ALL": "C",
        "TZ": "UTC",
        "TMPDIR": str(workdir),
    }
    run_id = start_run(workdir, module_redis, "envs")
    work = Work(workdir, module_redis, "envs", "--drain", **given)
    try:
        assert work.wait(30) == 1, work.log()  # the leak step failed the run
    finally:
        work.kill()
    run = run_hash(db, "envs", run_id)
    shown = dict(line.split("=", 1) for line in orjson.loads(run["output"]).splitlines())
    runner_env = environment(**given)
    kept = {k for k in runner_env if k in ("PATH", "HOME", "LANG", "TZ", "TMPDIR")}
    kept |= {k for k in runner_env if k.startswith("LC_")}
    assert set(shown) == kept | {"PASSED_ON", "REALM_RUN_ID", "REALM_WORKFLOW", "REALM_STEP",
                                 "REALM_ATTEMPT"}  # fmt: skip
    assert {k: shown[k] for k in ("PASSED_ON", "LC_ALL", "TZ", "REALM_RUN_ID", "REALM_STEP")} == {
        "PASSED_ON": "listed-in-env", "LC_ALL": "C", "TZ": "UTC", "REALM_RUN_ID": run_id,
        "REALM_STEP": "show"}  # fmt: skip
    # The failing command printed its whole environment: that became the run's error.
    assert run["phase"] == "failed"
    assert run["error"].startswith("exit 1: ") and "PASSED_ON=listed-in-env" in run["error"]
    stored = orjson.dumps(run).decode()
    for value in (*SECRETS, module_redis.url, "not-listed-value"):
        assert value not in stored, value
    assert not [value for value in SECRETS if value in work.log()]


def test_a_command_may_not_be_given_a_secret_or_the_gateways_own_variables(
    workdir: Path, module_redis: RedisServer
) -> None:
    base = """
version: 1
workflows:
  job:
    steps: [one]
    handlers:
      one: {command: [env], env: [%s]}
triggers:
  job-hook:
    workflow: job
    path: /hooks/job
    verify: {scheme: token, header: X-Token, secret_env: TRIGGER_TOKEN}
"""
    file = workdir / "triggers.yaml"
    for listed, why in [
        ("TRIGGER_TOKEN", "TRIGGER_TOKEN holds a secret this file names (a secret_env); "
                          "secrets are never passed to a command"),
        ("REALM_API_TOKEN", "REALM_API_TOKEN: the gateway's own variables (REALM_...) are never "
                            "passed to a command (they hold its API token and Redis URL); the "
                            "step's REALM_RUN_ID, REALM_WORKFLOW, REALM_STEP and REALM_ATTEMPT "
                            "always are"),
    ]:  # fmt: skip
        write_config(workdir, base % listed)
        out = realm(workdir, module_redis, "work", "--drain")
        assert out.returncode == 3, out.stderr
        assert out.stderr.strip().splitlines()[-1] == (
            f"error: {file}: workflow 'job': field 'handlers.one.env': {why}"
        )


@pytest.mark.slow
def test_a_run_cancelled_while_its_command_runs_leaves_no_traceback_in_the_log(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, """
version: 1
workflows:
  job:
    steps: [one]
    lease: 1s
    handlers:
      one: {command: ["sh", "-c", "echo $$ > sleeper.pid; exec sleep 60"]}
""")  # fmt: skip
    run_id = start_run(workdir, module_redis, "job")
    work = Work(workdir, module_redis)
    try:
        wait_for((workdir / "sleeper.pid").exists, 20, "the command started")
        cancelled = realm(workdir, module_redis, "run", "cancel", run_id)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        # The runner learns of it when it next extends the lease (every 0.5 s).
        work.wait_for_log(f"run {run_id} step one attempt 1: discarded (")
        wait_for(lambda: gone(int((workdir / "sleeper.pid").read_text())), 5, "command killed")
        work.process.send_signal(signal.SIGTERM)
        assert work.wait(20) == 0
    finally:
        work.kill()
    log = work.log()
    assert f"run {run_id} step one attempt 1: discarded (" in log
    assert log.rstrip().endswith("work: stopped (0 ok, 0 failed, 1 discarded, 0 unrecorded)"), log
    assert "Traceback" not in log and "never retrieved" not in log, log
    assert run_hash(db, "job", run_id)["phase"] == "cancelled"


# --------------------------------------------------------------------------- --drain

RETRIED = """
version: 1
workflows:
  job:
    steps: [one]
    max_attempts: 2
    retry_backoff: %s
    handlers:
      one: {command: ["sh", "-c", "%s"]}
"""
# Fails on its first attempt, succeeds on the next.
FAILS_ONCE = "if [ -e tried ]; then echo fine; else touch tried; echo first try >&2; exit 1; fi"


@pytest.mark.slow
def test_drain_waits_for_a_step_backing_off_and_exits_0_once_its_retry_succeeded(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, RETRIED % ("1s", FAILS_ONCE))
    run_id = start_run(workdir, module_redis, "job")
    work = Work(workdir, module_redis, "--drain")
    try:
        assert work.wait(30) == 0, work.log()
    finally:
        work.kill()
    log = work.log()
    assert f"run {run_id} step one attempt 1: failed (" in log
    assert f"run {run_id} step one attempt 2: ok (" in log
    assert run_hash(db, "job", run_id)["phase"] == "completed"


@pytest.mark.slow
def test_drain_exits_1_when_a_run_failed_and_the_last_attempt_says_so(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, RETRIED % ("1s", "echo broken >&2; exit 4"))
    run_id = start_run(workdir, module_redis, "job")
    work = Work(workdir, module_redis, "--drain")
    try:
        assert work.wait(30) == 1, work.log()
    finally:
        work.kill()
    lines = work.log().splitlines()
    assert [line.split(" (")[0] for line in lines if line.startswith(f"run {run_id}")] == [
        f"run {run_id} step one attempt 1: failed",
        f"run {run_id} step one attempt 2: failed, the run failed",
    ]
    assert "work: 1 run failed" in lines
    run = run_hash(db, "job", run_id)
    assert (run["phase"], run["error"]) == ("failed", "exit 4: broken")


@pytest.mark.slow
def test_drain_stopped_while_a_retry_waits_says_it_remains_and_exits_1(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, RETRIED % ("1h", FAILS_ONCE))
    run_id = start_run(workdir, module_redis, "job")
    work = Work(workdir, module_redis, "--drain")
    try:
        work.wait_for_log(f"run {run_id} step one attempt 1: failed (")
        work.process.send_signal(signal.SIGTERM)
        assert work.wait(20) == 1, work.log()
    finally:
        work.kill()
    assert "work: 1 step this runner failed still waits for a retry" in work.log().splitlines()
    assert run_hash(db, "job", run_id)["phase"] == "running"


# --------------------------------------------------------------------------- handlers


def handlers_config(one: str) -> str:
    return f"""
version: 1
workflows:
  job:
    steps: [one, two]
    handlers:
      one: {{command: ["sh", "-c", "echo {one} $REALM_RUN_ID >> lines"]}}
"""


@pytest.mark.slow
def test_work_takes_the_steps_it_has_handlers_for_and_leaves_the_others(
    workdir: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    write_config(workdir, handlers_config("v1"))
    run_id = start_run(workdir, module_redis, "job")
    work = Work(workdir, module_redis, "--drain")
    try:
        assert work.wait(30) == 0, work.log()
    finally:
        work.kill()
    log = work.log()
    said = "no handler here for step two of workflow 'job': left to runners that have one"
    assert log.count(said) == 1, log
    assert f"run {run_id} step one attempt 1: ok (" in log, log
    assert f"run {run_id} step two" not in log, log
    run = run_hash(db, "job", run_id)
    # Untouched by this runner: no lease taken, no attempt counted.
    assert (run["phase"], run["step"], run.get("attempt", "0"), run.get("lease", "")) == (
        "running", "two", "0", "")  # fmt: skip


@pytest.mark.slow
def test_sighup_reloads_the_handlers_and_a_broken_file_is_refused_in_one_line(
    workdir: Path, module_redis: RedisServer
) -> None:
    write_config(workdir, handlers_config("v1"))
    (workdir / "start.yaml").write_text(handlers_config("v1"))  # the runs start from it
    lines = workdir / "lines"
    work = Work(workdir, module_redis)
    try:
        work.wait_for_log("taking steps of job")
        first = start_run(workdir, module_redis, "job", "start.yaml")
        wait_for(lambda: lines.exists() and f"v1 {first}" in lines.read_text(), 20, "v1 ran")

        write_config(workdir, handlers_config("v2"))
        work.process.send_signal(signal.SIGHUP)
        work.wait_for_log("work: reloaded ")
        second = start_run(workdir, module_redis, "job", "start.yaml")
        wait_for(lambda: f"v2 {second}" in lines.read_text(), 20, "v2 ran")

        write_config(workdir, handlers_config("v3").replace("]}", "], timeout: soon}"))
        work.process.send_signal(signal.SIGHUP)
        work.wait_for_log("work: reload refused")
        third = start_run(workdir, module_redis, "job", "start.yaml")
        wait_for(lambda: f"v2 {third}" in lines.read_text(), 20, "v2 ran again")
        assert work.process.poll() is None
        work.process.send_signal(signal.SIGTERM)
        assert work.wait(20) == 0
    finally:
        work.kill()
    log = work.log()
    refused = [line for line in log.splitlines() if "reload refused" in line]
    assert refused == [
        "work: reload refused, the handlers in use kept: "
        f"{workdir / 'triggers.yaml'}: workflow 'job': field 'handlers.one.timeout': must be "
        "a duration like '30s', '500ms' or '2m' (got 'soon')"
    ], log
    assert lines.read_text().splitlines() == [f"v1 {first}", f"v2 {second}", f"v2 {third}"]
    assert "Traceback" not in log, log
