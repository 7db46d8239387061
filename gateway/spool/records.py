"""One spooled delivery and its bytes on disk.

A record on disk is a frame: its payload's length and CRC-32 (8 bytes, big-endian),
then the payload. The CRC tells a torn write (power lost mid-append) from a whole
record: the reader skips what does not check, and never trusts a length it cannot
check. The payload is the delivery's metadata as JSON (its length first), then the
body's raw bytes, so a body is never escaped or copied into the JSON.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

FRAME = struct.Struct(">II")  # payload length, CRC-32 of the payload
META = struct.Struct(">I")  # the metadata's length, at the payload's start
# A frame claiming more than this is not one (a torn or overwritten length): a body
# is at most settings.max_body_bytes (25 MiB by default), headers a fraction of that.
MAX_PAYLOAD = 1 << 30


class BadRecord(ValueError):
    """A payload whose checksum held but whose content does not decode."""


@dataclass(frozen=True, slots=True)
class SpooledDelivery:
    """What the drain needs to replay a delivery as it arrived: its delivery-log id,
    arrival time, path, the triggers that verified it, its headers (raw, in order,
    without those that authenticate it) and its body."""

    delivery_id: str
    received_ms: int
    path: str
    verified: tuple[str, ...]
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


def encode(delivery: SpooledDelivery) -> bytes:
    """The frame of ``delivery``, ready to append."""
    meta = orjson.dumps(
        {
            "id": delivery.delivery_id,
            "ms": delivery.received_ms,
            "path": delivery.path,
            "verified": list(delivery.verified),
            # latin-1: one character per byte, so any header bytes come back exactly.
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in delivery.headers],
        }
    )
    payload = META.pack(len(meta)) + meta + delivery.body
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def check(header: bytes, payload: bytes) -> bool:
    """Whether ``payload`` is the whole, unchanged payload its frame ``header`` names."""
    length, crc = FRAME.unpack(header)
    return len(payload) == length and zlib.crc32(payload) == crc


def decode(payload: bytes) -> SpooledDelivery:
    """The delivery in a checked payload (BadRecord if it is not one)."""
    try:
        (meta_length,) = META.unpack_from(payload)
        meta = orjson.loads(payload[META.size : META.size + meta_length])
        headers: Sequence[Sequence[str]] = meta["headers"]
        return SpooledDelivery(
            delivery_id=str(meta["id"]),
            received_ms=int(meta["ms"]),
            path=str(meta["path"]),
            verified=tuple(str(name) for name in meta["verified"]),
            headers=tuple((n.encode("latin-1"), v.encode("latin-1")) for n, v in headers),
            body=payload[META.size + meta_length :],
        )
    except (struct.error, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BadRecord(f"{type(exc).__name__}") from None
