"""Ingress limits (``settings.ingress``): how fast deliveries may arrive at one webhook
path, whoever sends them, counted in Redis for every gateway process together.

The check is the first thing the request path does for a limited path, before the
body is read or a signature checked: a flood costs one small script call per request
(gateway/store/ingress.py) and no HMAC. A delivery past the limit is answered 429
``RATE_LIMITED_INGRESS`` with ``Retry-After`` (whole seconds, at least 1), which the
Standard Webhooks spec asks senders to honour by slowing down. Stripe retries it like
any other failure; GitHub never retries, so a GitHub path's limit is a last resort and
what it refused is fetched back with ``realm recover github``.

Fail open. When Redis does not answer the check within ``CHECK_SECONDS`` (or at most
``settings.redis_timeout``), or refuses it, the delivery goes on unchecked: the limit
protects the gateway and the runners from a flood, and a Redis that cannot answer
cannot be flooded further by it, while refusing would turn a Redis blip into lost
deliveries that the claim path (the spool, or 503) would have kept. Each delivery let
through so is counted in ``realm_ingress_unchecked_total``; the worker logs the first
of an outage and the recovery, one line each.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from prometheus_client import Counter

from gateway.ingest.deadlines import Deadlines
from gateway.ingest.delivery import Reply, error_reply
from gateway.model.config import IngressLimit
from gateway.store.ingress import ingress_wait_us
from gateway.store.runstore import RunStore

log = logging.getLogger("realm")

INGRESS_UNCHECKED = Counter(
    "realm_ingress_unchecked_total",
    "Deliveries to a path with an ingress limit let through unchecked: Redis did not "
    "answer the check in time, or refused it (the limit fails open)",
    ["path"],
)

RATE_LIMITED_INGRESS = "RATE_LIMITED_INGRESS"
# The longest a check may hold a delivery up before it goes on unchecked. A check is
# one small script (well under a millisecond when Redis is well); a Redis slower than
# this is in trouble, and the claim that follows waits its own redis_timeout.
CHECK_SECONDS = 0.5

_UNITS = {1_000: "second", 60_000: "minute", 3_600_000: "hour"}


def too_fast(path: str, limit: IngressLimit, wait_us: int) -> Reply:
    """The 429 for a delivery that arrived ``wait_us`` µs before one more would fit."""
    seconds = max(1, -(-wait_us // 1_000_000))  # whole seconds, rounded up
    return error_reply(
        429,
        RATE_LIMITED_INGRESS,
        f"deliveries to {path} are limited to {limit.count} a {_UNITS[limit.period_ms]} "
        f"(rate {limit.rate}, burst {limit.burst}); retry after {seconds} s",
        **{"Retry-After": str(seconds)},
    )


class IngressGate:
    """One worker's side of the ingress limits: the check under its bound, and the
    fail-open bookkeeping (one log line when an outage starts, one when it ends)."""

    def __init__(self, deadlines: Deadlines) -> None:
        self.deadlines = deadlines
        self._failing_since: float | None = None  # time.monotonic() of the first unchecked
        self._unchecked = 0  # deliveries let through unchecked since then

    async def refusal(
        self, store: RunStore, path: str, limit: IngressLimit, redis_timeout: float
    ) -> Reply | None:
        """The 429 for a delivery to ``path`` past ``limit``; None to let it in (it fits
        and is counted, or Redis could not say)."""
        task = asyncio.current_task()
        assert task is not None
        # The request path's one timer (Deadlines), not asyncio.timeout: the limited
        # path's cost stays one script call. The caller sets the body's deadline next.
        self.deadlines.set(task, min(CHECK_SECONDS, redis_timeout))
        try:
            wait_us = await ingress_wait_us(store, path, limit)
        except asyncio.CancelledError:
            if not self.deadlines.clear(task):
                raise  # not our deadline: a shutdown, say
            task.uncancel()
            self._let_through(path, f"no answer within {min(CHECK_SECONDS, redis_timeout):g} s")
            return None
        except Exception as exc:
            # StoreUnavailable (down, refused, OOM…), or anything else: fail open.
            # The type only: a reply's text may quote the server.
            if self.deadlines.clear(task):
                task.uncancel()  # the deadline passed as the error came: it was handled
            self._let_through(path, type(exc).__name__)
            return None
        if self.deadlines.clear(task):
            task.uncancel()
        if self._failing_since is not None:
            self._recovered()
        return None if wait_us <= 0 else too_fast(path, limit, wait_us)

    def _let_through(self, path: str, why: str) -> None:
        INGRESS_UNCHECKED.labels(path).inc()
        self._unchecked += 1
        if self._failing_since is not None:
            return
        self._failing_since = time.monotonic()
        log.warning(
            '{"event":"ingress","level":"warning","state":"failing","path":%s,"error":%s,'
            '"message":"ingress limits are not checked while Redis does not answer: '
            'deliveries go on unchecked to the claim"}',
            orjson.dumps(path).decode(), orjson.dumps(why).decode(),
        )  # fmt: skip

    def _recovered(self) -> None:
        assert self._failing_since is not None
        log.info(
            '{"event":"ingress","level":"info","state":"recovered","seconds":%.1f,'
            '"unchecked":%d}',
            time.monotonic() - self._failing_since, self._unchecked,
        )  # fmt: skip
        self._failing_since = None
        self._unchecked = 0
