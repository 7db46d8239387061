"""A spool's files: one folder per worker process, holding numbered segments and the
lock that says the folder's owner is alive.

    <spool dir>/
      size.lock                  taken while a worker measures and appends (max_bytes)
      w-<pid>-<random>/          one per worker process
        lock                     held (flock) for the owner's life; the kernel lets go at its death
        00000001.seg ...         appended to in order; a drained segment is deleted
        cursor                   "<segment> <offset>": how far the drain got

A worker that finds a folder whose lock it can take owns it from then on: its
process is gone, and the folder's records are drained as the finder's own. The
cursor is written after each drained record without an fsync: a killed process
loses nothing of it, and a machine that loses power re-drains a few records, which
their event ids deduplicate.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.spool.records import FRAME, MAX_PAYLOAD, check

SEGMENT_SUFFIX = ".seg"
LOCK = "lock"
CURSOR = "cursor"
SIZE_LOCK = "size.lock"


def segment_name(number: int) -> str:
    return f"{number:08d}{SEGMENT_SUFFIX}"


def segments(folder: Path) -> list[tuple[int, Path]]:
    """The folder's segments, oldest first."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            stem = entry.name.removesuffix(SEGMENT_SUFFIX)
            if entry.name.endswith(SEGMENT_SUFFIX) and stem.isdigit():
                found.append((int(stem), Path(entry.path)))
    return sorted(found)


def disk_bytes(root: Path) -> int:
    """The bytes of every segment under ``root``: what ``max_bytes`` bounds."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for folder in os.scandir(root):
            if not folder.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(folder.path):
                    if entry.name.endswith(SEGMENT_SUFFIX):
                        with contextlib.suppress(FileNotFoundError):
                            total += entry.stat(follow_symlinks=False).st_size
    return total


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (created if need be) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing lets go of the lock


def try_lock(path: Path) -> int | None:
    """The fd of ``path`` locked exclusively, or None when a live process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:
        return None  # its folder went away: another worker drained it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def new_owner_folder(root: Path) -> tuple[Path, int]:
    """A new folder for this process and the fd of its held lock."""
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"w-{os.getpid()}-{secrets.token_hex(3)}"
    folder.mkdir(mode=0o700)
    fd = try_lock(folder / LOCK)
    assert fd is not None  # a new folder: nobody else knows it
    return folder, fd


def orphans(root: Path, own: set[Path]) -> Iterator[tuple[Path, int]]:
    """Folders under ``root`` whose owner is gone, each with its lock, now ours."""
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            folder = Path(entry.path)
            if not entry.is_dir(follow_symlinks=False) or folder in own:
                continue
            fd = try_lock(folder / LOCK)
            if fd is not None:
                yield folder, fd


def remove_folder(folder: Path, lock_fd: int) -> None:
    """Delete a drained folder, its lock last (held until then)."""
    for name in os.listdir(folder):
        if name != LOCK:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / LOCK)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
    os.close(lock_fd)


def read_cursor(folder: Path) -> tuple[int, int]:
    try:
        number, offset = (folder / CURSOR).read_text().split()
        return int(number), int(offset)
    except (OSError, ValueError):
        return 0, 0


@dataclass
class Cursor:
    """How far the drain got in one folder, kept in its ``cursor`` file."""

    folder: Path
    number: int = 0
    offset: int = 0
    _fd: int | None = field(default=None, repr=False)

    def save(self, number: int, offset: int) -> None:
        self.number, self.offset = number, offset
        if self._fd is None:
            self._fd = os.open(self.folder / CURSOR, os.O_RDWR | os.O_CREAT, 0o600)
        text = f"{number} {offset}".encode().ljust(32)
        os.pwrite(self._fd, text, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class Frame:
    """One record read from a segment: where it starts and ends, and its payload
    (None: a record that does not check, skipped)."""

    offset: int
    end: int
    payload: bytes | None


class Torn(Exception):
    """A segment ends in a record cut short, or a length that cannot be one: nothing
    after ``offset`` can be read."""

    def __init__(self, offset: int) -> None:
        super().__init__(offset)
        self.offset = offset


def read_frame(fd: int, offset: int, limit: int) -> Frame | None:
    """The frame at ``offset`` of a segment readable up to ``limit`` bytes, None at its
    end. Raises Torn where the rest cannot be read as frames."""
    if offset >= limit:
        return None
    header = os.pread(fd, FRAME.size, offset)
    if len(header) < FRAME.size or offset + FRAME.size > limit:
        raise Torn(offset)
    length, _ = FRAME.unpack(header)
    end = offset + FRAME.size + length
    if length > MAX_PAYLOAD or end > limit:
        raise Torn(offset)
    payload = os.pread(fd, length, offset + FRAME.size)
    if not check(header, payload):
        # Its length is plausible and the next frame may be whole: skip this one.
        return Frame(offset, end, None)
    return Frame(offset, end, payload)
