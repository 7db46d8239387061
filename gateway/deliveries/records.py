"""One delivery as the delivery log keeps it: its id, its keys in Redis, and the record
built from what the listener answered (gateway/deliveries/log.py says what the log is).

A record holds the received time, path, status, each trigger's decision (outcome,
run, event id, code and why), the headers without anything that authenticates the
sender, and the body when ``settings.store_bodies`` allows it (cut at
``settings.max_stored_body_bytes``, and then marked truncated). A refused delivery
(401, 413, 503, ...) is recorded with its status and reason only: no header, no body.

Each trigger's entry also says whether that trigger verified the delivery
(``verified``) and under which verify spec (``verify_spec``, a fingerprint of the
scheme and the names of its secrets' variables, never a secret's value): a replay
may start runs only for a trigger that verified it on arrival under the spec it has
now, since the signature itself is not kept.

Ids are ``dlv-<ms, 12 hex digits>-<8 random hex digits>``: they sort by time, so
the index is a sorted set ordered by id alone and a cursor is the last id seen.

In Redis a record is one string (``pack_record``), written with its expiry in one
command: a head line of lengths, then the fields a listing filters on and shows (path,
status, outcomes, summary) as they are, so that a page reads the first kilobyte of
each record; then the whole record's JSON and the body, compressed together with zstd
(GitHub and Stripe JSON shrink 3 to 6 times, for about 10 µs per delivery). An earlier
version kept a hash per record: ``unpack_record`` and the listing read those too.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard

from gateway.ingest.received import Received, kept_headers, new_delivery_id
from gateway.ingest.triggers import Trigger
from gateway.model.config import Settings
from gateway.model.errors import RealmError
from gateway.signatures.spec import VerifySpec

DELIVERY_ID = re.compile(r"dlv-[0-9a-f]{12}-[0-9a-f]{8}")
# accepted: kept in a worker's spool, its claims not yet stored (then the outcome).
# stale: an ordered trigger's event older than one that started a run for its entity.
# rate_limited: past its trigger's rate limit; nothing recorded, a redelivery may start.
OUTCOMES = ("started", "queued", "scheduled", "deduplicated", "refused", "stale",
            "rate_limited", "handshake", "ignored", "unverified", "accepted")  # fmt: skip


@dataclass(frozen=True)
class LogKeys:
    """The delivery log's keys: one hash tag, so each script runs in one slot. The tag
    holds a ':', which no workflow name may, so it never meets a workflow's tag."""

    prefix: str

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{deliveries:log}}:d:"

    def record(self, delivery_id: str | bytes) -> str:
        if isinstance(delivery_id, bytes):
            delivery_id = delivery_id.decode()
        return self.base + delivery_id

    @property
    def index(self) -> str:
        return f"{self.prefix}:{{deliveries:log}}:index"

    @property
    def refused(self) -> str:
        return f"{self.prefix}:{{deliveries:log}}:refused"


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


def verify_fingerprint(spec: VerifySpec) -> str:
    """Who could have signed for a trigger: its scheme and the names of the variables
    holding its secrets (in any order), hashed. Never a secret's value: a rotated value
    under the same name keeps the fingerprint, a renamed or added secret changes it.
    An SNS trigger, which holds no secret, is named by the topics it takes."""
    names = frozenset(spec.secret_env)
    if spec.sns is not None:
        names |= frozenset(f"topic {arn}" for arn in spec.sns.topic_arns)
    return _fingerprint(spec.scheme, names)


@functools.lru_cache(maxsize=256)
def _fingerprint(scheme: str, secret_env: frozenset[str]) -> str:
    # Cached: every record names each trigger's, and a path's triggers are few.
    text = "\n".join([scheme, *sorted(secret_env)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_record(
    item: Received, settings: Settings, *, with_params: bool = True
) -> tuple[str, list[str | bytes]]:
    """The record of one delivery: its id and its 8 values (``pack_record`` stores
    them). An item without an id gets a new one. ``with_params=False`` leaves each
    trigger's params out (None)."""
    reply = item.reply
    delivery_id = item.delivery_id or new_delivery_id(item.received_ms)
    verified = reply.verified
    specs = {t.name: t.verify for t in item.triggers}
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
            "params": r.params if with_params else None,
            "verified": r.verified,
            "verify_spec": verify_fingerprint(specs[r.trigger]),
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


# The head line of a stored record: a format mark, then the lengths of the path,
# status, outcomes, summary and record JSON (list_deliveries.lua parses the same).
_HEAD = b"r1 %d %d %d %d %d\n"
_HEAD_LINE = re.compile(rb"r1 (\d+) (\d+) (\d+) (\d+) (\d+)\n")
# Level 1: as small as the default on webhook JSON, and faster. One of each per process:
# the event loop is the only thread that packs or unpacks a record.
_COMPRESS = zstandard.ZstdCompressor(level=1)
_DECOMPRESS = zstandard.ZstdDecompressor()


def pack_record(values: Sequence[str | bytes]) -> bytes:
    """The stored string of a record built by ``build_record``."""
    _, _, path, status, outcomes, summary, doc, body = (
        v.encode() if isinstance(v, str) else v for v in values
    )
    head = _HEAD % (len(path), len(status), len(outcomes), len(summary), len(doc))
    return b"".join((head, path, status, outcomes, summary, _COMPRESS.compress(doc + body)))


def unpack_record(stored: bytes) -> tuple[bytes, bytes]:
    """A stored record's JSON and body (see ``pack_record``)."""
    head = _HEAD_LINE.match(stored)
    if head is None:
        raise ValueError("not a delivery record")
    path, status, outcomes, summary, doc = (int(n) for n in head.groups())
    packed = _DECOMPRESS.decompress(stored[head.end() + path + status + outcomes + summary :])
    return packed[:doc], packed[doc:]


def on_arrival(record: Mapping[str, Any], triggers: Sequence[Trigger]) -> dict[str, str | None]:
    """For each trigger of the path now: None when it verified the recorded delivery on
    arrival under the verify spec it has now, else why it may not take a replay.

    A trigger that failed its signature, or that the delivery never met, must not be
    handed the delivery because another trigger of the path (another sender's secret,
    or a ``verify: none``) let it in; nor may one whose spec changed since, since the
    signature is not kept to be checked under the new one."""
    then = {t["trigger"]: t for t in record["triggers"]}
    verdicts: dict[str, str | None] = {}
    for trigger in triggers:
        entry = then.get(trigger.name)
        why: str | None = None
        if entry is None:
            why = "not a trigger of this path when it arrived"
        elif "verified" not in entry:
            why = "recorded before the delivery log kept which triggers verified a delivery"
        elif not entry["verified"]:
            why = "not verified on arrival"
        elif entry.get("verify_spec") != verify_fingerprint(trigger.verify):
            why = "its verify spec changed since it arrived"
        verdicts[trigger.name] = why
    return verdicts
