"""One worker's spool: appends with group commit, bounded by ``max_bytes`` over every
worker's files, and the records to drain, oldest first (the folders of processes
that are gone, then its own).

An append is answered once its frame is on disk and fsynced. Appends made while one
batch is being written wait for the next: one ``write`` and one ``fsync`` per batch,
in a thread, so the event loop keeps serving meanwhile. The spool's size is the size
of every worker's segments, measured under one lock that every appender takes, so
the files together never pass ``max_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from gateway.spool import files
from gateway.spool.records import BadRecord, SpooledDelivery, decode, encode

log = logging.getLogger("realm")

# A drained segment is deleted whole: smaller segments give disk back sooner and bound
# what a crash re-reads; larger ones mean fewer files to measure per append.
SEGMENT_BYTES = 8 * 1024 * 1024

SPOOL_BYTES = Gauge("realm_spool_bytes", "Bytes of spooled deliveries on disk",
                    multiprocess_mode="livesum")  # fmt: skip
SPOOL_RECORDS = Gauge("realm_spool_records", "Spooled deliveries not yet drained",
                      multiprocess_mode="livesum")  # fmt: skip
SPOOL_OLDEST = Gauge(
    "realm_spool_oldest_age_seconds",
    "Age of the oldest spooled delivery not yet drained (0: none)",
    multiprocess_mode="livemax",
)
SPOOLED = Counter("realm_spool_appended_total", "Deliveries spooled (answered 202 accepted)")
DRAINED = Counter("realm_spool_drained_total", "Spooled deliveries whose claims are now stored")
DROPPED = Counter(
    "realm_spool_dropped_total",
    "Spooled records given up: torn or unreadable, or whose path has no trigger any more",
    ["reason"],
)
# Each reason's series exists from the start: a dashboard sees 0, not "no data".
DROP_REASONS = ("torn", "checksum", "unreadable", "no_trigger", "error")
for _reason in DROP_REASONS:
    DROPPED.labels(_reason)
FULL = Counter("realm_spool_full_total", "Deliveries answered 503 because the spool was full")


@dataclass
class Source:
    """One folder being drained: this worker's own, or one adopted from a process that
    is gone (``lock_fd`` held while it drains)."""

    folder: Path
    lock_fd: int
    cursor: files.Cursor
    own: bool
    records: int = 0  # not yet drained
    bytes: int = 0  # of its segments on disk
    _fds: dict[int, int] = field(default_factory=dict)

    def fd(self, number: int, path: Path) -> int:
        if number not in self._fds:
            self._fds[number] = os.open(path, os.O_RDONLY)
        return self._fds[number]

    def forget(self, number: int) -> None:
        fd = self._fds.pop(number, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for number in list(self._fds):
            self.forget(number)
        self.cursor.close()


@dataclass(frozen=True)
class Spooled:
    """A record to drain, and where it is."""

    delivery: SpooledDelivery
    source: Source
    number: int
    end: int


class Spool:
    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.folder, lock_fd = files.new_owner_folder(self.root)
        self._own = Source(self.folder, lock_fd, files.Cursor(self.folder, 1, 0), own=True)
        self._adopted: list[Source] = []
        # The segment appended to, and how much of it is written and fsynced: the
        # drain reads no further, so it never meets a frame being written.
        self._number = 1
        self._fd = os.open(self.folder / files.segment_name(1),
                           os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # fmt: skip
        self._size = 0
        # The writer's thread and the drain (on the loop) both read and change the
        # segment appended to, its size and the counts: each does so under this lock.
        self._state = threading.Lock()
        self._pending: list[tuple[bytes, asyncio.Future[bool]]] = []
        self._writing: asyncio.Task[None] | None = None
        self._turn = asyncio.Lock()  # one batch or one rotation at a time
        self.appended = asyncio.Event()  # set at each append: the drain wakes
        self._warned_full = False

    # -- appending ----------------------------------------------------------------

    async def append(self, delivery: SpooledDelivery) -> bool:
        """Keep ``delivery``: True once it is on disk and fsynced, False when it does
        not fit under ``max_bytes`` or the disk refused it."""
        frame = encode(delivery)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((frame, future))
        if self._writing is None:
            self._writing = asyncio.create_task(self._write_batches())
        kept = await future
        if kept:
            SPOOLED.inc()
            # At once, not at the drain's next look: a gauge of 0 then always means
            # that what was kept has been drained.
            SPOOL_RECORDS.set(self.pending())
            self.appended.set()
        else:
            FULL.inc()
        return kept

    async def _write_batches(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                async with self._turn:
                    try:
                        kept = await asyncio.to_thread(self._write, [f for f, _ in batch])
                    except Exception as exc:
                        log.error('{"event":"spool","level":"error","state":"write_failed",'
                                  '"error":"%s"}', type(exc).__name__)  # fmt: skip
                        kept = [False] * len(batch)
                for (_, future), ok in zip(batch, kept, strict=True):
                    if not future.done():
                        future.set_result(ok)
        finally:
            self._writing = None

    def _write(self, frames: list[bytes]) -> list[bool]:
        """In a thread: append what fits under ``max_bytes``, then one fsync."""
        kept: list[bool] = []
        with files.locked(self.root / files.SIZE_LOCK):
            room = self.max_bytes - files.disk_bytes(self.root)
            accepted = []
            for frame in frames:
                fits = len(frame) <= room
                kept.append(fits)
                if fits:
                    accepted.append(frame)
                    room -= len(frame)
            if not accepted:
                self._full()
                return kept
            if self._size >= SEGMENT_BYTES:
                self._rotate()
            data = b"".join(accepted)
            try:
                written = 0
                while written < len(data):
                    written += os.write(self._fd, data[written:])
            except OSError:
                self._abandon()
                raise
        # Outside the size lock: another worker's appends need not wait for our disk.
        try:
            os.fsync(self._fd)
        except OSError:
            self._abandon()
            raise
        with self._state:
            self._size += len(data)
            self._own.records += len(accepted)
            self._own.bytes += len(data)
        if len(accepted) == len(frames):
            self._warned_full = False
        else:
            self._full()
        return kept

    def _abandon(self) -> None:
        """After a failed write or fsync: part of the batch may be on disk, and after a
        failed fsync nothing is known of it. Cut it off, and go on in a new segment,
        so that no frame is ever written after bytes the drain could not read."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)
        self._rotate()

    def _full(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            log.error('{"event":"spool","level":"error","state":"full","max_bytes":%d,'
                      '"message":"the spool is full: deliveries Redis cannot take get 503"}',
                      self.max_bytes)  # fmt: skip

    def _rotate(self) -> None:
        """Append to a new segment from now on (the old one is drained, then deleted)."""
        fd = os.open(self.folder / files.segment_name(self._number + 1),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # fmt: skip
        with self._state:
            old, self._fd = self._fd, fd
            self._number += 1
            self._size = 0
        os.close(old)

    def has_room(self) -> bool:
        """Whether one more delivery of a typical size (64 KiB) would fit now."""
        return files.disk_bytes(self.root) + 64 * 1024 <= self.max_bytes

    # -- draining -----------------------------------------------------------------

    def adopt(self) -> int:
        """Take the folders of processes that are gone; how many were found."""
        known = {self.folder, *(s.folder for s in self._adopted)}
        found = 0
        for folder, lock_fd in files.orphans(self.root, known):
            number, offset = files.read_cursor(folder)
            source = Source(folder, lock_fd, files.Cursor(folder, number, offset), own=False)
            source.records, source.bytes = _count(source)
            self._adopted.append(source)
            found += 1
            log.info('{"event":"spool","level":"info","state":"adopted","folder":"%s",'
                     '"records":%d,"bytes":%d}',
                     folder.name, source.records, source.bytes)  # fmt: skip
        return found

    def pending(self) -> int:
        """Records not yet drained, in this worker's folder and those it adopted."""
        return self._own.records + sum(s.records for s in self._adopted)

    def next(self) -> Spooled | None:
        """The oldest record not yet drained (adopted folders first), None when none.
        Records that cannot be read are dropped on the way, each with a log line."""
        while True:
            for source in [*self._adopted, self._own]:
                found = self._next_in(source)
                if found is not None:
                    return found
                if not source.own:
                    self._finish(source)
                    break  # the list changed: look again
            else:
                return None

    def _next_in(self, source: Source) -> Spooled | None:
        with self._state:
            writing, written = self._number, self._size
        for number, path in files.segments(source.folder):
            cursor = source.cursor
            if number < cursor.number:
                self._delete(source, number, path)  # drained before a crash
                continue
            if source.own and number > writing:
                return None  # a segment the writer is opening right now
            offset = cursor.offset if number == cursor.number else 0
            active = source.own and number == writing
            # The writer's segment only as far as written and fsynced: never a frame
            # being written. Any other is whole (or was cut by a crash).
            limit = written if active else path.stat().st_size
            fd = source.fd(number, path)
            while True:
                try:
                    frame = files.read_frame(fd, offset, limit)
                except files.Torn as torn:
                    _dropped("torn", source, number, torn.offset)
                    self._counted(source, -1)
                    frame = None
                if frame is None:
                    break
                if frame.payload is None:
                    _dropped("checksum", source, number, frame.offset)
                    self._counted(source, -1)
                    offset = frame.end
                    cursor.save(number, offset)
                    continue
                try:
                    delivery = decode(frame.payload)
                except BadRecord:
                    _dropped("unreadable", source, number, frame.offset)
                    self._counted(source, -1)
                    offset = frame.end
                    cursor.save(number, offset)
                    continue
                return Spooled(delivery, source, number, frame.end)
            if active:
                return None  # caught up with the writer
            self._delete(source, number, path)
            cursor.save(number + 1, 0)
        return None

    def done(self, record: Spooled) -> None:
        """``record``'s claims are stored: the drain moves past it."""
        record.source.cursor.save(record.number, record.end)
        self._counted(record.source, -1)
        DRAINED.inc()

    def drop(self, record: Spooled, reason: str) -> None:
        """Give ``record`` up (its path has no trigger now, say), counted."""
        record.source.cursor.save(record.number, record.end)
        self._counted(record.source, -1)
        DROPPED.labels(reason).inc()

    def _counted(self, source: Source, records: int) -> None:
        with self._state:
            source.records = max(source.records + records, 0)

    async def compact(self) -> None:
        """When the drain has caught up with the writer, start a new segment so that
        the drained one can go (a segment is deleted whole)."""
        own = self._own
        if own.cursor.number != self._number or own.cursor.offset < self._size or not self._size:
            return
        async with self._turn:
            if own.cursor.number == self._number and own.cursor.offset >= self._size:
                old = self._number
                self._rotate()
                self._delete(own, old, self.folder / files.segment_name(old))
                own.cursor.save(self._number, 0)

    def _delete(self, source: Source, number: int, path: Path) -> None:
        source.forget(number)
        with contextlib.suppress(FileNotFoundError):
            size = path.stat().st_size
            path.unlink()
            with self._state:
                source.bytes = max(source.bytes - size, 0)

    def _finish(self, source: Source) -> None:
        self._adopted.remove(source)
        source.close()
        files.remove_folder(source.folder, source.lock_fd)
        log.info('{"event":"spool","level":"info","state":"drained","folder":"%s"}',
                 source.folder.name)  # fmt: skip

    def oldest_ms(self) -> int | None:
        """The arrival time of the oldest record not yet drained (None: none)."""
        if not self.pending():
            return None
        # next() does not move the drain: it gives the same record until done/drop.
        record = self.next()
        return record.delivery.received_ms if record else None

    def update_gauges(self) -> None:
        oldest = self.oldest_ms()
        SPOOL_RECORDS.set(self.pending())
        SPOOL_BYTES.set(self._own.bytes + sum(s.bytes for s in self._adopted))
        SPOOL_OLDEST.set(0 if oldest is None else max(time.time() - oldest / 1000, 0.0))

    def close(self) -> None:
        """At shutdown: this worker's folder stays for whoever starts next; an empty one
        is deleted."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        for source in self._adopted:
            source.close()
            os.close(source.lock_fd)
        self._adopted.clear()
        self._own.close()
        if self.pending() == 0:
            files.remove_folder(self.folder, self._own.lock_fd)
        else:
            os.close(self._own.lock_fd)


def _count(source: Source) -> tuple[int, int]:
    """Records (from the cursor on) and bytes in an adopted folder, by their headers."""
    records = size = 0
    for number, path in files.segments(source.folder):
        size += path.stat().st_size
        if number < source.cursor.number:
            continue
        offset = source.cursor.offset if number == source.cursor.number else 0
        fd = source.fd(number, path)
        limit = path.stat().st_size
        for _ in _frames(fd, offset, limit):
            records += 1
    return records, size


def _frames(fd: int, offset: int, limit: int) -> Iterator[files.Frame]:
    while True:
        try:
            frame = files.read_frame(fd, offset, limit)
        except files.Torn:
            yield files.Frame(offset, limit, None)  # counted: dropped when reached
            return
        if frame is None:
            return
        yield frame
        offset = frame.end


def _dropped(reason: str, source: Source, number: int, offset: int) -> None:
    DROPPED.labels(reason).inc()
    log.warning('{"event":"spool","level":"warning","state":"skipped","reason":"%s",'
                '"folder":"%s","segment":%d,"offset":%d}',
                reason, source.folder.name, number, offset)  # fmt: skip
