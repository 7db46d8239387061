"""``realm listen --workers N``: the supervisor of the worker processes, and what a
worker does as it starts.

The supervisor is uvicorn's, with three changes:

- SIGHUP reloads the config in each worker rather than replacing the workers
  (uvicorn's way, which cuts their open connections); the supervisor alone checks
  the file and decides (gateway/serving/reload.py says why).
- Workers serve the text it last accepted (``AcceptedText``), whenever they start:
  one that replaces a worker that died serves what the others serve, never a file on
  disk the listener refused.
- A worker ends when the supervisor does, even one killed with ``kill -9`` (it
  cannot stop them then): on Linux the kernel sends the worker SIGTERM
  (``prctl(PR_SET_PDEATHSIG)``); elsewhere, and as a second guard, the worker sees its
  parent change within a second. Either way it shuts down as on SIGTERM, so no worker
  keeps the port after its listener is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from uvicorn.supervisors import Multiprocess

from gateway.ingest.observe import setup_logging
from gateway.ingest.webhooks import Webhooks
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError
from gateway.serving.app import serving_app
from gateway.serving.reload import (
    AcceptedText,
    Answers,
    Reloaded,
    Reloads,
    check_partitions_at,
    count_in_supervisor,
    defer_hangups,
    hangup_while_starting,
    parse_for_reload,
    read_file,
    refused,
    text_version,
)

log = logging.getLogger("realm")

# What the supervisor tells its workers, by environment (they are spawned processes).
ACCEPTED_ENV = "REALM_ACCEPTED_CONFIG"  # the AcceptedText's file
SUPERVISOR_ENV = "REALM_SUPERVISOR_PID"  # the process whose end ends the worker
# The worker's process name (``ps``, ``top``, /proc/<pid>/comm; at most 15 bytes).
WORKER_NAME = b"realm-worker"

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


class Supervisor(Multiprocess):
    """uvicorn's supervisor of worker processes, which reloads the config in them on
    SIGHUP. ``accepted`` holds the text of ``config``; ``answers`` says what each
    reload did, for ``realm triggers reload``."""

    def __init__(
        self,
        uv_config: uvicorn.Config,
        sockets: list[socket.socket],
        *,
        config: Config,
        config_file: str,
        redis_url: str,
        accepted: AcceptedText,
        answers: Answers,
    ) -> None:
        super().__init__(uv_config, sockets)  # from here, SIGHUP is queued for handle_hup
        self.running = config  # what the workers serve
        self.config_file = config_file
        self.redis_url = redis_url
        self.accepted = accepted
        self.answers = answers
        if hangup_while_starting():  # one before the line above: reload once started
            self.signal_queue.append(signal.SIGHUP)

    def handle_signals(self) -> None:
        # SIGHUPs queued since the last look (every 0.5 s) would all read the same
        # file: one reload does.
        for _ in range(self.signal_queue.count(signal.SIGHUP) - 1):
            self.signal_queue.remove(signal.SIGHUP)
        super().handle_signals()

    # Every way uvicorn starts a worker, with SIGHUP held (see _hangups_held).
    def init_processes(self) -> None:
        with _hangups_held():
            super().init_processes()

    def keep_subprocess_alive(self) -> None:
        self.accepted.restore_if_missing()  # before a dead worker's successor reads it
        with _hangups_held():
            super().keep_subprocess_alive()

    def handle_ttin(self) -> None:
        with _hangups_held():
            super().handle_ttin()

    def handle_hup(self) -> None:
        self.answers.answer(self._reload())

    def _reload(self) -> Reloaded:
        file_version = None
        try:
            text = read_file(self.config_file)
            file_version = text_version(text)
            new = parse_for_reload(text, self.config_file, self.running.settings)
            asyncio.run(check_partitions_at(self.redis_url, new, self.running))
            # Written before any worker is told: a worker that reads it, now or when it
            # starts, serves this text and no other.
            self.accepted.write(text)
        except Exception as exc:
            # A ConfigError is one line for the log; of anything else, the type only
            # (its text may quote anything). Either way the workers keep their version.
            error = str(exc) if isinstance(exc, ConfigError) else f"unexpected {type(exc).__name__}"
            count_in_supervisor("refused")
            return refused(self.config_file, self.running.version, error, count=False,
                           file_version=file_version)  # fmt: skip
        self.running = new
        for process in self.processes:
            # Every worker, started or still starting: one that cannot handle SIGHUP yet
            # holds it until it can (_hangups_held).
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # gone: its successor reads it
                    os.kill(process.pid, signal.SIGHUP)
        return Reloaded(True, new.version, file_version=file_version)


def worker_app() -> Webhooks:
    """The app of one worker under the Supervisor: the text it accepted, served until
    the supervisor ends."""
    # A SIGHUP before the lifespan handles it (a reload racing this worker's start)
    # must not end the worker, as its default action would.
    defer_hangups()
    # Held since the supervisor started this process (_hangups_held): one sent since
    # then arrives now, and is noted.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    setup_logging()
    stop_with_parent(int(os.environ[SUPERVISOR_ENV]))
    accepted = AcceptedText(Path(os.environ[ACCEPTED_ENV]))
    path = os.environ["REALM_CONFIG"]
    try:
        config = parse_config(accepted.read(), file=path)
    except ConfigError as exc:
        # Not expected: the supervisor parsed the same text in the same environment.
        log.error("error: worker %d cannot serve the accepted config: %s", os.getpid(), exc)
        sys.exit(3)
    return serving_app(config, os.environ["REALM_REDIS_URL"], Reloads(accepted=accepted))


@contextlib.contextmanager
def _hangups_held() -> Iterator[None]:
    """SIGHUP held (blocked) in this thread while the block runs. A worker process
    started meanwhile inherits the held signal: until its app can handle SIGHUP
    (worker_app), a SIGHUP waits rather than ending it, so the supervisor may signal
    every worker at once, whatever its stage. One sent to the supervisor meanwhile
    arrives at the end of the block."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def stop_with_parent(parent: int) -> None:
    """SIGTERM to this process when ``parent`` ends (see the module docstring)."""
    _prctl(_PR_SET_NAME, WORKER_NAME)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it ended before the line above could take effect
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        log.error("the supervisor (pid %d) is gone: worker %d stops", parent, os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _prctl(option: int, value: int | bytes) -> None:
    """prctl(2) on Linux; nothing elsewhere (the parent watch stands in)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        # The running program's own symbols, the C library's among them.
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
