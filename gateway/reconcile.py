"""Reconcile: check, and repair, that every key points at the newest run of its group.

A key group is the ``keyruns`` set of one idempotency key. The walk goes
through the store in SCAN batches (never KEYS, never one command over the
whole store), so its memory stays flat however many runs there are. Repairs
are compare-and-set (``repoint.lua``): a start racing a repair keeps its pointer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.store import RunStore

SCAN_COUNT = 1000
# Duplicate groups listed in a report; the count covers them all.
MAX_LISTED = 20


@dataclass(frozen=True)
class DuplicateGroup:
    workflow: str
    key: str
    canonical: str
    others: tuple[str, ...]


@dataclass
class ReconcileReport:
    dry_run: bool
    groups: int = 0
    current: int = 0
    missing: int = 0
    stale: int = 0
    written: int = 0
    moved: int = 0
    duplicate_groups: int = 0
    duplicates: list[DuplicateGroup] = field(default_factory=list)
    pruned: int = 0
    runs: int = 0

    @property
    def to_write(self) -> int:
        return self.missing + self.stale

    def text(self) -> str:
        if self.dry_run:
            head = f"Would write {self.to_write} pointer(s)"
        else:
            head = f"Wrote {self.written} pointer(s)"
        lines = [
            f"{head} across {self.groups} key group(s); {self.current} already current.",
        ]
        if self.to_write:
            lines.append(f"Missing pointers: {self.missing}; stale pointers: {self.stale}.")
        if self.moved:
            lines.append(f"Left {self.moved} pointer(s) alone: a start moved them meanwhile.")
        lines.append(f"Duplicate-key groups: {self.duplicate_groups}")
        for d in self.duplicates:
            lines.append(
                f"  - workflow '{d.workflow}' → canonical {d.canonical}; "
                f"other runs: {', '.join(d.others)}"
            )
        if self.duplicate_groups > len(self.duplicates):
            lines.append(f"  … and {self.duplicate_groups - len(self.duplicates)} more")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "groups": self.groups,
            "already_current": self.current,
            "missing": self.missing,
            "stale": self.stale,
            "written": self.written,
            "moved": self.moved,
            "duplicate_groups": self.duplicate_groups,
            "duplicates": [
                {
                    "workflow": d.workflow,
                    "key": d.key,
                    "canonical": d.canonical,
                    "other_runs": list(d.others),
                }
                for d in self.duplicates
            ],
            "message": self.text(),
        }


async def reconcile(
    store: RunStore,
    *,
    workflow: str | None = None,
    dry_run: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> ReconcileReport:
    """Walk every key group of one workflow (or all) and report; repair unless dry_run.

    ``progress`` is called after each batch with the key groups and the runs seen so far.
    """
    names = [workflow] if workflow else sorted(store.config.workflows)
    if workflow:
        store.config.workflow(workflow)
    report = ReconcileReport(dry_run=dry_run)
    for name in names:
        keys = store.keys(name)
        prefix = keys.key_runs("")
        cursor = 0
        while True:
            # One deadline per batch: the walk may take minutes, a batch never should.
            async with store.deadline():
                cursor, found = await store.redis.scan(cursor, match=f"{prefix}*", count=SCAN_COUNT)
                if found:
                    groups = [g.decode() for g in found]
                    await _check_groups(store, name, groups, prefix, report)
                if progress:
                    progress(report.groups, report.runs)
            if cursor == 0:
                break
    return report


async def count_runs(store: RunStore, workflow: str | None = None) -> int:
    """Runs in the indexes (expired ones included): the length of a progress bar."""
    names = [workflow] if workflow else sorted(store.config.workflows)
    async with store.deadline(), store.redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zcard(store.keys(name).runs())
        return sum(await pipe.execute())


async def _check_groups(
    store: RunStore, workflow: str, groups: list[str], prefix: str, report: ReconcileReport
) -> None:
    redis = store.redis
    keys = store.keys(workflow)
    idem_keys = [g[len(prefix) :] for g in groups]
    async with redis.pipeline(transaction=False) as pipe:
        for group, key in zip(groups, idem_keys, strict=True):
            pipe.zrange(group, 0, -1)
            pipe.hget(keys.pointer(key), "run")
        read = await pipe.execute()
    members = [[m.decode() for m in read[2 * i]] for i in range(len(groups))]
    pointers = [p.decode() if p else "" for p in read[1::2]]

    # Which runs still exist: ended runs expire, their set entries do not.
    async with redis.pipeline(transaction=False) as pipe:
        for runs in members:
            for run_id in runs:
                pipe.exists(keys.run(run_id))
        exists = iter(await pipe.execute())
    alive = [[r for r in runs if next(exists)] for runs in members]

    repairs: list[tuple[str, str, str]] = []
    async with redis.pipeline(transaction=False) as prune:
        for group, key, runs, live_runs, pointer in zip(
            groups, idem_keys, members, alive, pointers, strict=True
        ):
            gone = [r for r in runs if r not in live_runs]
            if gone and not report.dry_run:
                prune.zrem(group, *gone)
                report.pruned += len(gone)
            if not live_runs:
                continue  # every run of the key expired: the group is gone
            report.groups += 1
            report.runs += len(live_runs)
            newest = live_runs[-1]  # scores rise strictly with start order
            if pointer == newest:
                report.current += 1
            else:
                if pointer:
                    report.stale += 1
                else:
                    report.missing += 1
                repairs.append((key, pointer, newest))
            if len(live_runs) > 1:
                report.duplicate_groups += 1
                if len(report.duplicates) < MAX_LISTED:
                    report.duplicates.append(
                        DuplicateGroup(workflow, key, newest, tuple(reversed(live_runs[:-1])))
                    )
        if not report.dry_run:
            await prune.execute()

    if report.dry_run or not repairs:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for key, held, newest in repairs:
            await store.scripts.repoint(
                [keys.pointer(key), keys.key_runs(key), keys.run(newest)],
                [held, newest],
                client=pipe,
            )
        replies = await pipe.execute()
    for reply in replies:
        outcome = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if outcome == "written":
            report.written += 1
        elif outcome == "moved":
            report.moved += 1
