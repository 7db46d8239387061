"""The paging inputs of ``list_runs`` (HTTP query, MCP arguments, CLI flags), checked
before they reach the store: a bad one is ``VALIDATION_PARAMS`` with a clear message.

Only ASCII digits count: ``str.isdigit()`` is also true for '²' or '٣', which
``int()`` then refuses or reads as another number. The cursor is a position: the
index score and id of the last run a page showed (gateway/store/listing.py ``_RunPager``).
"""

from __future__ import annotations

from gateway.model.errors import RealmError
from gateway.store.listing import parse_position
from gateway.store.runs import Run
from gateway.store.runstore import RunStore

MAX_LIMIT = 1000


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
    """A cursor as a previous page returned it (``<score>.<run id>``: the position of
    the last run shown), or None for the first page."""
    if text is not None:
        try:
            parse_position(text)
        except RealmError:
            raise RealmError(
                "VALIDATION_PARAMS",
                f"cursor must be the value a previous page returned (got {_shown(text)})",
            ) from None
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
    The cursor is a position (the last run shown), the same for one workflow or many."""
    return await store.list_runs_of(
        workflows, key=key, phase=phase, limit=limit, cursor=check_cursor(cursor)
    )
