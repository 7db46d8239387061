"""The spool's drain: one task per worker that replays spooled deliveries through the
request path once Redis answers, oldest first, at most ``settings.spool.drain_rate``
a second, so live deliveries keep the room they need.

A record is replayed as it arrived, with the triggers that verified it then (its
signature headers are not kept, so nothing is checked again): the path's triggers
now, each cleared if it verified the delivery on arrival. A record leaves the spool
only once every claim it carries is stored (any reply but 503); a record replayed
twice (the worker killed between the claim and the cursor's move) is deduplicated
by its event id, as a sender's retry is. Its outcome replaces the ``accepted`` entry
in the delivery log, under the same delivery id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis import exceptions as redis_errors

from gateway.ingest import delivery
from gateway.ingest.received import Received
from gateway.ingest.webhooks import RequestHeaders, Webhooks
from gateway.model.errors import StoreUnavailable
from gateway.spool.spool import Spool, Spooled

log = logging.getLogger("realm")

TICK = 1.0  # seconds between looks at an idle spool (and gauge updates)
ADOPT_SECONDS = 5.0  # how often a worker looks for the spools of processes that are gone
# Seconds to wait after Redis said "not now": first, at most. Short: the drain should
# start soon after Redis is back, and the gauges move meanwhile.
BACKOFF = (0.1, 1.0)
MAX_FAILURES = 3  # unexpected errors on one record before it is given up
_EMPTY, _WAITING, _DRAINING = object(), object(), object()  # what drain_for found


class Drainer:
    def __init__(self, webhooks: Webhooks, spool: Spool, rate: int) -> None:
        self.webhooks = webhooks
        self.spool = spool
        self.rate = rate
        self._failures: dict[str, int] = {}
        self._waiting_since: float | None = None  # Redis not answering the drain

    async def run(self) -> None:
        """Runs for the life of the app."""
        loop = asyncio.get_running_loop()
        spool = self.spool
        adopt_at = 0.0
        backoff = BACKOFF[0]
        while True:
            if loop.time() >= adopt_at:
                adopt_at = loop.time() + ADOPT_SECONDS
                try:
                    spool.adopt()
                except OSError as exc:
                    log.error('{"event":"spool","level":"error","state":"adopt_failed",'
                              '"error":"%s"}', type(exc).__name__)  # fmt: skip
            spool.update_gauges()
            state = await self.drain_for(TICK)
            if state is _EMPTY:
                # (next() found nothing: it also removed the adopted folders now empty.)
                await spool.compact()
                spool.appended.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(spool.appended.wait(), TICK)
                backoff = BACKOFF[0]
            elif state is _WAITING:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])
            else:
                backoff = BACKOFF[0]

    async def drain_for(self, seconds: float) -> object:
        """Drain for up to ``seconds`` at the drain rate: ``_EMPTY`` once nothing is
        left, ``_WAITING`` when Redis did not take a record (it stays first in line),
        else ``_DRAINING``."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        done = 0
        while loop.time() - start < seconds:
            record = self.spool.next()
            if record is None:
                return _EMPTY
            if not await self.replay(record):
                if self._waiting_since is None:
                    self._waiting_since = time.monotonic()
                    log.warning('{"event":"spool","level":"warning","state":"waiting",'
                                '"records":%d,"message":"Redis does not take spooled '
                                'deliveries yet; retrying"}', self.spool.pending())  # fmt: skip
                return _WAITING
            if self._waiting_since is not None:
                log.info('{"event":"spool","level":"info","state":"draining",'
                         '"waited_seconds":%.1f,"records":%d}',
                         time.monotonic() - self._waiting_since, self.spool.pending())  # fmt: skip
                self._waiting_since = None
            done += 1
            due = start + done / self.rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
        return _DRAINING

    async def replay(self, record: Spooled) -> bool:
        """Claim one record through the request path; False when Redis did not answer
        (the record stays), True when it left the spool (drained or given up)."""
        spooled = record.delivery
        serving = self.webhooks.serving
        assert serving is not None
        triggers = serving.by_path.get(spooled.path, ())
        verdicts = {
            t.name: None if t.name in spooled.verified else "not verified on arrival"
            for t in triggers
        }
        if None not in verdicts.values():
            # The config was reloaded since: no trigger that verified it serves its path.
            self._give_up(record, "no_trigger", delivery.error_reply(
                404, "NOT_FOUND_ROUTE",
                f"no trigger that verified this delivery serves {spooled.path} any more; "
                "the spooled delivery was dropped",
            ))  # fmt: skip
            return True
        headers = RequestHeaders(spooled.headers)
        started = time.perf_counter()
        try:
            reply = await delivery.handle(
                serving.store, triggers, headers, headers.get("content-type"), spooled.body,
                on_arrival=verdicts,
            )  # fmt: skip
        except (StoreUnavailable, redis_errors.ConnectionError, redis_errors.TimeoutError):
            return False
        except Exception as exc:
            # The type only: an exception's text may quote the delivery.
            failures = self._failures[spooled.delivery_id] = (
                self._failures.get(spooled.delivery_id, 0) + 1
            )
            log.error('{"event":"spool","level":"error","state":"replay_failed",'
                      '"delivery_id":"%s","error":"%s","attempt":%d}',
                      spooled.delivery_id, type(exc).__name__, failures)  # fmt: skip
            if failures < MAX_FAILURES:
                return False
            self._give_up(record, "error", delivery.error_reply(
                500, "INTERNAL", "replaying the spooled delivery kept failing; it was dropped"
            ))  # fmt: skip
            return True
        if reply.status == 503:
            return False
        if reply.status >= 400:
            # A decision, made (the params do not fit, say): the sender heard 202, so
            # it is said here and in the delivery log, where the live one would have
            # been said to the sender.
            log.warning('{"event":"spool","level":"warning","state":"refused",'
                        '"delivery_id":"%s","path":"%s","status":%d,"code":"%s"}',
                        spooled.delivery_id, spooled.path, reply.status,
                        reply.body.get("code") or _first_code(reply))  # fmt: skip
        self._failures.pop(spooled.delivery_id, None)
        self.spool.done(record)
        self._record(record, reply, (time.perf_counter() - started) * 1000)
        return True

    def _give_up(self, record: Spooled, reason: str, reply: delivery.Reply) -> None:
        spooled = record.delivery
        self._failures.pop(spooled.delivery_id, None)
        self.spool.drop(record, reason)
        reply.verified = True  # it was, on arrival: the log keeps it with the verified ones
        log.error('{"event":"spool","level":"error","state":"dropped","reason":"%s",'
                  '"delivery_id":"%s","path":"%s"}',
                  reason, spooled.delivery_id, spooled.path)  # fmt: skip
        self._record(record, reply, 0.0)

    def _record(self, record: Spooled, reply: delivery.Reply, ms: float) -> None:
        """The delivery log's entry for the record, replacing its ``accepted`` one."""
        recorder = self.webhooks.recorder
        serving = self.webhooks.serving
        if recorder is None or serving is None:
            return
        spooled = record.delivery
        recorder.add(
            Received(
                spooled.received_ms, spooled.path, reply, ms, serving.version,
                serving.by_path.get(spooled.path, ()), spooled.headers, spooled.body,
                delivery_id=spooled.delivery_id,
            )
        )  # fmt: skip


def _first_code(reply: delivery.Reply) -> str:
    """The first trigger's refusal code in a reply with several triggers' results."""
    return next((r.code for r in reply.results if r.code), "")
