"""Private redis-server / valkey-server processes for tests, on free loopback ports.

The binary is found as the gateway finds it (gateway.link.embedded.find_server_binary),
so the suite runs with the pip-shipped Valkey when no server is on PATH. No
test touches a server it did not start here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from gateway.link.embedded import find_server_binary


def _die_with_parent() -> None:
    """Linux: the server gets SIGKILL if the test process dies (a crash, a CI time
    limit), so no server outlives the suite that started it. Strictly, when the thread
    that started it ends: a server that must outlive a test (one of a module's
    cluster) is started from the main thread, never through asyncio.to_thread, whose
    threads end when the test's event loop closes."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One server process. ``extra`` are more ``--name value`` arguments."""

    def __init__(self, data_dir: Path, *extra: str, appendonly: bool = False) -> None:
        self.binary = find_server_binary()
        self.data_dir = data_dir
        self.extra = list(extra)
        self.appendonly = appendonly
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a free port can be taken between probe and bind
            port = self.port or free_port()
            args = [
                self.binary, "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--logfile", "server.log", *self.extra,
            ]  # fmt: skip
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )  # fmt: skip
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.process.poll() is None:
                if _answers(port):
                    self.port = port
                    return self
                time.sleep(0.02)
            self.stop()
        raise RuntimeError(f"could not start {self.binary}; see {self.data_dir}/server.log")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL: no chance to flush anything."""
        if self.process:
            self.process.kill()
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        assert self.process
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Stop and start again on the same port and data folder."""
        self.stop()
        self.start()
