"""Run ids: random version-4 UUIDs, from a pool of random bytes that a fork does not share."""

from __future__ import annotations

import os
import uuid

from gateway.store.runs import new_run_id


def test_run_ids_are_distinct_version_4_uuids() -> None:
    ids = [new_run_id() for _ in range(10_000)]  # several refills of the pool
    assert len(set(ids)) == len(ids)
    for text in ids:
        parsed = uuid.UUID(text)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == text


def test_a_forked_child_does_not_repeat_its_parents_next_id() -> None:
    new_run_id()  # the pool now holds bytes the parent has not used yet
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id, then leave without cleanup
        os.write(write_end, new_run_id().encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    assert uuid.UUID(child_id).version == 4
    assert child_id != new_run_id()
