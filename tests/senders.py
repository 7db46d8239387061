"""Webhook senders that behave like GitHub or Stripe, for load and fault tests.

A sender posts one delivery and retries it, with a small exponential backoff,
after any non-2xx reply or connection error, until it gets a 2xx or its
overall deadline passes (or the test tells it to give up). Every attempt is
recorded with its send and reply times (``time.monotonic``), so a test can
ask what the gateway answered while a fault was on, and which deliveries were
acknowledged (got a 2xx) with which run id.

``send_all`` runs N concurrent senders over a list of deliveries, each sender
with its own ``httpx.AsyncClient`` whose pool is sized for it (one keep-alive
connection: a sender has one request in flight at a time), and keeps live
counts in a ``Tally`` that a test can wait on to inject a fault "when 1 000
deliveries have been acknowledged". One client per sender rather than one
shared pool of N: httpcore scans its whole pool on every request, which made
a shared 32-connection pool the bottleneck of the tests (about 4x slower).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

try:
    import sniffio  # noqa: F401
except ImportError:
    # httpcore tries `import sniffio` on every request; when it is not installed,
    # each failed import searches sys.path again (a third of the senders' CPU).
    # A None entry makes that import fail at once; nothing else changes.
    sys.modules["sniffio"] = None  # type: ignore[assignment]

RETRYABLE_PAUSE = 0.05  # first backoff, seconds
MAX_PAUSE = 0.5  # backoff cap, seconds


@dataclass(frozen=True)
class Delivery:
    """One HTTP request as a sender would make it; a redelivery is an equal Delivery."""

    event_id: str
    body: bytes
    headers: Mapping[str, str]
    path: str = "/hooks/github"


@dataclass
class Attempt:
    sent: float  # monotonic time the request was started
    done: float  # monotonic time the reply (or the error) arrived
    status: int | None  # None: no HTTP reply (connection error, timeout)
    error: str | None = None  # the httpx exception's class name, when status is None
    reply: Any = None  # the JSON reply, when there is one
    retry_after: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def seconds(self) -> float:
        return self.done - self.sent

    @property
    def run_id(self) -> str | None:
        try:
            return self.reply["results"][0]["run_id"]
        except (TypeError, KeyError, IndexError):
            return None

    @property
    def outcome(self) -> str | None:
        try:
            return self.reply["results"][0]["outcome"]
        except (TypeError, KeyError, IndexError):
            return None

    @property
    def code(self) -> str | None:
        return self.reply.get("code") if isinstance(self.reply, dict) else None


@dataclass
class Outcome:
    """Every attempt of one delivery; ``acked`` is the 2xx that ended it, if any."""

    delivery: Delivery
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def acked(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts and self.attempts[-1].ok else None


class Tally:
    """Live counts across the senders of one load, and thresholds a test can await."""

    def __init__(self) -> None:
        self.acked = 0
        self.attempts = 0
        self.in_flight = 0
        self._thresholds: list[tuple[int, asyncio.Event]] = []

    def acked_at_least(self, n: int) -> asyncio.Event:
        """An event set once ``n`` deliveries have been acknowledged."""
        event = asyncio.Event()
        if self.acked >= n:
            event.set()
        else:
            self._thresholds.append((n, event))
        return event

    def _ack(self) -> None:
        self.acked += 1
        for n, event in self._thresholds:
            if self.acked >= n:
                event.set()


class Sender:
    """Delivers one delivery at a time until a 2xx, as GitHub/Stripe would."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        deadline: float,
        tally: Tally | None = None,
        give_up: asyncio.Event | None = None,
        rng: random.Random | None = None,
        first_pause: float = RETRYABLE_PAUSE,
        max_pause: float = MAX_PAUSE,
    ) -> None:
        """``deadline``: a ``time.monotonic()`` value after which no retry starts.
        ``give_up``: once set, no retry starts either (the test has seen enough)."""
        self.client = client
        self.deadline = deadline
        self.tally = tally or Tally()
        self.give_up = give_up
        self.rng = rng or random.Random(0)
        self.first_pause = first_pause
        self.max_pause = max_pause

    async def deliver(self, delivery: Delivery) -> Outcome:
        outcome = Outcome(delivery)
        pause = self.first_pause
        while True:
            attempt = await self._attempt(delivery)
            outcome.attempts.append(attempt)
            if attempt.ok:
                self.tally._ack()
                return outcome
            wait = pause * (0.5 + self.rng.random())  # jitter, as real senders do
            if time.monotonic() + wait > self.deadline or self._given_up():
                return outcome
            if self.give_up is None:
                await asyncio.sleep(wait)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.give_up.wait(), wait)
                if self._given_up():
                    return outcome
            pause = min(pause * 2, self.max_pause)

    def _given_up(self) -> bool:
        return self.give_up is not None and self.give_up.is_set()

    async def _attempt(self, delivery: Delivery) -> Attempt:
        self.tally.attempts += 1
        self.tally.in_flight += 1
        sent = time.monotonic()
        try:
            response = await self.client.post(
                delivery.path, content=delivery.body, headers=dict(delivery.headers)
            )
        except httpx.HTTPError as exc:
            return Attempt(sent, time.monotonic(), None, error=type(exc).__name__)
        finally:
            self.tally.in_flight -= 1
        done = time.monotonic()
        try:
            reply = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            reply = response.text
        return Attempt(
            sent, done, response.status_code, reply=reply,
            retry_after=response.headers.get("retry-after"),
        )  # fmt: skip


def client_for(base_url: str, concurrency: int, *, timeout: float = 10.0) -> httpx.AsyncClient:
    """One client for ``concurrency`` senders: a pool that never makes one wait."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout)


async def warm_up(client: httpx.AsyncClient, connections: int) -> None:
    """Open ``connections`` keep-alive connections, so a burst starts on warm ones."""
    replies = await asyncio.gather(*(client.get("/healthz") for _ in range(connections)))
    assert all(r.status_code == 200 for r in replies)


async def send_all(
    base_url: str,
    deliveries: Sequence[Delivery],
    *,
    concurrency: int,
    seconds: float,
    tally: Tally | None = None,
    give_up: asyncio.Event | None = None,
    seed: int = 0,
    request_timeout: float = 10.0,
) -> list[Outcome]:
    """Deliver every delivery, ``concurrency`` senders at a time, in the given order.

    Each sender retries its delivery until a 2xx or until ``seconds`` from now have
    passed; the whole call is bounded by that too (plus one request timeout).
    Returns one Outcome per delivery, in the order of ``deliveries``.
    """
    tally = tally or Tally()
    deadline = time.monotonic() + seconds
    outcomes: list[Outcome | None] = [None] * len(deliveries)
    queue = iter(range(len(deliveries)))

    async def worker(n: int) -> None:
        async with client_for(base_url, 1, timeout=request_timeout) as client:
            sender = Sender(client, deadline=deadline, tally=tally, give_up=give_up,
                            rng=random.Random(seed + n))  # fmt: skip
            for i in queue:  # a shared iterator: each index is taken by one worker
                outcomes[i] = await sender.deliver(deliveries[i])

    async with asyncio.timeout(seconds + request_timeout + 5):
        await asyncio.gather(*(worker(n) for n in range(concurrency)))
    assert all(o is not None for o in outcomes)
    return outcomes  # type: ignore[return-value]
