"""What the webhooks app hands the delivery log for each delivery it answered.

The delivery log (``gateway.deliveries``) sits above ingest and implements
``Recorder``; ingest only appends ``Received`` items to whatever recorder the app
gave it, so the request path never imports the log.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from gateway.ingest.delivery import Reply
from gateway.ingest.triggers import Trigger


@dataclass
class Received:
    """What the listener hands the recorder for one delivery it answered."""

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
        """Take one delivery for the log: built now, written at the next flush."""


def new_delivery_id(received_ms: int) -> str:
    """A delivery's id in the delivery log: ``dlv-<ms, 12 hex digits>-<8 random hex
    digits>``, so ids sort by arrival time."""
    return f"dlv-{received_ms:012x}-{secrets.token_hex(4)}"


# Header names that authenticate the sender (a signature, a token, a session) are
# never kept, neither in the delivery log nor in the spool: a stored signature could
# be replayed by whoever reads it. The scheme's own header is dropped too, whatever
# it is called.
_SECRET_WORDS = ("signature", "token", "secret", "auth", "cookie", "hmac", "api-key",
                 "apikey", "password", "session", "credential")  # fmt: skip


def authenticating(triggers: Sequence[Trigger]) -> set[str]:
    """The lower-case names of the headers ``triggers`` verify with."""
    return {t.verify.header.lower() for t in triggers if t.verify.header}


def kept(name: str, dropped: Set[str]) -> bool:
    """Whether header ``name`` (lower-case) may be kept: it authenticates no one."""
    return name not in dropped and not any(word in name for word in _SECRET_WORDS)


@functools.lru_cache(maxsize=4096)
def _kept_name(name: bytes, dropped: frozenset[str]) -> str | None:
    # Senders send the same few names on every delivery: each is judged once. Bounded,
    # since a name is whatever a sender writes.
    text = name.decode("latin-1").lower()
    return text if kept(text, dropped) else None


def kept_headers(
    raw: Iterable[tuple[bytes, bytes]], triggers: Sequence[Trigger]
) -> list[list[str]]:
    """The request's headers as the log keeps them: names lower-case, in order, every
    signature, token and cookie header left out."""
    dropped = frozenset(authenticating(triggers))
    out = []
    for name_bytes, value_bytes in raw:
        name = _kept_name(name_bytes, dropped)
        if name is not None:
            out.append([name, _text(value_bytes)])
    return out


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")
