"""The paging inputs of ``list_runs`` (HTTP query, MCP arguments, CLI flags), checked
before they reach the store: a bad one is ``VALIDATION_PARAMS`` with a clear message.

Only ASCII digits count: ``str.isdigit()`` is also true for '²' or '٣', which
``int()`` then refuses or reads as another number. The cursor is an offset into a
sorted set, bounded well inside Redis's signed 64-bit range (2^63 was a 500).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from gateway.errors import RealmError
from gateway.runs import Run
from gateway.store import RunStore

MAX_LIMIT = 1000
MAX_CURSOR_DIGITS = 18  # below 10^18: the offset plus a page stays inside int64


def _shown(text: str) -> str:
    """The caller's value as a message may quote it: escaped and short."""
    return repr(text if len(text) <= 24 else text[:24] + "…")


def _is_ascii_number(text: str, max_digits: int) -> bool:
    return 0 < len(text) <= max_digits and text.isascii() and text.isdigit()


def parse_limit(text: str) -> int:
    """A page size given as text: a whole number from 1 to 1000."""
    if not _is_ascii_number(text, 4) or not 1 <= int(text) <= MAX_LIMIT:
        raise RealmError(
            "VALIDATION_PARAMS",
            f"limit must be a whole number from 1 to {MAX_LIMIT} (got {_shown(text)})",
        )
    return int(text)


def check_cursor(text: str | None) -> str | None:
    """A cursor as a previous page returned it (a decimal offset; for a partitioned
    workflow one per partition, '.'-separated, '-' for a finished one), or None for
    the first page."""
    if text is not None and not all(
        part == "-" or _is_ascii_number(part, MAX_CURSOR_DIGITS) for part in text.split(".")
    ):
        raise RealmError(
            "VALIDATION_PARAMS",
            f"cursor must be the value a previous page returned (got {_shown(text)})",
        )
    return text


async def list_runs_across(
    store: RunStore,
    workflows: list[str],
    *,
    key: str | None = None,
    phase: str | None = None,
    limit: int = 20,
    cursor: str | None = None,
) -> tuple[list[Run], str | None]:
    """One page of the runs of ``workflows``, newest first, and the cursor for the
    next page: None when no run is left, so "more runs" is never a false promise.

    The cursor holds one offset per workflow that has more runs (``deploy:3,sync:20``;
    a workflow it leaves out is done). Each workflow is read from its offset, one
    run more than the page holds (to know whether any is left), and the pages are
    merged by taking from their heads: what a page shows of a workflow is always a
    prefix of that workflow's own order, and its next offset is exactly where the
    page stopped in it."""
    if cursor is None:
        offsets: dict[str, str | None] = dict.fromkeys(workflows)
    else:
        offsets = _parse_offsets(cursor, workflows)
    pages = {
        name: await store.list_runs(name, key=key, phase=phase, limit=limit + 1, cursor=offset)
        for name, offset in offsets.items()
    }
    tagged = ([(run, name) for run in runs] for name, (runs, _) in pages.items())
    merged = list(
        itertools.islice(heapq.merge(*tagged, key=lambda pair: -pair[0].created_ms), limit)
    )
    taken = Counter(name for _, name in merged)
    next_offsets: dict[str, str] = {}
    for name, (runs, after) in pages.items():
        if taken[name] == len(runs):
            # All shown: the store's cursor says whether its scan went to the end.
            stop = after
        elif taken[name] == 0:
            stop = offsets[name] or "0"
        else:
            # Where the page stopped in this workflow: the store's cursor after exactly
            # the runs shown (its offsets count skipped entries too, so ask it).
            _, stop = await store.list_runs(
                name, key=key, phase=phase, limit=taken[name], cursor=offsets[name]
            )
        if stop is not None:
            next_offsets[name] = stop
    next_cursor = ",".join(f"{name}:{offset}" for name, offset in next_offsets.items())
    return [run for run, _ in merged], next_cursor or None


def _parse_offsets(cursor: str, workflows: list[str]) -> dict[str, str | None]:
    """``deploy:3,sync:20`` → the offset of each workflow still to page through. For
    one workflow, a bare offset (as the HTTP API returns it) is accepted too."""
    if len(workflows) == 1 and ":" not in cursor:
        return {workflows[0]: check_cursor(cursor)}
    offsets: dict[str, str | None] = {}
    for part in cursor.split(","):
        name, sep, offset = part.partition(":")
        if not sep or name not in workflows or name in offsets:
            raise RealmError(
                "VALIDATION_PARAMS",
                f"cursor must be the value a previous page returned (got {_shown(cursor)})",
            )
        offsets[name] = check_cursor(offset)
    return offsets
