"""A trigger's ``order``: which value orders a sender's events about one entity, so
that an event older than one already started is refused as stale.

Senders do not deliver in order (Stripe says so; GitHub's ``pull_request`` events
race too). A trigger names the value (``by``: a JSONPath or a header), the entity it
orders (``key``: a key template, by default the trigger's key), what a tie means
(``ties``) and, optionally, a rank that breaks ties (``rank``: a value and the order
of its words). The claim keeps per workflow and entity the highest (value, rank) that
started a run, and refuses a lower one in the same script call.

Pure code: no I/O. ``compile_order`` raises ``ValueError`` with the field and the
reason; the trigger parser turns it into a ``ConfigError``.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass
from typing import Literal, get_args

from gateway.ingest.idempotency import ExtractError, KeyTemplate
from gateway.ingest.jsonpath import Path
from gateway.ingest.values import HeaderLookup, show

__all__ = [
    "TIES",
    "VALIDATION_ORDER",
    "OrderSpec",
    "OrderValue",
    "Rank",
    "order_number",
]

VALIDATION_ORDER = "VALIDATION_ORDER"

Ties = Literal["accept", "refuse"]
TIES: tuple[str, ...] = get_args(Ties)

# An RFC 3339 time (a 'T' or a space between date and time, seconds optional
# fractions, 'Z' or an offset) or an ISO date; compared as microseconds since 1970.
_TIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})(?:[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"([Zz]|[+-]\d{2}:\d{2}))?"
)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def order_number(value: object) -> float | None:
    """An order value as a number: a JSON number as it is, a string holding a number,
    an RFC 3339 time or an ISO date (as microseconds since 1970, UTC); None for
    anything else. Numbers are compared as doubles: integers beyond 2**53 lose their
    last digits, so two such values may compare as a tie."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        number = float(value)
        return number if math.isfinite(number) else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if _NUMBER.fullmatch(text):
        number = float(text)
        return number if math.isfinite(number) else None
    match = _TIME.fullmatch(text)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        if hour is None:
            moment = dt.datetime(int(year), int(month), int(day), tzinfo=dt.UTC)
        else:
            tz = dt.UTC
            if zone not in ("Z", "z"):
                sign = 1 if zone[0] == "+" else -1
                hours, minutes = int(zone[1:3]), int(zone[4:6])
                tz = dt.timezone(sign * dt.timedelta(hours=hours, minutes=minutes))
            moment = dt.datetime(
                int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=tz
            )
    except ValueError:  # 2024-02-30, an offset past 24 hours
        return None
    micros = (fraction or "").ljust(6, "0")[:6]
    delta = moment - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return float((delta.days * 86_400 + delta.seconds) * 1_000_000 + int(micros))


@dataclass(frozen=True)
class Rank:
    """What breaks a tie of order values: a value, and its words from oldest to newest.
    A word not in the list ranks before every listed one."""

    header: str | None
    path: Path | None
    words: tuple[str, ...]

    def of(self, headers: HeaderLookup, doc: object) -> int:
        value = _read(self.header, self.path, headers, doc)
        try:
            return self.words.index(value) if isinstance(value, str) else -1
        except ValueError:
            return -1


@dataclass(frozen=True)
class OrderValue:
    """One delivery's place in its entity's order."""

    entity: str
    number: float
    rank: int
    text: str  # the value as sent, for messages


@dataclass(frozen=True)
class OrderSpec:
    """A trigger's ``order``; ``entity`` None: the trigger's own key."""

    header: str | None
    path: Path | None
    entity: KeyTemplate | None
    ties: Ties = "accept"
    rank: Rank | None = None

    @property
    def where(self) -> str:
        return f"header {self.header}" if self.path is None else f"jsonpath {self.path.expr}"

    def resolve(
        self, headers: HeaderLookup, doc: object, event_id: str, key: str, *, exact: bool = False
    ) -> OrderValue:
        """The delivery's order value; ExtractError (VALIDATION_ORDER, a 422) when it is
        missing or neither a number nor a time. The entity's key template may raise
        InexactNumber, as the trigger's own key does."""
        value = _read(self.header, self.path, headers, doc)
        number = order_number(value)
        if number is None:
            what = "has no value" if value is None else f"holds {show(value)}"
            raise ExtractError(
                VALIDATION_ORDER,
                f"order value is missing or not comparable: {self.where} {what} (a number, "
                "an RFC 3339 time or an ISO date is needed)",
            )
        entity = (
            key if self.entity is None else self.entity.render(headers, doc, event_id, exact=exact)
        )
        rank = 0 if self.rank is None else self.rank.of(headers, doc)
        text = value if isinstance(value, str) else show(value)
        return OrderValue(entity, number, rank, text)


def _read(header: str | None, path: Path | None, headers: HeaderLookup, doc: object) -> object:
    if header is not None:
        return headers.get(header.lower()) or None
    assert path is not None
    return path.get(doc)[1]
