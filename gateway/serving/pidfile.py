"""The listener's pid file: how ``realm triggers reload`` finds a running ``realm listen``.

``realm listen`` writes its process id (one line, as systemd's ``PIDFile=`` reads
it) to ``--pid-file``, by default ``<data-dir>/listen.pid``, and removes the file
when it stops. Listeners sharing a data folder share the default file: the last one
started owns it, and one that stops removes it only while it is still its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("realm")

PID_FILE_NAME = "listen.pid"


class PidFileError(Exception):
    """The ``--pid-file`` given cannot be written."""


class NoListener(Exception):
    """There is no running ``realm listen`` to signal; the message says why."""


def pid_file_path(pid_file: str | None, data_dir: str) -> Path:
    return Path(pid_file) if pid_file else Path(data_dir) / PID_FILE_NAME


@contextlib.contextmanager
def pid_file_kept(pid_file: str | None, data_dir: str) -> Iterator[Path | None]:
    """This process's id in the pid file while the block runs. A pid file that was
    asked for and cannot be written raises PidFileError; the default one, one line
    (the listener serves anyway, and SIGHUP still reloads it)."""
    path = pid_file_path(pid_file, data_dir)
    pid = os.getpid()
    if not _write(path, pid, required=pid_file is not None):
        yield None
        return
    try:
        yield path
    finally:
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text(encoding="ascii")) == pid:  # still ours
                path.unlink()


def _write(path: Path, pid: int, *, required: bool) -> bool:
    # Whole or absent: a reader never sees half a number.
    partial = path.with_name(f".{path.name}.{pid}")
    try:
        if not required:  # the data folder may not exist yet; a --pid-file's folder must
            path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(f"{pid}\n", encoding="ascii")
        os.replace(partial, path)
        return True
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        with contextlib.suppress(OSError):
            partial.unlink()
        if required:
            raise PidFileError(f"--pid-file {path}: cannot write it ({reason})") from None
    log.warning(
        "no pid file at %s (%s): `realm triggers reload` cannot find this listener; "
        "send SIGHUP to process %d to reload its config", path, reason, pid,
    )  # fmt: skip
    return False


def signal_listener(path: Path, signum: int = signal.SIGHUP) -> int:
    """Send ``signum`` to the ``realm listen`` named by the pid file; its pid. Raises
    NoListener when there is none: no file, a stale one, or a process that is not
    ``realm listen`` (never signalled)."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise NoListener(
            f"no pid file at {path}: is `realm listen` running? It writes one at "
            "<data-dir>/listen.pid, or at its --pid-file: pass the same --data-dir or --pid-file"
        ) from None
    except OSError as exc:
        raise NoListener(f"cannot read {path}: {exc.strerror}") from None
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 2**31):
        raise NoListener(f"{path} does not hold a process id")
    pid = int(text)
    if not _alive(pid):
        raise NoListener(
            f"{path} names process {pid}, which is not running (a listener that stopped "
            "without removing it); start `realm listen`"
        )
    if not _is_listener(pid):
        raise NoListener(
            f"{path} names process {pid}, which is not `realm listen` (the file is stale "
            "and the id now belongs to another program); it was not signalled"
        )
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        raise NoListener(f"process {pid} stopped before it could be signalled") from None
    except PermissionError:
        raise NoListener(
            f"not allowed to signal process {pid} (another user's): run this as the listener's user"
        ) from None
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: _is_listener and kill say more
    return True


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
