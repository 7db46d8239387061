"""The spool's files: what an append keeps, what a reader gets back, a torn or damaged
record skipped (once, with a log line), the size bound across workers, adoption of a
dead process's folder by its lock, and the drain cursor across a crash.

No Redis here: the spool is local files. The request path's use of it (202 accepted,
the drain into Redis, kill -9 mid-drain) is in tests/test_spool_faults.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.loading import parse_config
from gateway.model.config import Spool as SpoolSettings
from gateway.model.errors import ConfigError
from gateway.spool import files
from gateway.spool.records import FRAME, SpooledDelivery, decode, encode
from gateway.spool.spool import Spool


def delivery(n: int, body: bytes = b"{}") -> SpooledDelivery:
    return SpooledDelivery(
        delivery_id=f"dlv-{n:012x}-00000000",
        received_ms=1_700_000_000_000 + n,
        path="/hooks/github",
        verified=("github-push",),
        headers=((b"x-github-delivery", f"d-{n}".encode()), (b"x-odd", b"\xff\x00 caf\xc3\xa9")),
        body=body,
    )


def drain_all(spool: Spool) -> list[SpooledDelivery]:
    out = []
    while (record := spool.next()) is not None:
        out.append(record.delivery)
        spool.done(record)
    return out


def test_a_record_comes_back_byte_for_byte() -> None:
    original = delivery(7, body=bytes(range(256)) * 3)
    frame = encode(original)
    assert decode(frame[FRAME.size :]) == original


async def test_appends_come_back_in_order_then_the_drained_segment_goes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 64 * 1024 * 1024)
    kept = await asyncio.gather(*(spool.append(delivery(n)) for n in range(50)))
    assert kept == [True] * 50
    assert spool.pending() == 50
    assert [d.received_ms for d in drain_all(spool)] == [delivery(n).received_ms for n in range(50)]
    assert spool.pending() == 0
    await spool.compact()
    assert [p.name for _, p in files.segments(spool.folder)] == ["00000002.seg"]
    assert (spool.folder / "00000002.seg").stat().st_size == 0
    # Appends go on in the new segment, and are read from there.
    assert await spool.append(delivery(99))
    assert [d.received_ms for d in drain_all(spool)] == [delivery(99).received_ms]
    spool.close()
    assert not spool.folder.exists()  # an empty folder is not left behind


async def test_one_batch_of_appends_is_one_fsync(tmp_path: Path, monkeypatch) -> None:
    spool = Spool(tmp_path, 64 * 1024 * 1024)
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    assert all(await asyncio.gather(*(spool.append(delivery(n)) for n in range(100))))
    # All 100 were queued in one loop turn: the first batch may hold one, the rest one more.
    assert 1 <= len(calls) <= 2
    spool.close()


def dead_folder(root: Path, count: int, body: bytes = b"{}") -> Path:
    """A spool folder left by a process that was killed, holding ``delivery(n, body)``
    for n below ``count``."""
    script = (
        "import asyncio, os, sys\n"
        "from gateway.spool.spool import Spool\n"
        "from tests.test_spool import delivery\n"
        "async def main():\n"
        f"    spool = Spool({str(root)!r}, 1 << 30)\n"
        f"    for n in range({count}):\n"
        f"        assert await spool.append(delivery(n, {body!r}))\n"
        "    print(spool.folder, flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=30)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    return Path(done.stdout.strip())


async def test_a_dead_process_folder_is_adopted_and_drained_then_removed(tmp_path: Path) -> None:
    left = dead_folder(tmp_path, 5)
    spool = Spool(tmp_path, 1 << 30)
    assert spool.adopt() == 1
    assert spool.pending() == 5
    assert [d.delivery_id for d in drain_all(spool)] == [delivery(n).delivery_id for n in range(5)]
    assert spool.next() is None
    assert not left.exists()
    spool.close()


async def test_a_live_worker_folder_is_never_adopted(tmp_path: Path) -> None:
    first = Spool(tmp_path, 1 << 30)
    assert await first.append(delivery(1))
    second = Spool(tmp_path, 1 << 30)
    assert second.adopt() == 0  # first still holds its lock
    assert second.next() is None
    assert [d.delivery_id for d in drain_all(first)] == [delivery(1).delivery_id]
    first.close()
    second.close()


async def test_the_drain_resumes_at_its_cursor_after_a_crash(tmp_path: Path) -> None:
    left = dead_folder(tmp_path, 6)
    first = Spool(tmp_path, 1 << 30)
    first.adopt()
    for _ in range(4):
        record = first.next()
        assert record is not None
        first.done(record)
    # The worker dies here: its adopted folder's lock goes with it.
    os.close(first._adopted[0].lock_fd)
    second = Spool(tmp_path, 1 << 30)
    assert second.adopt() == 1
    assert second.pending() == 2
    assert [d.delivery_id for d in drain_all(second)] == [delivery(n).delivery_id for n in (4, 5)]
    assert not left.exists()
    second.close()


async def test_a_torn_last_record_is_skipped_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    left = dead_folder(tmp_path, 3, b"x" * 500)
    segment = left / "00000001.seg"
    # Power lost in the middle of the last append.
    os.truncate(segment, segment.stat().st_size - 100)
    spool = Spool(tmp_path, 1 << 30)
    spool.adopt()
    with caplog.at_level(logging.WARNING, logger="realm"):
        got = drain_all(spool)
    assert [d.delivery_id for d in got] == [delivery(n).delivery_id for n in range(2)]
    skipped = [r.getMessage() for r in caplog.records if '"state":"skipped"' in r.getMessage()]
    assert len(skipped) == 1 and '"reason":"torn"' in skipped[0], skipped
    assert not left.exists()
    spool.close()


async def test_a_damaged_record_in_the_middle_is_skipped_and_the_rest_drains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    left = dead_folder(tmp_path, 3, b"y" * 300)
    segment = left / "00000001.seg"
    first_length = FRAME.unpack(segment.read_bytes()[: FRAME.size])[0]
    with segment.open("r+b") as f:  # flip a byte of the second record's body
        f.seek(FRAME.size + first_length + FRAME.size + 200)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    spool = Spool(tmp_path, 1 << 30)
    spool.adopt()
    with caplog.at_level(logging.WARNING, logger="realm"):
        got = drain_all(spool)
    assert [d.delivery_id for d in got] == [delivery(n).delivery_id for n in (0, 2)]
    assert sum('"reason":"checksum"' in r.getMessage() for r in caplog.records) == 1
    spool.close()


async def test_a_full_spool_refuses_and_its_files_never_pass_max_bytes(tmp_path: Path) -> None:
    limit = 1024 * 1024
    body = b"z" * 100_000
    workers = [Spool(tmp_path, limit) for _ in range(3)]  # three workers, one limit

    async def fill(spool: Spool) -> list[bool]:
        kept = []
        for n in range(10):
            kept.append(await spool.append(delivery(n, body)))
            assert files.disk_bytes(tmp_path) <= limit
        return kept

    results = await asyncio.gather(*(fill(s) for s in workers))
    accepted = sum(sum(r) for r in results)
    frame = len(encode(delivery(0, body)))
    assert accepted == limit // frame  # every record that fitted, and not one more
    assert files.disk_bytes(tmp_path) == accepted * frame
    # Draining makes room again.
    drain_all(workers[0])
    await workers[0].compact()
    assert await workers[0].append(delivery(42, body))
    for spool in workers:
        spool.close()


def test_appends_from_threads_of_two_processes_share_the_limit(tmp_path: Path) -> None:
    """Two processes appending at once: the lock on size.lock keeps them under the limit."""
    limit = 2 * 1024 * 1024
    script = (
        "import asyncio\n"
        "from gateway.spool.spool import Spool\n"
        "from tests.test_spool import delivery\n"
        "async def main():\n"
        f"    spool = Spool({str(tmp_path)!r}, {limit})\n"
        "    appends = (spool.append(delivery(n, b'q' * 50_000)) for n in range(40))\n"
        "    kept = await asyncio.gather(*appends)\n"
        "    print(sum(kept))\n"
        "asyncio.run(main())\n"
    )  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        for _ in range(2)
    ]
    kept = [int(p.communicate(timeout=60)[0]) for p in procs]
    frame = len(encode(delivery(0, b"q" * 50_000)))
    assert sum(kept) == limit // frame
    assert files.disk_bytes(tmp_path) <= limit


async def test_a_segment_being_opened_is_not_taken_for_a_drained_one(tmp_path: Path) -> None:
    """The writer rotates in its thread while the drain reads: no record is lost."""
    import gateway.spool.spool as spool_module

    spool = Spool(tmp_path, 1 << 30)
    original = spool_module.SEGMENT_BYTES
    spool_module.SEGMENT_BYTES = 4096  # a rotation every few records
    try:
        got: list[str] = []
        stop = threading.Event()

        async def write() -> None:
            for n in range(300):
                assert await spool.append(delivery(n, b"w" * 700))
            stop.set()

        async def drain() -> None:
            while not (stop.is_set() and spool.pending() == 0):
                record = spool.next()
                if record is None:
                    await asyncio.sleep(0)
                    continue
                got.append(record.delivery.delivery_id)
                spool.done(record)

        await asyncio.gather(write(), drain())
        assert got == [delivery(n).delivery_id for n in range(300)]
    finally:
        spool_module.SEGMENT_BYTES = original
        spool.close()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("{spool: 3}",
         "field 'spool': must be true, false or a mapping like {max_bytes: 1GiB} (got 3)"),
        ("{spool: {max_bytes: 10}}", "field 'spool.max_bytes': must be a size of at least 1MiB, "
         "in bytes or like 512MiB or 1GiB (got 10)"),
        ("{spool: {max_bytes: 2GB}}", "field 'spool.max_bytes': must be a size of at least 1MiB, "
         "in bytes or like 512MiB or 1GiB (got '2GB')"),
        ("{spool: {drain_rate: 0}}", "field 'spool.drain_rate': must be deliveries per second "
         "from 1 to 100000 (got 0)"),
        ("{spool: {dirs: /x}}", "field 'spool.dirs': unknown field (did you mean 'dir'?); "
         "allowed fields: dir, drain_rate, max_bytes"),
    ],
)  # fmt: skip
def test_a_bad_spool_setting_says_what_and_where(setting: str, message: str) -> None:
    text = f"version: 1\nworkflows: {{w: {{steps: [go]}}}}\nsettings: {setting}\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, file="triggers.yaml")
    assert str(caught.value) == f"triggers.yaml: settings: {message}"


def test_the_spool_is_on_by_default_and_can_be_sized_or_turned_off() -> None:
    def spool_of(settings: str) -> SpoolSettings | None:
        text = f"version: 1\nworkflows: {{w: {{steps: [go]}}}}\n{settings}"
        return parse_config(text, file="triggers.yaml").settings.spool

    default = spool_of("")
    assert default is not None and (default.dir, default.max_bytes, default.drain_rate) == (
        None, 1024**3, 200,
    )  # fmt: skip
    assert spool_of("settings: {spool: false}\n") is None
    sized = spool_of("settings: {spool: {dir: /var/spool/realm, max_bytes: 512MiB}}\n")
    assert sized is not None and (sized.dir, sized.max_bytes) == ("/var/spool/realm", 512 * 1024**2)


def test_a_spool_folder_that_cannot_be_written_stops_listen_with_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "triggers.yaml").write_text(
        "version: 1\nworkflows: {w: {steps: [go]}}\n"
        f"settings: {{spool: {{dir: {blocker}/spool}}}}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "listen", "--port", "0",
         "--redis-url", "redis://127.0.0.1:1/0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr == (
        f"error: triggers.yaml: settings: field 'spool.dir': cannot write the spool folder "
        f"{blocker}/spool (Not a directory): give the gateway a writable, persistent folder "
        "there (a volume), set settings.spool.dir to one, or turn the spool off with "
        "'spool: false'\n"
    )


async def test_a_failed_fsync_refuses_its_batch_and_later_records_still_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk that fails an fsync: that batch is answered "not kept" (503 for its
    senders), its bytes are cut off, and the next records go to a new segment, so
    nothing after them is read as a torn or foreign frame."""
    spool = Spool(tmp_path, 1 << 30)
    assert await spool.append(delivery(1))
    real = os.fsync
    failures = [OSError(5, "Input/output error")]

    def flaky(fd: int) -> None:
        if failures:
            raise failures.pop()
        real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    with caplog.at_level(logging.ERROR, logger="realm"):
        assert await spool.append(delivery(2)) is False
    assert any('"state":"write_failed"' in r.getMessage() for r in caplog.records)
    assert await spool.append(delivery(3))
    with caplog.at_level(logging.WARNING, logger="realm"):
        got = [d.delivery_id for d in drain_all(spool)]
    assert got == [delivery(1).delivery_id, delivery(3).delivery_id]
    assert not any('"state":"skipped"' in r.getMessage() for r in caplog.records)
    spool.close()


async def test_the_gauges_say_what_the_spool_holds_and_fall_to_zero_once_drained(
    tmp_path: Path,
) -> None:
    from prometheus_client import REGISTRY

    def gauge(name: str) -> float | None:
        return REGISTRY.get_sample_value(name)

    spool = Spool(tmp_path, 1 << 30)
    records = [delivery(n, b"g" * 400) for n in range(3)]  # received long ago (2023)
    for record in records:
        assert await spool.append(record)
    before = time.time()
    spool.update_gauges()
    after = time.time()
    assert gauge("realm_spool_records") == 3
    assert gauge("realm_spool_bytes") == sum(len(encode(r)) for r in records)
    oldest = records[0].received_ms / 1000
    assert before - oldest <= gauge("realm_spool_oldest_age_seconds") <= after - oldest
    drain_all(spool)
    await spool.compact()
    spool.update_gauges()
    assert [gauge(f"realm_spool_{n}") for n in ("records", "bytes", "oldest_age_seconds")] == [
        0, 0, 0,
    ]  # fmt: skip
    spool.close()
