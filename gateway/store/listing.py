"""Listing runs a page at a time: ``list_runs`` of one workflow and ``list_runs_of``
several, newest first, optionally of one key and one phase; and the positions that
page them (a cursor is ``<score>.<run id>``: the last run a page showed).

Apart from the rest because a listing is the store's one read that merges many
indexes (every partition of every workflow asked for): ``_RunPager`` merges them
read in bounded chunks, so a page's work is bounded whatever the indexes hold. Finding
one run by id is the base's (gateway/store/base.py): every operation on a run needs it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any

from gateway.model.errors import RealmError
from gateway.store.base import StoreBase
from gateway.store.keys import Keys
from gateway.store.runs import PHASES, Run, run_from_hash, text_of


class RunListing(StoreBase):
    """Runs of one or more workflows, listed newest first, a page at a time."""

    async def list_runs(
        self,
        workflow: str,
        key: str | None = None,
        phase: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Run], str | None]:
        """Runs of a workflow, newest first, optionally of one key and one phase.

        Returns the page and the cursor for the next one (None when done). The cursor
        names a position, the last run shown (its index score and id): runs started
        while a caller pages come before it and never shift a later page, so every
        run is seen once. Runs that expired are skipped; the sweep drops them from
        the indexes."""
        return await self.list_runs_of([workflow], key, phase, limit, cursor)

    async def list_runs_of(
        self,
        workflows: Sequence[str],
        key: str | None = None,
        phase: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Run], str | None]:
        """``list_runs`` over several workflows at once, merged newest first: every
        index is scored by start time (µs, the server's clock), so one position is a
        position in all of them."""
        for workflow in workflows:
            self.config.workflow(workflow)
        if phase is not None and phase not in PHASES:
            raise RealmError("VALIDATION_PARAMS", f"phase must be one of {', '.join(PHASES)}")
        if not 1 <= limit <= 1000:
            raise RealmError("VALIDATION_PARAMS", "limit must be between 1 and 1000")
        after = parse_position(cursor)
        sources = [
            (keys, keys.runs() if key is None else keys.key_runs(key))
            for workflow in workflows
            for keys in (
                self.partitions(workflow) if key is None else [self.keys_for_key(workflow, key)]
            )
        ]
        async with self.deadline():
            return await _RunPager(self, sources, phase, limit, after).page()


Position = tuple[int, str]  # a run's index score and its id: a place in newest-first order


def parse_position(cursor: str | None) -> Position | None:
    """A cursor as a page returned it (``<score>.<run id>``), or None: from the newest."""
    if cursor is None:
        return None
    score, dot, run_id = cursor.partition(".")
    if not (dot and score.isascii() and score.isdigit() and len(score) <= 18):
        raise RealmError("VALIDATION_PARAMS", _bad_cursor(cursor))
    try:
        uuid.UUID(run_id)
    except ValueError:
        raise RealmError("VALIDATION_PARAMS", _bad_cursor(cursor)) from None
    return int(score), run_id


def format_position(position: Position) -> str:
    return f"{position[0]}.{position[1]}"


def _bad_cursor(cursor: str) -> str:
    return f"cursor {cursor[:60]!r} is not one this API returned"


class _RunPager:
    """One page of runs from several indexes (partitions, workflows), merged newest
    first by (score, id), read in bounded chunks.

    Each index is read from the position on (``ZRANGE … BYSCORE REV``, the bound
    inclusive, then the entries at or above the position dropped: scores are unique
    within an index, but two indexes may share one). The merge takes the newest head
    while every index that may have more has a head, so what is examined is exactly
    the merged order; the cursor is the last run examined. Under a phase filter a
    call examines at most 20 pages' worth and may return a short page with a cursor."""

    CHUNK = 200

    def __init__(
        self,
        store: StoreBase,
        sources: list[tuple[Keys, str]],
        phase: str | None,
        limit: int,
        after: Position | None,
    ) -> None:
        self.store = store
        self.sources = sources
        self.phase = phase
        self.limit = limit
        self.chunk = min(self.CHUNK, limit + 1) if phase is None else self.CHUNK
        # Per source: buffered (score, id) heads, newest first; where its reads go on
        # from; whether it is read to the end.
        self.heads: list[list[Position]] = [[] for _ in sources]
        self.read_from: list[Position | None] = [after] * len(sources)
        self.done = [False] * len(sources)

    async def _refill(self) -> None:
        wanted = [i for i, heads in enumerate(self.heads) if not heads and not self.done[i]]
        if not wanted:
            return
        redis = self.store.redis

        def read(i: int) -> Awaitable[Any]:
            position = self.read_from[i]
            top: float | str = "+inf" if position is None else position[0]
            return redis.zrange(
                self.sources[i][1], top, "-inf", desc=True, byscore=True, offset=0,
                num=self.chunk + 1, withscores=True,
            )  # fmt: skip

        replies = await self.store._retrying(lambda: asyncio.gather(*(read(i) for i in wanted)))
        for i, reply in zip(wanted, replies, strict=True):
            position = self.read_from[i]
            heads = [(int(score), text_of(member)) for member, score in reply]
            if position is not None:
                heads = [
                    h
                    for h in heads
                    if h[0] < position[0] or (h[0] == position[0] and h[1] < position[1])
                ]
            # chunk + 1 asked: the one at the position itself may have been dropped.
            self.done[i] = len(reply) <= self.chunk
            heads = heads[: self.chunk]
            self.heads[i] = heads
            if heads:
                self.read_from[i] = heads[-1]

    def _take(self) -> tuple[int, Position] | None:
        """The newest head, if every source that may have more has one buffered."""
        best = None
        for i, heads in enumerate(self.heads):
            if not heads:
                if not self.done[i]:
                    return None  # a refill first: it may hold something newer
                continue
            if best is None or heads[0] > self.heads[best][0]:
                best = i
        if best is None:
            return None
        return best, self.heads[best].pop(0)

    def _exhausted(self) -> bool:
        return all(d and not h for d, h in zip(self.done, self.heads, strict=True))

    async def page(self) -> tuple[list[Run], str | None]:
        runs: list[Run] = []
        last: Position | None = None
        budget = 20 * self.limit + 1000
        examined = 0
        unexamined = False  # taken from the heads but not looked at: more remain
        while len(runs) < self.limit and examined < budget:
            await self._refill()
            if self._exhausted():
                return runs, None
            batch: list[tuple[int, Position]] = []
            want = self.limit - len(runs) if self.phase is None else self.CHUNK
            while len(batch) < want and (taken := self._take()) is not None:
                batch.append(taken)
            names = [self.sources[i][0].run(run_id) for i, (_, run_id) in batch]
            records = await self.store._retrying(lambda n=names: self.store._hgetall_many(n))
            for (_, position), record in zip(batch, records, strict=True):
                if len(runs) == self.limit or examined >= budget:
                    unexamined = True
                    break
                examined += 1
                last = position
                if record and (self.phase is None or text_of(record[b"phase"]) == self.phase):
                    runs.append(run_from_hash(record))
        if not unexamined:
            # No false promise of more: look whether anything is left to read.
            await self._refill()
            if self._exhausted():
                return runs, None
        return runs, None if last is None else format_position(last)
