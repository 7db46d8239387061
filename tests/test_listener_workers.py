"""`realm listen --workers 2`: what its workers serve and how long they live, against
real `realm listen` processes and a real redis-server.

- A worker that dies and is replaced serves the text the listener accepted, not the
  file on disk after a refused reload (a new key_prefix or partitions would put the
  same event's run in another keyspace).
- A reload applies in every worker or in none, even when the workers' Redis
  connections stall during it (tests/tcp_proxy.py holds every connection of the
  worker processes, new ones too).
- Workers end when their supervisor is killed with `kill -9`, leaving the port free;
  a port someone else holds is refused naming the processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from tests.listener import Listener, run_state_keys
from tests.servers import RedisServer, free_port
from tests.signing import github_headers
from tests.tcp_proxy import TcpProxy
from tests.test_reload import (
    ENV,
    GH_SECRET,
    all_started,
    readyz_versions,
    realm,
    reload_lines,
    version,
    wait_for_lines,
    wait_until,
    write,
)


def config(*, settings: str = "", partitions: int = 1, extra: str = "") -> str:
    """Workflow wk (``partitions``) behind trigger k on /hooks/k, keyed by the delivery id."""
    return (
        f"version: 1\n{settings}"
        "workflows:\n"
        f"  wk: {{steps: [one], partitions: {partitions}}}\n"
        f"{extra}"
        "triggers:\n"
        "  k:\n"
        "    workflow: wk\n"
        "    path: /hooks/k\n"
        "    verify: {scheme: github, secret_env: GH_SECRET}\n"
        "    event_id: {header: X-GitHub-Delivery}\n"
        # Under partitions a replay guard cannot be kept (gateway/loading.py).
        "    replay_guard: false\n"
    )


V1 = config()
BODY = json.dumps({"ref": "refs/heads/main"}).encode()
EVENT = "6f0e3d1c-event-of-this-test"


def send_event(base_url: str) -> httpx.Response:
    """The same delivery every time, on a connection of its own (any worker may take it)."""
    headers = github_headers(BODY, GH_SECRET, delivery=EVENT)
    return httpx.post(f"{base_url}/hooks/k", content=BODY, headers=headers, timeout=10)


def children(pid: int) -> set[int]:
    """The worker processes of the supervisor ``pid``."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        # "pid (comm) state ppid ...": the name may hold spaces, not ")".
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.add(int(proc.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def start(
    tmp_path: Path, db: redis_sync.Redis, module_redis: RedisServer
) -> Iterator[Callable[..., Listener]]:
    started: list[Listener] = []

    def start_listener(text: str = V1, *, redis_url: str | None = None) -> Listener:
        workdir = tmp_path / f"listen{len(started)}"
        workdir.mkdir()
        listener = Listener(workdir, text, redis_url=redis_url or module_redis.url, env=ENV,
                            workers=2)  # fmt: skip
        started.append(listener)
        return all_started(listener.start())

    yield start_listener
    for listener in started:
        listener.stop()


def kill_every_worker(listener: Listener) -> None:
    """kill -9 each worker in turn, waiting for its replacement to serve: afterwards
    every worker is one the supervisor started after the reload."""
    assert listener.process is not None
    supervisor = listener.process.pid
    for n, worker in enumerate(sorted(children(supervisor)), 1):
        os.kill(worker, signal.SIGKILL)

        def replaced(started: int = 2 + n) -> bool:
            return listener.log().count("Application startup complete.") == started

        wait_until(f"worker {worker}'s replacement to serve", replaced)
        assert worker not in children(supervisor)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("refused_text", "why"),
    [
        (
            config(settings="settings: {key_prefix: other}\n"),
            "settings.key_prefix changed (was 'realm', now 'other'); restart the listener "
            "to apply it",
        ),
        (
            config(partitions=4),
            "workflow 'wk': field 'partitions': the store holds this workflow's data with "
            "partitions: 1; changing it to 4 is refused (there is no migration: keep it, or "
            "use a new workflow name)",
        ),
    ],
    ids=["key_prefix", "partitions"],
)
def test_a_replacement_worker_serves_the_accepted_text_not_a_refused_file(
    start: Callable[..., Listener], db: redis_sync.Redis, refused_text: str, why: str
) -> None:
    listener = start(V1)
    first = send_event(listener.base_url)
    assert first.status_code == 202, first.text
    (result,) = first.json()["results"]
    assert result["outcome"] == "started"

    write(listener.config_path, refused_text)
    os.kill(listener.process.pid, signal.SIGHUP)  # type: ignore[union-attr]
    (line,) = wait_for_lines(listener, "refused", 1)
    assert line["error"] == f"{listener.config_path.resolve()}: {why}"

    kill_every_worker(listener)
    assert readyz_versions(listener) == {version(V1)}
    for _ in range(8):  # each on a new connection: both workers answer some
        again = send_event(listener.base_url)
        assert again.status_code == 200, again.text
        (repeat,) = again.json()["results"]
        assert (repeat["outcome"], repeat["run_id"]) == ("deduplicated", result["run_id"])
    # One run, in the keyspace it started in: no key under another prefix or tag.
    keys = run_state_keys(db)
    assert [k for k in keys if not k.startswith("realm:") or "{wk#" in k] == []
    assert [k for k in keys if ":run:" in k] == [f"realm:{{wk}}:run:{result['run_id']}"]


@pytest.mark.slow
def test_a_reload_applies_in_every_worker_while_their_redis_connections_stall(
    start: Callable[..., Listener], module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    """The workers' connections stop answering during the reload of a file that adds a
    workflow (its partitions must be confirmed by the store), reconnect as they may.
    The supervisor asks on a connection of its own and decides; every worker applies
    the text it accepted."""
    proxy = TcpProxy(module_redis.port).start()
    try:
        listener = start(V1, redis_url=proxy.url)
        assert listener.process is not None
        workers = children(listener.process.pid)
        added = "  wn: {steps: [one]}\n"
        v2 = config(extra=added).replace(
            "    replay_guard: false\n",
            "    replay_guard: false\n  n:\n    workflow: wn\n    path: /hooks/n\n"
            "    verify: {scheme: github, secret_env: GH_SECRET}\n"
            "    event_id: {header: X-GitHub-Delivery}\n",
        )
        write(listener.config_path, v2)
        proxy.hold_processes(workers)
        done = realm(listener.workdir, "triggers", "reload")
        applied = wait_for_lines(listener, "applied", 2)
        # Every line so far: one per worker, both applied, none refused.
        assert {(x["pid"], x["version"]) for x in reload_lines(listener)} == {
            (pid, version(v2)) for pid in workers
        }
        assert len(applied) == 2
        assert (done.returncode, done.stderr) == (0, "")
        assert done.stdout.endswith(f"applied it: it serves version {version(v2)}\n")
        proxy.release()
        wait_until("every worker to answer /readyz with v2",
                   lambda: readyz_versions(listener) == {version(v2)})  # fmt: skip
        # The store recorded the new workflow's partitions (the supervisor did).
        assert db.hget("realm:{wn}:meta", "partitions") == "1"
        body = json.dumps({"n": 1}).encode()
        reply = httpx.post(f"{listener.base_url}/hooks/n", content=body,
                           headers=github_headers(body, GH_SECRET), timeout=10)  # fmt: skip
        assert reply.status_code == 202, reply.text
        assert [r["outcome"] for r in reply.json()["results"]] == ["started"]
    finally:
        proxy.release()
        proxy.stop()


# ---------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_workers_stop_when_the_supervisor_is_killed(start: Callable[..., Listener]) -> None:
    listener = start(V1)
    assert listener.process is not None
    port = listener.port
    workers = children(listener.process.pid)
    assert len(workers) == 2
    listener.process.kill()  # SIGKILL: it cannot stop its workers
    listener.process.wait()
    wait_until("both workers to end", lambda: not any(alive(pid) for pid in workers))
    # The port is free: a new listener starts on it and serves.
    workdir = listener.workdir.with_name("again")
    workdir.mkdir()
    again = Listener(workdir, V1, redis_url=listener.redis_url, env=ENV, workers=2)
    try:
        all_started(again.start(port=port))
        assert readyz_versions(again, 2) == {version(V1)}
    finally:
        again.stop()


def hold_port(name: bytes | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A process listening on a free port (named ``name``, as a worker names itself)."""
    port = free_port()
    code = (
        "import ctypes, socket, sys, time\n"
        f"name = {name!r}\n"
        "if name: ctypes.CDLL(None).prctl(15, name, 0, 0, 0)\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "print('ready', flush=True); time.sleep(120)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
    return holder, port


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names holders from /proc")
@pytest.mark.parametrize("named", [False, True], ids=["another-program", "orphan-worker"])
def test_a_port_in_use_names_the_processes_that_hold_it(
    tmp_path: Path, module_redis: RedisServer, named: bool
) -> None:
    holder, port = hold_port(b"realm-worker" if named else None)
    try:
        (tmp_path / "triggers.yaml").write_text(V1)
        run = realm(tmp_path, "listen", "--port", str(port), "--redis-url", module_redis.url,
                    env=ENV)  # fmt: skip
        comm = Path(f"/proc/{holder.pid}/comm").read_text().strip()
    finally:
        holder.kill()
        holder.wait()
    assert (run.returncode, run.stdout) == (5, "")
    if named:
        assert run.stderr == (
            f"error: --port {port} is already in use on 127.0.0.1: process {holder.pid} "
            "(realm-worker) listens there, a worker of a `realm listen` that is gone; stop "
            f"it (kill {holder.pid}) or choose another --port\n"
        )
    else:
        assert run.stderr == (
            f"error: --port {port} is already in use on 127.0.0.1: process {holder.pid} "
            f"({comm}) listens there; stop it (kill {holder.pid}) or choose another --port\n"
        )


def test_a_sigterm_from_the_kernel_reaches_a_worker_whose_parent_died(tmp_path: Path) -> None:
    """stop_with_parent on its own: a child that calls it ends (SIGTERM) when its
    parent is killed with SIGKILL, both with prctl and with the watch alone."""
    for use_prctl in (True, False):
        script = tmp_path / "family.py"
        script.write_text(
            "import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', '''\n"
            "import os, signal, sys, time\n"
            "import gateway.serving.workers as w\n"
            f"if not {use_prctl}: w._prctl = lambda *a: None\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), sys.exit(0)))\n"
            "w.stop_with_parent(os.getppid())\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n"
            "'''], stdout=sys.stdout)\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n"
        )
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline() == b"ready\n"
        parent.kill()
        parent.wait()
        started = time.monotonic()
        wait_until("the child to end", lambda: not alive(child), timeout=10)  # noqa: B023
        assert parent.stdout.readline() == b"term\n"
        assert time.monotonic() - started < 5
        parent.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_listening_processes_are_found_by_their_socket() -> None:
    from gateway.serving.listen import listening_processes

    me = (os.getpid(), Path("/proc/self/comm").read_text().strip())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert listening_processes(port) == []  # bound, not listening
        sock.listen()
        assert listening_processes(port) == [me]
