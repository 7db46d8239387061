"""The delivery log: every delivery the listener answered, kept in Redis to be listed,
looked at and replayed (``realm deliveries``, ``/v1/deliveries``, MCP, ``/ui``).

A record holds the received time, path, status, each trigger's decision (outcome,
run, event id, code and why), the headers without anything that authenticates the
sender, and the body when ``settings.store_bodies`` allows it (cut at
``settings.max_stored_body_bytes``, and then marked truncated). A refused delivery
(401, 413, 503, ...) is recorded with its status and reason only: no header, no body.

Recording costs a delivery one append to a list: each worker's ``DeliveryRecorder``
writes what gathered in one script call every 100 ms (record_deliveries.lua), and
that call also trims the log to ``settings.delivery_retention`` and
``settings.max_deliveries``. The log is a record of what happened, not part of the
run-start promise: records still buffered when a worker dies, or refused by a full
Redis, are lost and counted (``realm_delivery_log_dropped_total``).

Ids are ``dlv-<ms, 12 hex digits>-<8 random hex digits>``: they sort by time, so
the index is a sorted set ordered by id alone and a cursor is the last id seen.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter

from gateway.ingest.delivery import handle
from gateway.ingest.received import Received
from gateway.ingest.triggers import Trigger
from gateway.ingest.webhooks import RequestHeaders
from gateway.model.config import Settings
from gateway.model.errors import RealmError
from gateway.store.runstore import RunStore

log = logging.getLogger("realm")

DELIVERY_LOG_DROPPED = Counter(
    "realm_delivery_log_dropped_total",
    "Delivery log records a worker dropped unwritten (Redis refused them for longer "
    "than its buffer lasts); the deliveries themselves were answered",
)

DELIVERY_ID = re.compile(r"dlv-[0-9a-f]{12}-[0-9a-f]{8}")
OUTCOMES = ("started", "deduplicated", "refused", "ignored", "unverified")
STATUS_FILTER = re.compile(r"[1-5](?:[0-9]{2}|xx)")
MAX_LIMIT = 1000
# Ids one list call examines under a filter: a bounded step, never the whole log.
EXAMINE = 1000
FLUSH_SECONDS = 0.1
WRITE_CHUNK = 32  # records per script call (~100 KB of 3 KB deliveries)
TRIM_SECONDS = 1.0  # an idle worker's trim of the log, without records to write
# Records one worker buffers while Redis does not take them; older ones are dropped.
MAX_BUFFERED = 10_000

# Header names that authenticate the sender (a signature, a token, a session) are
# never stored: a stored signature could be replayed by whoever reads the log. The
# scheme's own header is dropped too (gateway/signatures/verify.py names it), whatever it is called.
_SECRET_WORDS = ("signature", "token", "secret", "auth", "cookie", "hmac", "api-key",
                 "apikey", "password", "session", "credential")  # fmt: skip


@dataclass(frozen=True)
class LogKeys:
    """The delivery log's keys: one hash tag, so each script runs in one slot. The tag
    holds a ':', which no workflow name may, so it never meets a workflow's tag."""

    prefix: str

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{deliveries:log}}:d:"

    def record(self, delivery_id: str) -> str:
        return self.base + delivery_id

    @property
    def index(self) -> str:
        return f"{self.prefix}:{{deliveries:log}}:index"

    @property
    def refused(self) -> str:
        return f"{self.prefix}:{{deliveries:log}}:refused"


def new_delivery_id(received_ms: int) -> str:
    return f"dlv-{received_ms:012x}-{secrets.token_hex(4)}"


def id_floor(since_ms: int) -> str:
    """The smallest id a delivery received at ``since_ms`` or later can have."""
    return f"dlv-{max(since_ms, 0):012x}-00000000"


def check_delivery_id(delivery_id: str) -> None:
    if not DELIVERY_ID.fullmatch(delivery_id):
        shown = repr(delivery_id if len(delivery_id) <= 40 else delivery_id[:40] + "…")
        raise RealmError(
            "VALIDATION_PARAMS",
            f"delivery id {shown} is not one (ids look like dlv-0193a1b2c3d4-5e6f7a8b)",
        )


def kept_headers(
    raw: Iterable[tuple[bytes, bytes]], triggers: Sequence[Trigger]
) -> list[list[str]]:
    """The request's headers as the log keeps them: names lower-case, in order, every
    signature, token and cookie header left out."""
    dropped = {t.verify.header.lower() for t in triggers if t.verify.header}
    kept = []
    for name_bytes, value_bytes in raw:
        name = name_bytes.decode("latin-1").lower()
        if name in dropped or any(word in name for word in _SECRET_WORDS):
            continue
        kept.append([name, _text(value_bytes)])
    return kept


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


def build_record(item: Received, settings: Settings) -> tuple[str, list[str | bytes]]:
    """The record of one delivery: its id and the script's 8 values for it."""
    reply = item.reply
    delivery_id = item.delivery_id or new_delivery_id(item.received_ms)
    verified = reply.verified
    triggers = [
        {
            "trigger": r.trigger,
            "workflow": r.workflow,
            "outcome": r.outcome,
            "run_id": r.run_id,
            "event_id": r.event_id,
            "deduped": r.deduped,
            "rerun_of": r.rerun_of,
            "phase": r.phase,
            "code": r.code,
            "message": r.message,
            "signature": r.signature,
            "matched": r.matched,
            "why_not": r.why_not,
            "key": r.key,
            "params": r.params,
            **({"params_mismatch": True} if r.params_mismatch else {}),
        }
        for r in reply.walk or reply.results
    ]
    doc: dict[str, Any] = {
        "delivery_id": delivery_id,
        "received_ms": item.received_ms,
        "path": item.path,
        "status": reply.status,
        "code": reply.body.get("code"),
        "message": reply.body.get("message"),
        "ms": round(item.ms, 2),
        "config_version": item.version,
        "replay_of": item.replay_of,
        "rerun": item.rerun,
        "triggers": triggers,
        "headers": None,
        "body": None,
        "body_encoding": None,
        "body_size": None,
        "body_truncated": False,
    }
    # The body is kept as its own field, as raw bytes: inside the JSON it would be
    # escaped (and base64'd when binary) on every delivery, where it is read rarely.
    # get_delivery puts it back into the record.
    kept = b""
    if verified:
        doc["headers"] = kept_headers(item.headers, item.triggers)
        body = item.body or b""
        doc["body_size"] = len(body)
        if settings.store_bodies:
            kept = body[: settings.max_stored_body_bytes]
            doc["body_truncated"] = len(kept) < len(body)
            doc["body_encoding"] = "stored"
    outcomes = "," + ",".join(t["outcome"] for t in triggers) + ","
    summary = {
        "delivery_id": delivery_id,
        "received_ms": item.received_ms,
        "path": item.path,
        "status": reply.status,
        "code": doc["code"],
        "outcomes": [
            {"trigger": t["trigger"], "outcome": t["outcome"], "run_id": t["run_id"]}
            for t in triggers
        ],
        "replay_of": item.replay_of,
    }
    values = [
        delivery_id,
        "v" if verified else "r",
        item.path,
        str(reply.status),
        outcomes,
        orjson.dumps(summary),
        orjson.dumps(doc),
        kept,
    ]
    return delivery_id, values


class DeliveryRecorder:
    """One worker's writer of the delivery log: ``add`` on the hot path, one script
    call per ``FLUSH_SECONDS`` for everything added meanwhile."""

    def __init__(self, store: RunStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings  # replaced on a reload (gateway/serving/reload.py)
        self._buffer: list[Received] = []

    def add(self, item: Received) -> None:
        if not self.settings.delivery_log:
            return
        buffer = self._buffer
        buffer.append(item)
        if len(buffer) > MAX_BUFFERED:
            del buffer[: len(buffer) - MAX_BUFFERED]
            DELIVERY_LOG_DROPPED.inc()

    async def flush(self) -> None:
        """Write what is buffered; on failure keep it for the next flush (up to the cap)."""
        items, self._buffer = self._buffer, []
        if not items:
            return
        try:
            await write_records(self.store, self.settings, items)
        except Exception as exc:  # Redis down or full: the deliveries were answered anyway
            self._buffer[:0] = items
            excess = len(self._buffer) - MAX_BUFFERED
            if excess > 0:
                del self._buffer[:excess]
                DELIVERY_LOG_DROPPED.inc(excess)
            log.warning(
                '{"event":"delivery_log","level":"warning","error":"%s","buffered":%d}',
                type(exc).__name__, len(self._buffer),
            )  # fmt: skip

    async def run(self) -> None:
        """Runs for the life of the app; a last flush happens at shutdown (``close``).
        While nothing is recorded it still trims every ``TRIM_SECONDS``, so the log
        empties once its retention has passed, with no delivery to trigger it."""
        idle = 0.0
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            if self._buffer:
                idle = 0.0
                await self.flush()
                continue
            idle += FLUSH_SECONDS
            if idle >= TRIM_SECONDS and self.settings.delivery_log:
                idle = 0.0
                with contextlib.suppress(Exception):  # the next flush or trim tries again
                    await write_records(self.store, self.settings, [])

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), self.store.timeout)


async def write_records(
    store: RunStore, settings: Settings, items: Sequence[Received]
) -> list[str]:
    """Write ``items`` to the log now; their ids, in order. At most ``WRITE_CHUNK``
    records go in one script call: a script holds Redis while it runs, and the claims
    waiting behind one large call would see its whole length as latency."""
    if len(items) <= WRITE_CHUNK:
        return await _write_chunk(store, settings, items)
    ids: list[str] = []
    for start in range(0, len(items), WRITE_CHUNK):
        ids += await _write_chunk(store, settings, items[start : start + WRITE_CHUNK])
    return ids


async def _write_chunk(store: RunStore, settings: Settings, items: Sequence[Received]) -> list[str]:
    keys = LogKeys(store.prefix)
    ids: list[str] = []
    args: list[str | int | bytes] = [
        keys.base,
        settings.delivery_retention_ms,
        settings.max_deliveries,
        refused_cap(settings),
        id_floor(int(time.time() * 1000) - settings.delivery_retention_ms),
    ]
    for item in items:
        delivery_id, values = build_record(item, settings)
        ids.append(delivery_id)
        args.extend(values)
    scripts = store.scripts
    await store.call(lambda: scripts.record_deliveries(keys=[keys.index, keys.refused], args=args))
    return ids


def refused_cap(settings: Settings) -> int:
    """Refused deliveries kept: a tenth of the cap, at least 100."""
    return max(100, settings.max_deliveries // 10)


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
    args = [
        keys.base,
        cursor or "",
        "" if where.since_ms is None else id_floor(where.since_ms),
        limit,
        # One more than the page unfiltered: whether more follow is then known.
        max(EXAMINE, limit + 1) if filtered else limit + 1,
        where.path or "",
        where.status or "",
        where.outcome or "",
    ]
    scripts = store.scripts
    async with store.deadline():
        reply = await store.call(
            lambda: scripts.list_deliveries(keys=[keys.index, keys.refused], args=args)
        )
    next_cursor = _str(reply[0]) or None
    return [orjson.loads(item) for item in reply[1:]], next_cursor


async def get_delivery(store: RunStore, delivery_id: str) -> dict[str, Any]:
    """One delivery's whole record; ``NOT_FOUND_DELIVERY`` if the log no longer has it."""
    check_delivery_id(delivery_id)
    name = LogKeys(store.prefix).record(delivery_id)
    async with store.deadline():
        raw, body = await store.call(lambda: store.redis.hmget(name, ["doc", "b"]))
    if raw is None:
        raise RealmError(
            "NOT_FOUND_DELIVERY",
            f"delivery {delivery_id} is not in the delivery log (it keeps "
            "settings.delivery_retention and at most settings.max_deliveries)",
        )
    return with_body(orjson.loads(raw), body)


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
    and record it as a replay of the first. It was verified when it arrived, and its
    signature is not stored, so it is not verified again.

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
        store, triggers, headers, headers.get("content-type"), body, verified=True, rerun=rerun
    )
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
