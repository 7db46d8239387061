"""The delivery log: every delivery the listener answered, kept in Redis to be listed,
looked at and replayed (``realm deliveries``, ``/v1/deliveries``, MCP, ``/ui``).

What a record holds is in gateway/deliveries/records.py; how each worker writes the
log (every 100 ms, bounded, trimmed to ``settings.delivery_retention`` and
``settings.max_deliveries``) in gateway/deliveries/writing.py. Here: listing it,
one record, and replaying a stored delivery through the request path. The names the
other layers use are all importable from here.

Both scripts name every key they touch (a cluster routes a script by its keys, and
refuses one that reaches a key it was not told of while a slot moves): a page reads
the ids from the indexes first, then hands the script the records to examine.
"""

from __future__ import annotations

import base64
import heapq
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.deliveries.records import (
    DELIVERY_ID,
    OUTCOMES,
    LogKeys,
    build_record,
    check_delivery_id,
    id_floor,
    kept_headers,
    new_delivery_id,
    on_arrival,
    unpack_record,
    verify_fingerprint,
)
from gateway.deliveries.writing import (
    DELIVERY_LOG_DROPPED,
    MAX_BUFFERED,
    WRITE_CHUNK,
    DeliveryRecorder,
    refused_cap,
    write_records,
)
from gateway.ingest.delivery import handle
from gateway.ingest.received import Received
from gateway.ingest.triggers import Trigger
from gateway.ingest.webhooks import RequestHeaders
from gateway.model.config import Settings
from gateway.model.errors import RealmError
from gateway.store.runstore import RunStore

__all__ = [
    "DELIVERY_ID",
    "DELIVERY_LOG_DROPPED",
    "EXAMINE",
    "MAX_BUFFERED",
    "MAX_LIMIT",
    "OUTCOMES",
    "STATUS_FILTER",
    "WRITE_CHUNK",
    "DeliveryFilter",
    "DeliveryRecorder",
    "LogKeys",
    "Received",
    "build_record",
    "check_delivery_id",
    "get_delivery",
    "id_floor",
    "kept_headers",
    "list_deliveries",
    "new_delivery_id",
    "refused_cap",
    "replay",
    "replay_input",
    "verify_fingerprint",
    "with_body",
    "write_records",
]

STATUS_FILTER = re.compile(r"[1-5](?:[0-9]{2}|xx)")
MAX_LIMIT = 1000
# Ids one list call examines under a filter: a bounded step, never the whole log.
EXAMINE = 1000


# -- reading --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeliveryFilter:
    path: str | None = None
    status: str | None = None  # '202' or a class like '4xx'
    outcome: str | None = None
    since_ms: int | None = None

    def check(self) -> DeliveryFilter:
        if self.status is not None and not STATUS_FILTER.fullmatch(self.status):
            raise RealmError(
                "VALIDATION_PARAMS",
                f"status must be an HTTP status like 202 or a class like 4xx "
                f"(got {self.status[:20]!r})",
            )
        if self.outcome is not None and self.outcome not in OUTCOMES:
            raise RealmError(
                "VALIDATION_PARAMS",
                f"outcome must be one of {', '.join(OUTCOMES)} (got {self.outcome[:20]!r})",
            )
        if self.path is not None and not self.path.startswith("/"):
            raise RealmError(
                "VALIDATION_PARAMS", f"path must start with '/' (got {self.path[:40]!r})"
            )
        return self


async def list_deliveries(
    store: RunStore,
    where: DeliveryFilter = DeliveryFilter(),
    *,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """A page of the log, newest first, and the cursor of the next page (None: done).

    The cursor is the id the page ended at; deliveries recorded while a caller pages
    never shift a later page. Under a filter a page may be short with a cursor."""
    where.check()
    if not 1 <= limit <= MAX_LIMIT:
        raise RealmError("VALIDATION_PARAMS", f"limit must be between 1 and {MAX_LIMIT}")
    if cursor is not None:
        check_delivery_id(cursor)  # a cursor is an id
    keys = LogKeys(store.prefix)
    filtered = any(v is not None for v in (where.path, where.status, where.outcome))
    # One more than the page unfiltered: whether more follow is then known.
    examine = max(EXAMINE, limit + 1) if filtered else limit + 1
    # Ids sort by time and never repeat, so the cursor names a position: deliveries
    # recorded while a caller pages come before it and never shift a later page.
    newest = "(" + cursor if cursor else "+"
    oldest = "-" if where.since_ms is None else "[" + id_floor(where.since_ms)
    args = [limit, where.path or "", where.status or "", where.outcome or ""]
    scripts = store.scripts
    async with store.deadline():
        verified, refused = await store.call(
            lambda: _newest_ids(store.redis, keys, newest, oldest, examine)
        )
        merged = list(islice(heapq.merge(verified, refused, reverse=True), examine + 1))
        # More may follow past what is examined now: ids left over, or an index that
        # gave all that was asked of it.
        more = len(merged) > examine or examine in (len(verified), len(refused))
        ids = merged[:examine]
        if not ids:
            return [], None
        reply = await store.call(
            lambda: scripts.list_deliveries(keys=[keys.record(i) for i in ids], args=args)
        )
    examined, summaries = int(reply[0]), reply[1:]
    next_cursor: str | None = None
    if len(summaries) == limit:
        # A full page: a cursor only if something is left to read.
        if examined < len(ids) or more:
            next_cursor = _str(ids[examined - 1])
    elif more:
        # Short of a full page: all this call examined, and more may follow.
        next_cursor = _str(ids[-1])
    return [orjson.loads(item) for item in summaries], next_cursor


async def _newest_ids(
    redis: Redis, keys: LogKeys, newest: str, oldest: str, examine: int
) -> tuple[list[bytes], list[bytes]]:
    """Both indexes' ids from ``newest`` down to ``oldest``, at most ``examine`` each."""
    async with redis.pipeline(transaction=False) as pipe:
        for index in (keys.index, keys.refused):
            pipe.zrange(index, newest, oldest, desc=True, bylex=True, offset=0, num=examine)
        verified, refused = await pipe.execute()
    return verified, refused


async def get_delivery(store: RunStore, delivery_id: str) -> dict[str, Any]:
    """One delivery's whole record; ``NOT_FOUND_DELIVERY`` if the log no longer has it."""
    check_delivery_id(delivery_id)
    name = LogKeys(store.prefix).record(delivery_id)
    async with store.deadline():
        raw, body = await store.call(lambda: _read_record(store.redis, name))
    if raw is None:
        raise RealmError(
            "NOT_FOUND_DELIVERY",
            f"delivery {delivery_id} is not in the delivery log (it keeps "
            "settings.delivery_retention and at most settings.max_deliveries)",
        )
    return with_body(orjson.loads(raw), body)


async def _read_record(redis: Redis, name: str) -> tuple[bytes | None, bytes | None]:
    """A record's JSON and body: one GET, or a hash an earlier version wrote."""
    try:
        stored = await redis.get(name)
    except ResponseError as exc:
        if "WRONGTYPE" not in str(exc):
            raise
        raw, body = await redis.hmget(name, ["doc", "b"])
        return raw, body
    return (None, None) if stored is None else unpack_record(stored)


def with_body(record: dict[str, Any], body: bytes | None) -> dict[str, Any]:
    """The record with its body as text: UTF-8 as it is, anything else in base64."""
    if record.get("body_encoding") == "stored":
        data = body or b""
        try:
            record["body"], record["body_encoding"] = data.decode(), "utf-8"
        except UnicodeDecodeError:
            record["body"], record["body_encoding"] = base64.b64encode(data).decode(), "base64"
    return record


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- replaying ------------------------------------------------------------------------


def replay_input(record: Mapping[str, Any]) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A stored delivery's headers and body as they arrived (less what the log drops),
    or ``STATE_DELIVERY_NOT_REPLAYABLE`` saying why it cannot be sent again."""
    delivery_id = record["delivery_id"]
    if record["headers"] is None:
        raise RealmError(
            "STATE_DELIVERY_NOT_REPLAYABLE",
            f"delivery {delivery_id} was refused ({record['status']}) before it was "
            "verified: the log keeps neither its headers nor its body",
        )
    if record["body"] is None:
        raise RealmError(
            "STATE_DELIVERY_NOT_REPLAYABLE",
            f"delivery {delivery_id} was recorded without its body (settings.store_bodies "
            "was false)",
        )
    if record["body_truncated"]:
        raise RealmError(
            "STATE_DELIVERY_NOT_REPLAYABLE",
            f"delivery {delivery_id} was stored cut at settings.max_stored_body_bytes "
            f"(its body had {record['body_size']} bytes): the whole body is not kept",
        )
    body_text = record["body"]
    body = (
        base64.b64decode(body_text) if record["body_encoding"] == "base64" else body_text.encode()
    )
    headers = [(name.encode("latin-1"), value.encode()) for name, value in record["headers"]]
    return headers, body


async def replay(
    store: RunStore,
    by_path: Mapping[str, Sequence[Trigger]],
    settings: Settings,
    version: str,
    delivery_id: str,
    *,
    rerun: bool = False,
) -> dict[str, Any]:
    """Send a stored delivery through matching again, with today's triggers of its path,
    and record it as a replay of the first.

    Its signature is not stored, so it is not verified again: only the triggers that
    verified it on arrival, under the verify spec they have now, may take it; each
    other trigger of the path is ``unverified``, saying why (records.on_arrival).

    By default the triggers' policies apply: a replay of a delivery that started a run
    is deduplicated to that run. ``rerun``: each matched trigger starts a new run
    (``rerun_of`` the run its key points at; a live one is cancelled first, as
    ``on_live_match: cancel_existing`` does). Returns the replay's own record."""
    record = await get_delivery(store, delivery_id)
    raw_headers, body = replay_input(record)
    path = record["path"]
    triggers = by_path.get(path)
    if not triggers:
        raise RealmError(
            "NOT_FOUND_PATH",
            f"no trigger serves {path} in the current configuration: delivery "
            f"{delivery_id} has nothing to be matched against",
        )
    headers = RequestHeaders(raw_headers)
    received_ms = int(time.time() * 1000)
    started = time.perf_counter()
    reply = await handle(
        store, triggers, headers, headers.get("content-type"), body,
        on_arrival=on_arrival(record, triggers), rerun=rerun,
    )  # fmt: skip
    item = Received(
        received_ms, path, reply, (time.perf_counter() - started) * 1000, version, triggers,
        raw_headers, body, replay_of=delivery_id, rerun=rerun,
    )  # fmt: skip
    if not settings.delivery_log:
        # Still answer with what a record would hold; nothing is written.
        values = build_record(item, settings)[1]
        return with_body(orjson.loads(values[6]), values[7])  # type: ignore[arg-type]
    (new_id,) = await write_records(store, settings, [item])
    return await get_delivery(store, new_id)
