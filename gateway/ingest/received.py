"""What the webhooks app hands the delivery log for each delivery it answered.

The delivery log (``gateway.deliveries``) sits above ingest and implements
``Recorder``; ingest only appends ``Received`` items to whatever recorder the app
gave it, so the request path never imports the log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.ingest.delivery import Reply
from gateway.ingest.triggers import Trigger


@dataclass
class Received:
    """What the listener hands the recorder for one delivery (cheap to build: the
    record itself is written off the hot path, at the next flush)."""

    received_ms: int
    path: str
    reply: Reply
    ms: float
    version: str
    triggers: Sequence[Trigger]
    headers: Sequence[tuple[bytes, bytes]] = ()
    body: bytes | None = None
    replay_of: str | None = None
    rerun: bool = False
    delivery_id: str | None = None


class Recorder(Protocol):
    def add(self, item: Received) -> None:
        """Take one delivery for the log: an append, written off the hot path."""
