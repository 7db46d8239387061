"""Hot reload of triggers.yaml: SIGHUP and `realm triggers reload` against real `realm
listen` processes (1 and 2 workers) and a real redis-server.

Each test starts its own listener on the module's server (flushed first), so the
store's record of each workflow's partitions is the one its listener made. The
listener's log is the synchronisation point: a reload is done when its
``config_reload`` line(s) appear (one per worker that applied it; one in all for a
refused file).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync

from gateway.serving.pidfile import answer_path
from tests.listener import Listener
from tests.servers import RedisServer
from tests.signing import github_headers

GH_SECRET = "gh-reload-7c1e9a0b3d5f"
ENV = {"GH_SECRET": GH_SECRET}
ROOT = Path(__file__).resolve().parents[1]


def trigger(name: str, workflow: str, path: str, secret_env: str = "GH_SECRET") -> str:
    return f"""
  {name}:
    workflow: {workflow}
    path: {path}
    verify: {{scheme: github, secret_env: {secret_env}}}
    event_id: {{header: X-GitHub-Delivery}}"""


def config(
    on_x: tuple[str, ...] = ("a", "b"),
    *,
    other: str = "/hooks/old",
    settings: str = "",
    wp_partitions: int = 1,
    extra: str = "",
) -> str:
    """Triggers ``on_x`` on /hooks/x (a → wa, b → wb, c → wc), trigger ``o`` alone on
    ``other``; workflow wp (no trigger) has ``wp_partitions``."""
    triggers = "".join(trigger(t, f"w{t}", "/hooks/x") for t in on_x)
    return (
        f"version: 1\n{settings}"
        "workflows:\n"
        "  wa: {steps: [one]}\n  wb: {steps: [one]}\n  wc: {steps: [one]}\n"
        "  wo: {steps: [one]}\n"
        f"  wp: {{steps: [one], partitions: {wp_partitions}}}\n"
        f"triggers:{triggers}{trigger('o', 'wo', other)}{extra}\n"
    )


V1 = config(("a", "b"), other="/hooks/old")
V2 = config(("a", "c"), other="/hooks/new")


def version(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def write(path: Path, text: str) -> None:
    """Replace the file whole, as an editor or a ConfigMap update does."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def deliver(http: httpx.Client, path: str) -> httpx.Response:
    body = json.dumps({"ref": "refs/heads/main", "nonce": uuid.uuid4().hex}).encode()
    return http.post(path, content=body, headers=github_headers(body, GH_SECRET))


def triggers_of(reply: httpx.Response) -> set[str]:
    assert reply.status_code == 202, reply.text
    results = reply.json()["results"]
    assert {r["outcome"] for r in results} == {"started"}, results
    return {r["trigger"] for r in results}


def reload_lines(listener: Listener) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in listener.log().splitlines()
        if line.startswith('{"event":"config_reload"')
    ]


def wait_until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_for_lines(listener: Listener, result: str, n: int) -> list[dict[str, Any]]:
    """The log's ``result`` lines, once there are ``n`` of them."""
    wait_until(
        f"{n} '{result}' line(s) in the log:\n{listener.log()[-3000:]}",
        lambda: len([x for x in reload_lines(listener) if x["result"] == result]) >= n,
    )
    return [x for x in reload_lines(listener) if x["result"] == result]


def all_started(listener: Listener) -> Listener:
    """``listener`` once every worker serves (Listener.start waits for the first one):
    a worker still starting would read the file as it is then."""
    wait_until(
        f"{listener.workers} worker(s) to start",
        lambda: listener.log().count("Application startup complete.") == listener.workers,
    )
    return listener


def hup(listener: Listener) -> None:
    assert listener.process is not None
    os.kill(listener.process.pid, signal.SIGHUP)


def readyz_versions(listener: Listener, answers: int = 12) -> set[str]:
    """config_version from ``answers`` fresh connections (each may reach either worker)."""
    seen = set()
    for _ in range(answers):
        reply = httpx.get(f"{listener.base_url}/readyz", timeout=5)
        assert reply.status_code == 200, reply.text
        seen.add(reply.json()["config_version"])
    return seen


def reloads_metric(listener: Listener) -> dict[str, float]:
    text = httpx.get(f"{listener.base_url}/metrics", timeout=5).text
    found = re.findall(r'^realm_config_reloads_total\{result="(\w+)"\} (\S+)$', text, re.M)
    return {result: float(n) for result, n in found}


@pytest.fixture
def start(
    tmp_path: Path, db: redis_sync.Redis, module_redis: RedisServer
) -> Iterator[Callable[..., Listener]]:
    started: list[Listener] = []

    def start_listener(text: str = V1, *, workers: int = 1, args: tuple[str, ...] = ()) -> Listener:
        workdir = tmp_path / f"listen{len(started)}"
        workdir.mkdir()
        listener = Listener(workdir, text, redis_url=module_redis.url, env=ENV, workers=workers,
                            args=args)  # fmt: skip
        started.append(listener)
        return all_started(listener.start())

    yield start_listener
    for listener in started:
        listener.stop()


# ---------------------------------------------------------------------------- SIGHUP


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_serves_the_new_file(start: Callable[..., Listener], workers: int) -> None:
    listener = start(V1, workers=workers)
    assert readyz_versions(listener) == {version(V1)}
    with httpx.Client(base_url=listener.base_url, timeout=10) as http:
        assert triggers_of(deliver(http, "/hooks/x")) == {"a", "b"}
        assert triggers_of(deliver(http, "/hooks/old")) == {"o"}
        assert deliver(http, "/hooks/new").status_code == 404

        write(listener.config_path, V2)
        hup(listener)
        applied = wait_for_lines(listener, "applied", workers)
        wait_until("every /readyz answer to show the new version",
                   lambda: readyz_versions(listener) == {version(V2)})  # fmt: skip

        assert triggers_of(deliver(http, "/hooks/x")) == {"a", "c"}
        assert triggers_of(deliver(http, "/hooks/new")) == {"o"}
        gone = deliver(http, "/hooks/old")
        assert (gone.status_code, gone.json()) == (
            404,
            {"status": "error", "code": "NOT_FOUND_ROUTE", "message": "no route /hooks/old"},
        )
        assert "/hooks/new" in http.get("/openapi.json").json()["paths"]
    # One line per worker, each naming the file and both versions.
    assert [{k: v for k, v in x.items() if k not in ("pid", "ts")} for x in applied] == [
        {"event": "config_reload", "level": "info", "result": "applied",
         "file": str(listener.config_path.resolve()), "version": version(V2),
         "from_version": version(V1)},
    ] * workers  # fmt: skip
    assert len({x["pid"] for x in applied}) == workers
    assert reload_lines(listener) == applied
    assert reloads_metric(listener) == {"applied": workers}


BAD_FILES = [
    (
        "version: 1\nworkflows: [\n",
        "not valid YAML at line 3, column 1: expected the node content, but found '<stream end>'",
    ),
    (
        config(("a", "b"), extra=trigger("c", "wc", "/hooks/c", "NEW_SECRET")),
        "trigger 'c': field 'verify.secret_env': environment variable NEW_SECRET is not set",
    ),
    (
        config(("a", "b"), settings="settings: {key_prefix: other, redis_timeout: 3}\n"),
        "settings.key_prefix changed (was 'realm', now 'other'); settings.redis_timeout "
        "changed (was 2, now 3); restart the listener to apply them",
    ),
    (
        config(("a", "b"), wp_partitions=4),
        "workflow 'wp': field 'partitions': the store holds this workflow's data with "
        "partitions: 1; changing it to 4 is refused (there is no migration: keep it, or use "
        "a new workflow name)",
    ),
]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_refused_file_keeps_the_old_version(start: Callable[..., Listener], workers: int) -> None:
    listener = start(V1, workers=workers)
    assert listener.process is not None
    file = str(listener.config_path.resolve())
    with httpx.Client(base_url=listener.base_url, timeout=10) as http:
        for n, (text, problem) in enumerate(BAD_FILES, 1):
            write(listener.config_path, text)
            hup(listener)
            line = wait_for_lines(listener, "refused", n)[-1]
            # With 2 workers the supervisor refuses it, once; with 1 the worker does.
            assert line == {
                "event": "config_reload", "ts": line["ts"], "level": "error", "result": "refused",
                "file": file, "version": version(V1), "error": f"{file}: {problem}",
                "pid": listener.process.pid,
            }  # fmt: skip
            assert readyz_versions(listener, 4) == {version(V1)}
            assert triggers_of(deliver(http, "/hooks/x")) == {"a", "b"}
        # A good file after them: once every worker has applied it, no worker has
        # logged a refusal of its own.
        write(listener.config_path, V2)
        hup(listener)
        wait_for_lines(listener, "applied", workers)
        assert triggers_of(deliver(http, "/hooks/x")) == {"a", "c"}
    results = Counter(x["result"] for x in reload_lines(listener))
    assert results == {"refused": len(BAD_FILES), "applied": workers}
    assert reloads_metric(listener) == {"refused": len(BAD_FILES), "applied": workers}
    assert GH_SECRET not in listener.log()


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_during_start_up_is_harmless(
    tmp_path: Path, db: redis_sync.Redis, module_redis: RedisServer, workers: int
) -> None:
    """From the moment its pid file exists until it serves, and on, a listener may get
    SIGHUP (a reload racing its start): it neither dies nor misses the file's last text."""
    listener = Listener(tmp_path, V1, redis_url=module_redis.url, env=ENV, workers=workers)
    stop = threading.Event()
    sent = [0]

    def hammer() -> None:
        while not stop.is_set():
            for pid_file in (tmp_path / ".realm").glob("listen@*.pid"):
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGHUP)
                except (ValueError, ProcessLookupError, FileNotFoundError):
                    pass  # gone with its listener (a half-written one cannot be seen)
                else:
                    sent[0] += 1
                    if sent[0] == 5:
                        write(listener.config_path, V2)  # changed during start-up
            time.sleep(0.005)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        listener.start()
        at_start = sent[0]
        wait_until("50 more signals to the serving listener", lambda: sent[0] >= at_start + 50)
    finally:
        stop.set()
        thread.join()
    try:
        assert at_start >= 5, at_start
        assert listener.process is not None and listener.process.poll() is None
        wait_until("every worker to serve V2",
                   lambda: readyz_versions(listener) == {version(V2)})  # fmt: skip
        with httpx.Client(base_url=listener.base_url, timeout=10) as http:
            assert triggers_of(deliver(http, "/hooks/x")) == {"a", "c"}
        assert [x for x in reload_lines(listener) if x["result"] != "applied"] == []
        assert "Child process" not in listener.log()  # no worker died and was replaced
    finally:
        listener.stop()


# ---------------------------------------------------------------------------- under load


@pytest.mark.slow
def test_reloads_under_load_drop_nothing_and_never_mix_versions(
    start: Callable[..., Listener],
) -> None:
    """20 reloads alternating V1 and V2 while senders deliver without pause to /hooks/x,
    whose triggers differ between them: every delivery is answered 2xx by exactly
    one version's triggers."""
    listener = start(V1, workers=2)
    sets = {frozenset({"a", "b"}): version(V1), frozenset({"a", "c"}): version(V2)}
    replies: list[tuple[int, frozenset[str] | str]] = []
    errors: list[str] = []

    async def sender(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=listener.base_url, timeout=10) as http:
            while not done.is_set():
                body = json.dumps({"nonce": uuid.uuid4().hex}).encode()
                try:
                    reply = await http.post(
                        "/hooks/x", content=body, headers=github_headers(body, GH_SECRET)
                    )
                except httpx.HTTPError as exc:
                    errors.append(type(exc).__name__)
                    continue
                if reply.status_code == 202:
                    replies.append((202, frozenset(r["trigger"] for r in reply.json()["results"])))
                else:
                    replies.append((reply.status_code, reply.text))

    async def reloads() -> list[int]:
        done = asyncio.Event()
        senders = [asyncio.create_task(sender(done)) for _ in range(6)]
        seen_at_reload = []
        try:
            for n in range(1, 21):
                write(listener.config_path, V2 if n % 2 else V1)
                hup(listener)
                deadline = time.monotonic() + 20
                while len([x for x in reload_lines(listener) if x["result"] == "applied"]) < 2 * n:
                    assert time.monotonic() < deadline, f"reload {n} not applied"
                    await asyncio.sleep(0.02)
                seen_at_reload.append(len(replies))
        finally:
            done.set()
            await asyncio.gather(*senders)
        return seen_at_reload

    seen_at_reload = asyncio.run(reloads())
    assert errors == []
    assert [r for r in replies if r[0] != 202] == []
    by_version = Counter(sets.get(r[1]) for r in replies)  # type: ignore[arg-type]
    assert set(by_version) == {version(V1), version(V2)}, by_version
    assert min(by_version.values()) > 0
    # Deliveries went on throughout: some were answered between each two reloads.
    assert all(b > a for a, b in itertools.pairwise(seen_at_reload)), seen_at_reload
    assert Counter(x["result"] for x in reload_lines(listener)) == {"applied": 40}


# ---------------------------------------------------------------------------- realm triggers reload


def realm(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`realm` in ``cwd``, with no REALM_* variable and no secret of the listener."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REALM_") and k != "GH_SECRET"}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], cwd=cwd, env={**clean, **(env or {})},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def pid_file_of(listener: Listener) -> Path:
    return listener.workdir / ".realm" / f"listen@127.0.0.1:{listener.port}.pid"


def applied_it(pid: int, text: str) -> str:
    """What `realm triggers reload` prints when the listener applied ``text``."""
    return (
        f"triggers.yaml: ok (version {version(text)})\n"
        f"realm listen (pid {pid}) applied it: it serves version {version(text)}\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_triggers_reload_says_what_the_listener_did(
    start: Callable[..., Listener], workers: int
) -> None:
    listener = start(V1, workers=workers)
    assert listener.process is not None
    pid = listener.process.pid
    workdir = listener.workdir
    pid_file = pid_file_of(listener)
    assert pid_file.read_text() == f"{pid}\n"
    file = str(listener.config_path.resolve())

    # A broken file is refused here: the listener never hears of it.
    write(listener.config_path, "version: 1\nworkflows: [\n")
    broken = realm(workdir, "triggers", "reload")
    assert (broken.returncode, broken.stdout) == (3, "")
    assert broken.stderr == (
        "error: triggers.yaml: not valid YAML at line 3, column 1: expected the node content, "
        "but found '<stream end>'; the listener was not signalled\n"
    )
    assert reload_lines(listener) == []

    # Checked without the listener's secrets (this shell has none), then applied: once
    # the command has answered, the listener serves the file.
    write(listener.config_path, V2)
    done = realm(workdir, "triggers", "reload")
    assert (done.returncode, done.stderr, done.stdout) == (0, "", applied_it(pid, V2))
    if workers == 1:
        assert readyz_versions(listener) == {version(V2)}
    wait_for_lines(listener, "applied", workers)
    wait_until("every /readyz answer to show V2",
               lambda: readyz_versions(listener) == {version(V2)})  # fmt: skip

    # Refused by the listener: the command says why, and exits 3.
    new_prefix = config(("a", "c"), other="/hooks/new", settings="settings: {key_prefix: x}\n")
    new_secret = config(("a", "c"), other="/hooks/new", extra=trigger("n", "wc", "/n", "NEW"))
    for text, problem in [
        (
            new_prefix,
            "settings.key_prefix changed (was 'realm', now 'x'); restart the listener to apply it",
        ),
        (new_secret, "trigger 'n': field 'verify.secret_env': environment variable NEW is not set"),
    ]:
        write(listener.config_path, text)
        no = realm(workdir, "triggers", "reload")
        assert (no.returncode, no.stdout) == (3, f"triggers.yaml: ok (version {version(text)})\n")
        assert no.stderr == (
            f"error: realm listen (pid {pid}) refused the file: {file}: {problem}; it still "
            f"serves version {version(V2)}\n"
        )
    assert readyz_versions(listener) == {version(V2)}

    # The same text again is applied again: the command waits for the answer to its own
    # signal, not an earlier one.
    write(listener.config_path, V2)
    again = realm(workdir, "triggers", "reload")
    assert (again.returncode, again.stdout) == (0, applied_it(pid, V2))
    assert Counter(x["result"] for x in reload_lines(listener)) == {
        "applied": 2 * workers, "refused": 2,
    }  # fmt: skip

    listener.stop()
    assert not pid_file.exists()
    assert not answer_path(pid_file).exists()


def test_triggers_reload_with_a_pid_file_of_its_own(
    start: Callable[..., Listener], tmp_path: Path
) -> None:
    (tmp_path / "run").mkdir()
    pid_file = tmp_path / "run" / "realm.pid"
    listener = start(V1, args=("--pid-file", str(pid_file)))
    assert listener.process is not None
    assert pid_file.read_text() == f"{listener.process.pid}\n"
    assert list((listener.workdir / ".realm").glob("listen@*")) == []
    write(listener.config_path, V2)
    done = realm(listener.workdir, "triggers", "reload", "--pid-file", str(pid_file))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == applied_it(listener.process.pid, V2)
    assert answer_path(pid_file) == tmp_path / "run" / "realm.pid.reloaded"
    assert json.loads(answer_path(pid_file).read_text())["generation"] == 1
    assert readyz_versions(listener, 1) == {version(V2)}
    listener.stop()
    assert not pid_file.exists() and not answer_path(pid_file).exists()


def test_listeners_sharing_a_data_folder_each_have_their_pid_file(
    start: Callable[..., Listener], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    one = start(V1, args=("--data-dir", str(shared)))
    two = start(V1, args=("--data-dir", str(shared)))
    assert one.process is not None and two.process is not None
    files = sorted(shared.glob("listen@*.pid"))
    assert [f.name for f in files] == sorted(
        f"listen@127.0.0.1:{port}.pid" for port in (one.port, two.port)
    )
    # Which one? Not guessed.
    run = realm(one.workdir, "triggers", "reload", "--data-dir", str(shared))
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == (
        f"error: 2 listeners write pid files in {shared}: {files[0].name}, {files[1].name}; "
        "pass --port (or --pid-file) to say which to reload\n"
    )
    # --port says which: only that one reloads.
    write(one.config_path, V2)
    done = realm(one.workdir, "triggers", "reload", "--data-dir", str(shared),
                 "--port", str(one.port))  # fmt: skip
    assert (done.returncode, done.stdout) == (0, applied_it(one.process.pid, V2))
    assert readyz_versions(one, 2) == {version(V2)}
    assert readyz_versions(two, 2) == {version(V1)}
    assert reload_lines(two) == []
    # One stops: its file goes, the other's stays, and is now the only one.
    one.stop()
    assert [f.name for f in shared.glob("listen@*.pid")] == [f"listen@127.0.0.1:{two.port}.pid"]
    write(two.config_path, V2)
    done = realm(two.workdir, "triggers", "reload", "--data-dir", str(shared))
    assert (done.returncode, done.stdout) == (0, applied_it(two.process.pid, V2))
    # The port given must be a listener's.
    run = realm(two.workdir, "triggers", "reload", "--data-dir", str(shared), "--port", "1")
    assert (run.returncode, run.stdout) == (4, "")
    assert run.stderr == (
        f"error: no pid file at {shared}/listen@<host>:1.pid: is `realm listen` running? It "
        "writes one there, or at its --pid-file: pass the same --data-dir (and --port), or "
        "--pid-file\n"
    )


def fake_listener(workdir: Path, code: str) -> subprocess.Popen[bytes]:
    """A process whose command line reads `realm listen` (as the real one's does) and
    that runs ``code``; its pid in the default pid file of port 8000."""
    process = subprocess.Popen([sys.executable, "-c", code, "realm", "listen"],
                               stdout=subprocess.PIPE)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    (workdir / ".realm" / "listen@127.0.0.1:8000.pid").write_text(f"{process.pid}\n")
    return process


def test_a_listener_that_does_not_answer_in_time(workdir: Path) -> None:
    deaf = fake_listener(
        workdir,
        "import signal, time\nsignal.signal(signal.SIGHUP, "
        "signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)",
    )
    try:
        run = realm(workdir, "triggers", "reload", "--timeout", "0.5")
        assert (run.returncode, run.stdout) == (4, f"triggers.yaml: ok (version {version(V1)})\n")
        assert run.stderr == (
            f"error: sent SIGHUP to realm listen (pid {deaf.pid}), which did not answer within "
            "0.5 s; its log says whether it applied the file\n"
        )
        assert deaf.poll() is None
    finally:
        deaf.kill()
        deaf.wait()
    # One that SIGHUP ends (as a listener too old to answer would not, but a process
    # that stops): said at once, not after the timeout.
    mortal = fake_listener(workdir, "import time\nprint('ready', flush=True)\ntime.sleep(60)")
    try:
        started = time.monotonic()
        run = realm(workdir, "triggers", "reload")
        assert time.monotonic() - started < 10
        assert (run.returncode, run.stderr) == (
            4, f"error: realm listen (pid {mortal.pid}) stopped before it answered\n",
        )  # fmt: skip
    finally:
        mortal.kill()
        mortal.wait()


def test_listen_refuses_a_pid_file_it_cannot_write(
    tmp_path: Path, module_redis: RedisServer
) -> None:
    (tmp_path / "triggers.yaml").write_text(V1)
    (tmp_path / "a-file").write_text("")
    run = realm(
        tmp_path, "listen", "--port", "0", "--redis-url", module_redis.url,
        "--pid-file", str(tmp_path / "a-file" / "listen.pid"), env=ENV,
    )  # fmt: skip
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == (
        f"error: --pid-file {tmp_path}/a-file/listen.pid: cannot write it (Not a directory)\n"
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "triggers.yaml").write_text(V1)
    (tmp_path / ".realm").mkdir()
    return tmp_path


PID_FILE = ".realm/listen@127.0.0.1:8000.pid"


def test_triggers_reload_without_a_pid_file(workdir: Path) -> None:
    for args, port in [((), "<port>"), (("--port", "8000"), "8000")]:
        run = realm(workdir, "triggers", "reload", *args)
        assert (run.returncode, run.stdout) == (4, "")
        assert run.stderr == (
            f"error: no pid file at .realm/listen@<host>:{port}.pid: is `realm listen` "
            "running? It writes one there, or at its --pid-file: pass the same --data-dir "
            "(and --port), or --pid-file\n"
        )


def test_triggers_reload_with_a_garbled_pid_file(workdir: Path) -> None:
    (workdir / PID_FILE).write_text("12ab\n")
    run = realm(workdir, "triggers", "reload")
    assert (run.returncode, run.stdout) == (4, "")
    assert run.stderr == f"error: {PID_FILE} does not hold a process id\n"


def test_triggers_reload_with_a_stale_pid_file(workdir: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(gone.stdout)
    (workdir / PID_FILE).write_text(f"{pid}\n")
    run = realm(workdir, "triggers", "reload")
    assert (run.returncode, run.stdout) == (4, "")
    assert run.stderr == (
        f"error: {PID_FILE} names process {pid}, which is not running (a listener "
        "that stopped without removing it); start `realm listen`\n"
    )


def test_triggers_reload_never_signals_another_program(workdir: Path) -> None:
    """The pid was reused by a program that SIGHUP would end: it is left alone."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (workdir / PID_FILE).write_text(f"{other.pid}\n")
        run = realm(workdir, "triggers", "reload")
        assert (run.returncode, run.stdout) == (4, "")
        assert run.stderr == (
            f"error: {PID_FILE} names process {other.pid}, which is not `realm listen` "
            "(the file is stale and the id now belongs to another program); it was not "
            "signalled\n"
        )
        # A broken file is refused before the pid file is even read.
        (workdir / "triggers.yaml").write_text("version: 2\n")
        run = realm(workdir, "triggers", "reload")
        assert (run.returncode, run.stderr) == (
            3,
            "error: triggers.yaml: field 'version' must be 1 (got 2); the listener was not "
            "signalled\n",
        )
        assert other.poll() is None  # alive: never sent SIGHUP
    finally:
        other.kill()
        other.wait()


# ---------------------------------------------------------------------------- ConfigMap volume


def configmap_volume(folder: Path, text: str) -> None:
    """Lay out (or update) ``folder`` as the kubelet lays out a ConfigMap volume:
    triggers.yaml -> ..data/triggers.yaml, ..data -> a folder of this version's files,
    swapped with one rename; the previous version's folder is then removed."""
    old = (folder / "..data").resolve() if (folder / "..data").is_symlink() else None
    fresh = folder / f"..{uuid.uuid4().hex[:8]}"
    fresh.mkdir()
    (fresh / "triggers.yaml").write_text(text)
    (folder / "..data_tmp").symlink_to(fresh.name)
    os.replace(folder / "..data_tmp", folder / "..data")
    if not (folder / "triggers.yaml").is_symlink():
        (folder / "triggers.yaml").unlink(missing_ok=True)
        (folder / "triggers.yaml").symlink_to("..data/triggers.yaml")
    if old is not None:
        shutil.rmtree(old)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_configmap_update_is_reloaded(
    tmp_path: Path, db: redis_sync.Redis, module_redis: RedisServer, workers: int
) -> None:
    """A listener reads the file through its links, as a pod reads its mounted
    ConfigMap: after the kubelet swaps in a new version (and removes the old folder),
    a reload serves the new text."""
    listener = Listener(tmp_path, V1, redis_url=module_redis.url, env=ENV, workers=workers)
    configmap_volume(tmp_path, V1)
    try:
        all_started(listener.start())
        assert listener.process is not None
        configmap_volume(tmp_path, V2)
        done = realm(tmp_path, "triggers", "reload")
        assert (done.returncode, done.stderr, done.stdout) == (
            0, "", applied_it(listener.process.pid, V2),
        )  # fmt: skip
        wait_until("every /readyz answer to show V2",
                   lambda: readyz_versions(listener) == {version(V2)})  # fmt: skip
    finally:
        listener.stop()
