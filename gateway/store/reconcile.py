"""Reconcile: check, and repair, that every key points at the newest run of its group.

A key group is one idempotency key: its pointer (``realm:{wf}:key:<k>``) and its
``keyruns`` set (``realm:{wf}:keyruns:<k>``, every run started under it). The walk
reads the workflow's key index (``realm:{wf}:keys``, written by the claim that
writes a pointer, trimmed by the sweep) in ZSCAN batches, so it reads that
workflow's keys and nothing else, and its memory stays flat however many runs there
are. Repairs are decided inside ``repoint.lua`` from the key's run set as Redis
holds it at that moment: a repair points a key only at the newest run of its key
that exists, so a start racing a repair keeps its pointer, and a pointer naming a
run that no longer exists (``dangling``) is moved to the newest one left, or
removed with its set when none is. Every call goes through the store's retry; a
resent repair reports what its first attempt did (its operation record).

Keys claimed by a gateway older than the key index are not in it. ``scan=True``
(``realm run reconcile --scan``) walks the whole keyspace instead, in SCAN batches
(never KEYS) on the server or on every primary of a cluster in turn, and, unless it
is a dry run, adds every key group it finds to the index: one such run after an
upgrade (once no older gateway is left) makes the index whole.

Each partition of a partitioned workflow has key groups, and a key index, of its own;
on a Redis Cluster each index is in its partition's slot, read on its primary alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, RedisCluster

from gateway.model.words import noun, plural
from gateway.store.keys import Keys
from gateway.store.runs import new_run_id, text_of
from gateway.store.runstore import RunStore

SCAN_COUNT = 1000
# Duplicate groups listed in a report; the count covers them all.
MAX_LISTED = 20
# Runs a repair first names to its script (the newest it read, newest first), the
# most it names after `need` replies, and its script calls: each bound is far above
# what a key sees, and a repair left over is counted `moved`, for the next walk.
FIRST_CANDIDATES = 8
MAX_CANDIDATES = 64
MAX_ROUNDS = 8
# Repairs in flight at once on a cluster, where redis-py cannot pipeline scripts.
CLUSTER_REPAIRS_AT_ONCE = 32


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
    dangling: int = 0  # pointers naming a run that no longer exists
    written: int = 0
    deleted: int = 0  # dangling pointers removed: no run of their key exists
    moved: int = 0
    duplicate_groups: int = 0
    duplicates: list[DuplicateGroup] = field(default_factory=list)
    pruned: int = 0
    runs: int = 0

    @property
    def to_write(self) -> int:
        return self.missing + self.stale + self.dangling

    def text(self) -> str:
        if self.dry_run:
            head = f"Would write {plural(self.to_write, 'pointer')}"
        else:
            head = f"Wrote {plural(self.written, 'pointer')}"
        lines = [
            f"{head} across {plural(self.groups, 'key group')}; {self.current} already current.",
        ]
        if self.missing or self.stale:
            lines.append(f"Missing pointers: {self.missing}; stale pointers: {self.stale}.")
        if self.dangling:
            lines.append(
                f"Dangling pointers (naming a run that no longer exists): {self.dangling}."
            )
        if self.deleted:
            lines.append(
                f"Deleted {plural(self.deleted, 'dangling pointer')}: "
                f"{noun(self.deleted, 'its key has', 'their keys have')} no run left."
            )
        if self.moved:
            lines.append(
                f"Left {plural(self.moved, 'pointer')} alone: a start moved "
                f"{noun(self.moved, 'it', 'them')} meanwhile."
            )
        lines.append(f"Duplicate-key groups: {self.duplicate_groups}")
        for d in self.duplicates:
            # The key names the group: the one to look up (`realm run list --key`).
            lines.append(
                f"  - workflow '{d.workflow}', key {_shown(d.key)} → canonical {d.canonical}; "
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
            "dangling": self.dangling,
            "written": self.written,
            "deleted": self.deleted,
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


def _shown(key: str) -> str:
    """A key as the report prints it: as it is when plain (printable, not starting with
    a quote), else as a JSON string literal, so that no key can break or forge a line."""
    if key.isprintable() and not key.startswith('"'):
        return key
    return json.dumps(key)


async def reconcile(
    store: RunStore,
    *,
    workflow: str | None = None,
    dry_run: bool = True,
    progress: Callable[[int, int], None] | None = None,
    scan: bool = False,
) -> ReconcileReport:
    """Walk every key group of one workflow (or all) and report; repair unless dry_run.

    ``progress`` is called after each batch with the key groups and the runs seen so far.
    ``scan``: find the groups by a SCAN of the whole keyspace, not the key index (for
    keys claimed before the index existed; see the module's docstring).
    """
    names = [workflow] if workflow else sorted(store.config.workflows)
    if workflow:
        store.config.workflow(workflow)
    report = ReconcileReport(dry_run=dry_run)
    nodes = await _nodes(store) if scan else []
    for name in names:
        for keys in store.partitions(name):
            batches = _scanned(store, keys, nodes) if scan else _indexed(store, keys)
            async for idem_keys in batches:
                # One deadline per batch: the walk may take minutes, a batch never should.
                async with store.deadline():
                    if idem_keys:
                        await _check_groups(store, keys, name, idem_keys, report, index=scan)
                    if progress:
                        progress(report.groups, report.runs)
    return report


async def _indexed(store: RunStore, keys: Keys) -> AsyncIterator[list[str]]:
    """The keys of one partition's index, a ZSCAN batch at a time. Like SCAN, ZSCAN
    returns every member present for the whole walk, whatever its score does (a claim
    only moves it): a key first claimed meanwhile may be missed (its claim has just
    written its pointer), and a member may come twice while the set grows, as with SCAN."""
    index = keys.key_index()
    cursor = 0
    while True:
        async with store.deadline():
            cursor, found = await store._retrying(
                lambda cursor=cursor: store.redis.zscan(index, cursor, count=SCAN_COUNT)
            )
        yield [text_of(member) for member, _ in found]
        if cursor == 0:
            return


async def _scanned(
    store: RunStore, keys: Keys, nodes: list[ClusterNode | None]
) -> AsyncIterator[list[str]]:
    """The keys of one partition whose run set exists, found by SCAN MATCH over the
    whole keyspace of the server (or of every primary)."""
    prefix = keys.key_runs("")
    for node in nodes:
        cursor = 0
        while True:
            async with store.deadline():
                cursor, found = await store._retrying(
                    lambda cursor=cursor, node=node: _scan(store, node, cursor, f"{prefix}*")
                )
            yield [g.decode()[len(prefix) :] for g in found]
            if cursor == 0:
                break


async def _nodes(store: RunStore) -> list[ClusterNode | None]:
    """What one scanning walk SCANs: the server (None), or every primary of a cluster."""
    redis = store.redis
    if not isinstance(redis, RedisCluster):
        return [None]
    async with store.deadline():
        await store._retrying(redis.initialize)
    return list(redis.get_primaries())


async def _scan(
    store: RunStore, node: ClusterNode | None, cursor: int, match: str
) -> tuple[int, list[bytes]]:
    if node is None:
        return await store.redis.scan(cursor, match=match, count=SCAN_COUNT)
    # A cluster answers {node name: cursor} and the keys.
    cursors, found = await store.redis.scan(
        cursor, match=match, count=SCAN_COUNT, target_nodes=node
    )
    return int(cursors[node.name]), found


async def count_runs(store: RunStore, workflow: str | None = None) -> int:
    """Runs in the indexes (expired ones included): the length of a progress bar."""
    names = [workflow] if workflow else sorted(store.config.workflows)
    async with store.deadline(), store.redis.pipeline(transaction=False) as pipe:
        for name in names:
            for keys in store.partitions(name):
                pipe.zcard(keys.runs())
        return sum(await pipe.execute())


@dataclass
class _Repair:
    key: str
    op: str  # the operation record of this repair (its resend reports the first reply)
    candidates: list[str]  # run ids whose hashes the script may check, newest first


async def _check_groups(
    store: RunStore,
    keys: Keys,
    workflow: str,
    idem_keys: list[str],
    report: ReconcileReport,
    *,
    index: bool = False,
) -> None:
    """Check (and unless a dry run, repair) these keys' groups. ``index``: the keys
    were found by a scan; a repairing walk adds them to the key index too."""
    groups = [keys.key_runs(k) for k in idem_keys]

    async def read(pipe: Pipeline) -> None:
        for group, key in zip(groups, idem_keys, strict=True):
            pipe.zrange(group, 0, -1, withscores=index)
            pipe.hget(keys.pointer(key), "run")

    got = await _pipelined(store, read)
    read_sets = got[0::2]
    if index:
        # The newest member's score is the time of the key's last claim: the score the
        # claim would have given it in the index.
        last_claims = [int(scored[-1][1]) if scored else 0 for scored in read_sets]
        read_sets = [[m for m, _ in scored] for scored in read_sets]
    members = [[text_of(m) for m in read_sets[i]] for i in range(len(groups))]
    pointers = [text_of(p) if p else "" for p in got[1::2]]

    # Which runs still exist: ended runs expire, their set entries do not. A pointer
    # that names a run outside its set is checked too (it may name nothing at all).
    checked = [[*runs, *([p] if p and p not in runs else [])] for runs, p in zip(
        members, pointers, strict=True)]  # fmt: skip

    async def exist(pipe: Pipeline) -> None:
        for ids in checked:
            for run_id in ids:
                pipe.exists(keys.run(run_id))

    answers = iter(await _pipelined(store, exist))
    existing = [{r for r in ids if next(answers)} for ids in checked]

    repairs: list[_Repair] = []
    prunes: list[tuple[str, list[str]]] = []
    for group, key, runs, found, pointer in zip(
        groups, idem_keys, members, existing, pointers, strict=True
    ):
        live_runs = [r for r in runs if r in found]  # "live" here: the hash exists
        gone = [r for r in runs if r not in found]
        if gone and not report.dry_run:
            prunes.append((group, gone))
            report.pruned += len(gone)
        if not live_runs and not pointer:
            continue  # every run of the key expired: the group is gone
        report.groups += 1
        report.runs += len(live_runs)
        newest = live_runs[-1] if live_runs else ""  # scores rise strictly with start order
        if pointer and pointer == newest:
            report.current += 1
        else:
            if not pointer:
                report.missing += 1
            elif pointer not in found:
                report.dangling += 1
            else:
                report.stale += 1
            # The script decides the target itself, from the set as it is then: it is
            # given the newest runs read (and the pointer's run) to check.
            candidates = live_runs[::-1][:FIRST_CANDIDATES]
            if pointer and pointer not in candidates:
                candidates.append(pointer)
            repairs.append(_Repair(key, keys.op(new_run_id()), candidates))
        if len(live_runs) > 1:
            report.duplicate_groups += 1
            if len(report.duplicates) < MAX_LISTED:
                report.duplicates.append(
                    DuplicateGroup(workflow, key, newest, tuple(reversed(live_runs[:-1])))
                )

    if report.dry_run:
        return
    indexed: dict[str, int] = {}
    if index:
        indexed = {k: t for k, t in zip(idem_keys, last_claims, strict=True) if t}
    if prunes or indexed:

        async def prune(pipe: Pipeline) -> None:
            for group, gone in prunes:
                pipe.zrem(group, *gone)
            if indexed:
                # NX: a claim since the read has given the key a later score.
                pipe.zadd(keys.key_index(), indexed, nx=True)

        await _pipelined(store, prune)
    await _repair(store, keys, repairs, report)


async def _repair(
    store: RunStore, keys: Keys, repairs: list[_Repair], report: ReconcileReport
) -> None:
    """Send the repairs, one pipeline a round, until each is decided (bounded by
    MAX_ROUNDS here and by the caller's deadline)."""
    pending = repairs
    for _ in range(MAX_ROUNDS):
        if not pending:
            return

        def script_keys(r: _Repair) -> list[str]:
            return [keys.pointer(r.key), keys.key_runs(r.key), r.op,
                    *(keys.run(c) for c in r.candidates)]  # fmt: skip

        async def send(pipe: Pipeline, batch: list[_Repair] = pending) -> None:
            for r in batch:
                await store.scripts.repoint(script_keys(r), r.candidates, client=pipe)

        if isinstance(store.redis, RedisCluster):
            # redis-py refuses scripts in a cluster pipeline: each its own call.
            calls = [
                lambda r=r: store.scripts.repoint(script_keys(r), r.candidates) for r in pending
            ]
            replies = await store._retrying(lambda calls=calls: _each(calls))
        else:
            replies = await _pipelined(store, send)
        again: list[_Repair] = []
        for r, reply in zip(pending, replies, strict=True):
            outcome = text_of(reply[0])
            if outcome == "written":
                report.written += 1
            elif outcome == "deleted":
                report.deleted += 1
            elif outcome == "current":
                report.moved += 1
            else:  # need: the set moved on since it was read; pass what it names
                more = [text_of(x) for x in reply[1:] if text_of(x) not in r.candidates]
                if not more or len(r.candidates) + len(more) > MAX_CANDIDATES:
                    report.moved += 1  # left for the next walk
                    continue
                r.candidates.extend(more)
                again.append(r)
        pending = again
    report.moved += len(pending)  # starts kept moving these keys: left for the next walk


async def _each(calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Run the calls, at most CLUSTER_REPAIRS_AT_ONCE at a time; their replies in
    order. The first failure cancels the rest (the caller's retry resends them all:
    each is safe to resend)."""
    gate = asyncio.Semaphore(CLUSTER_REPAIRS_AT_ONCE)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(call)) for call in calls]
    return [task.result() for task in tasks]


async def _pipelined(store: RunStore, fill: Callable[[Pipeline], Awaitable[None]]) -> list[Any]:
    """One pipeline of reads or repairs through the store's retry: a fresh pipeline
    per try (a failed one forgets its commands). Every command in it is safe to
    send twice: reads, removals of gone members, repairs with an operation record."""

    async def once() -> list[Any]:
        async with store.redis.pipeline(transaction=False) as pipe:
            await fill(pipe)
            return await pipe.execute()

    return await store._retrying(once)
