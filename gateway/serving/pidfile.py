"""The listener's pid file and reload answers: how ``realm triggers reload`` finds a
running ``realm listen`` and learns what it did with the file.

``realm listen`` writes its process id (one line, as systemd's ``PIDFile=`` reads
it) to ``--pid-file``, by default ``<data-dir>/listen@<host>:<port>.pid``: one file
per listener, so listeners sharing a data folder never take each other's. It
removes the file when it stops (only while it is still its own).

Next to it, in ``<pid file>.reloaded``, the listener answers each reload it handled:
a JSON object with a generation number (1 for its first reload, then counting),
the result (``applied`` or ``refused``), the version of the text it read, the
version serving afterwards and the refusal's reason. ``realm triggers reload`` notes
the generation, sends SIGHUP, and waits for a higher one about the text it checked.
A stale answer (a listener killed with ``kill -9``, whose pid a new one may reuse, as
process 1 of a container does) is removed when the next listener of that file starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("realm")

PID_FILE_PREFIX = "listen@"
PID_FILE_SUFFIX = ".pid"
ANSWER_SUFFIX = ".reloaded"


class PidFileError(Exception):
    """The ``--pid-file`` given cannot be written."""


class NoListener(Exception):
    """There is no running ``realm listen`` to signal; the message says why."""


class SeveralListeners(Exception):
    """More than one listener uses the data folder, and nothing says which one."""


def default_pid_file(data_dir: str, host: str, port: int) -> Path:
    """``<data_dir>/listen@<host>:<port>.pid`` (an IPv6 host in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return Path(data_dir) / f"{PID_FILE_PREFIX}{shown}:{port}{PID_FILE_SUFFIX}"


def answer_path(pid_file: Path) -> Path:
    """Where the listener of ``pid_file`` answers reloads."""
    return pid_file.with_name(pid_file.name + ANSWER_SUFFIX)


@contextlib.contextmanager
def pid_file_kept(
    pid_file: str | None, data_dir: str, host: str, port: int
) -> Iterator[Path | None]:
    """This process's id in the pid file while the block runs. A pid file that was
    asked for and cannot be written raises PidFileError; the default one, one line
    (the listener serves anyway, and SIGHUP still reloads it)."""
    path = Path(pid_file) if pid_file else default_pid_file(data_dir, host, port)
    pid = os.getpid()
    if not _write(path, pid, required=pid_file is not None):
        yield None
        return
    # A previous listener's answers are not this one's (its pid may be this one's).
    with contextlib.suppress(OSError):
        answer_path(path).unlink(missing_ok=True)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text(encoding="ascii")) == pid:  # still ours
                answer_path(path).unlink(missing_ok=True)
                path.unlink()


def _write(path: Path, pid: int, *, required: bool) -> bool:
    try:
        if not required:  # the data folder may not exist yet; a --pid-file's folder must
            path.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(path, f"{pid}\n".encode("ascii"))
        return True
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if required:
            raise PidFileError(f"--pid-file {path}: cannot write it ({reason})") from None
    log.warning(
        "no pid file at %s (%s): `realm triggers reload` cannot find this listener; "
        "send SIGHUP to process %d to reload its config", path, reason, pid,
    )  # fmt: skip
    return False


def _write_whole(path: Path, data: bytes) -> None:
    """Whole or absent: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


# ---------------------------------------------------------------------------- finding it


def find_pid_file(pid_file: str | None, data_dir: str, port: int | None) -> Path:
    """The pid file of the listener ``realm triggers reload`` means: ``pid_file`` if
    given; else the one in ``data_dir`` for ``port``, or the only one there. Raises
    NoListener when there is none, SeveralListeners when more than one could be meant
    (stale files, naming no running listener, are passed over then)."""
    if pid_file:
        return Path(pid_file)
    folder = Path(data_dir)
    found = sorted(folder.glob(f"{PID_FILE_PREFIX}*{PID_FILE_SUFFIX}"))
    if port is not None:
        found = [p for p in found if p.name.endswith(f":{port}{PID_FILE_SUFFIX}")]
    if len(found) > 1:
        running = [p for p in found if _names_a_listener(p)]
        found = running or found[:1]
    if len(found) > 1:
        named = ", ".join(p.name for p in found)
        raise SeveralListeners(
            f"{len(found)} listeners write pid files in {folder}: {named}; pass --port (or "
            "--pid-file) to say which to reload"
        )
    if not found:
        where = f"{folder}/{PID_FILE_PREFIX}<host>:{port if port is not None else '<port>'}.pid"
        raise NoListener(
            f"no pid file at {where}: is `realm listen` running? It writes one there, "
            "or at its --pid-file: pass the same --data-dir (and --port), or --pid-file"
        )
    return found[0]


def _names_a_listener(path: Path) -> bool:
    try:
        listener_pid(path)
    except NoListener:
        return False
    return True


def listener_pid(path: Path) -> int:
    """The id of the running ``realm listen`` the pid file names. Raises NoListener when
    there is none: no file, a stale one, or a process that is not ``realm listen``."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise NoListener(
            f"no pid file at {path}: is `realm listen` running? It writes one at "
            f"<data-dir>/{PID_FILE_PREFIX}<host>:<port>.pid, or at its --pid-file: pass the "
            "same --data-dir (and --port), or --pid-file"
        ) from None
    except OSError as exc:
        raise NoListener(f"cannot read {path}: {exc.strerror}") from None
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 2**31):
        raise NoListener(f"{path} does not hold a process id")
    pid = int(text)
    if not is_running(pid):
        raise NoListener(
            f"{path} names process {pid}, which is not running (a listener that stopped "
            "without removing it); start `realm listen`"
        )
    if not _is_listener(pid):
        raise NoListener(
            f"{path} names process {pid}, which is not `realm listen` (the file is stale "
            "and the id now belongs to another program); it was not signalled"
        )
    return pid


def signal_listener(pid: int, signum: int = signal.SIGHUP) -> None:
    """Send ``signum`` to ``pid`` (from listener_pid); NoListener if it cannot be."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        raise NoListener(f"process {pid} stopped before it could be signalled") from None
    except PermissionError:
        raise NoListener(
            f"not allowed to signal process {pid} (another user's): run this as the listener's user"
        ) from None


def is_running(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's too): it exists, and has not ended
    waiting for its parent to collect its exit status (a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: _is_listener and kill say more
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return True  # no /proc here: cannot tell
    # "pid (name) state ...": the name may hold anything but the last ")".
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _is_listener(pid: int) -> bool:
    """Whether the process runs ``realm listen`` (``python -m gateway listen`` too),
    from its command line. Where there is no /proc to read it from, the pid file is
    trusted."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return True  # /proc hides it (hidepid): cannot tell
    args = [arg.decode(errors="replace") for arg in raw.split(b"\0")]
    return any(
        os.path.basename(arg) in ("realm", "gateway") and args[i + 1 : i + 2] == ["listen"]
        for i, arg in enumerate(args)
    )


# ---------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Answer:
    """What the listener did with one reload. ``file_version``: the version of the
    text it read (None: it could not read the file); ``version``: the one serving
    afterwards."""

    pid: int
    generation: int
    result: str
    file_version: str | None
    version: str
    error: str | None = None

    @property
    def applied(self) -> bool:
        return self.result == "applied"


def write_answer(path: Path, answer: Answer) -> None:
    """Replace the answer file whole; a failure is one log line (the reload stands)."""
    try:
        _write_whole(path, orjson.dumps(answer.__dict__))
    except OSError as exc:
        log.warning(
            "cannot write the reload answer %s (%s): `realm triggers reload` will not hear "
            "of this reload", path, exc.strerror or type(exc).__name__,
        )  # fmt: skip


def read_answer(path: Path) -> Answer | None:
    """The last answer in ``path``; None if there is none (or not one of ours)."""
    try:
        data: Any = orjson.loads(path.read_bytes())
        return Answer(**data)
    except (OSError, ValueError, TypeError):
        return None


def last_generation(path: Path, pid: int) -> int:
    """The generation of ``pid``'s last answer in ``path``; 0 before its first."""
    answer = read_answer(path)
    return answer.generation if answer is not None and answer.pid == pid else 0


def wait_for_answer(
    path: Path, pid: int, *, after: int, file_version: str, timeout: float
) -> Answer | None:
    """The first answer of ``pid`` past generation ``after`` about the text of
    ``file_version`` (or about a file it could not read), within ``timeout`` seconds;
    None if none came or the listener stopped. An answer about another text is a
    reload that read the file before it was last written: the next one reads it."""
    deadline = time.monotonic() + timeout
    while True:
        answer = read_answer(path)
        if (
            answer is not None
            and answer.pid == pid
            and answer.generation > after
            and answer.file_version in (file_version, None)
        ):
            return answer
        if time.monotonic() >= deadline or not is_running(pid):
            return None
        time.sleep(0.02)
