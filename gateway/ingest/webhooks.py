"""The webhook routes as plain ASGI: a POST to a trigger path goes straight to the
request path (gateway/ingest/delivery.py); everything else goes on to the Starlette app.

This is the hot path, so it skips what a framework adds per request (a Request
object, route matching, middleware layers): a dict lookup, one body read, one
reply. The Starlette app still owns the lifespan (the store reaches here in
``scope["state"]``) and answers other methods on these paths with 405.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import parse_qsl

import orjson
from redis import exceptions as redis_errors
from starlette.applications import Starlette

from gateway.ingest import delivery, handshakes, sns_certs
from gateway.ingest.deadlines import Deadlines
from gateway.ingest.ingress import IngressGate
from gateway.ingest.observe import DeliveryLog
from gateway.ingest.received import Received, Recorder, authenticating, new_delivery_id
from gateway.ingest.served import Serving
from gateway.ingest.triggers import Trigger
from gateway.model.config import Settings
from gateway.model.errors import StoreUnavailable
from gateway.spool.records import SpooledDelivery
from gateway.spool.spool import Spool

log = logging.getLogger("realm")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The sender closed the connection before its body arrived."""


class RequestHeaders:
    """A delivery's headers for look-ups by lower-case name.

    Starlette's ``Headers`` scans the whole list on every look-up, and a delivery
    makes about eight. Here the raw list becomes one dict, built in C, and a value is
    decoded when it is looked up. A name sent twice (rare, and refused for signature
    headers) takes a slower path that keeps every value in order.

    Values lose their leading and trailing spaces and tabs, which HTTP says are not
    part of a field value (RFC 9110 5.5). ``get`` (keys, event ids, params, match
    conditions) decodes UTF-8, what senders write, falling back to latin-1 for bytes
    that are not UTF-8; ``getlist`` (verify) decodes latin-1 so that verify can
    encode a value back to exactly the bytes the sender signed.
    """

    __slots__ = ("_first", "_repeated")

    def __init__(self, raw: Sequence[tuple[bytes, bytes]]) -> None:
        # ASGI servers send names lower-cased (uvicorn does).
        self._first: dict[bytes, bytes] = dict(raw)
        self._repeated: dict[bytes, list[bytes]] | None = None
        if len(self._first) != len(raw):  # a name appears more than once
            repeated: dict[bytes, list[bytes]] = {}
            for name, value in raw:
                repeated.setdefault(name, []).append(value)
            self._repeated = repeated
            self._first = {name: values[0] for name, values in repeated.items()}

    def get(self, key: str, default: None = None) -> str | None:
        """The first value of header ``key`` (lower-case) as text, or None."""
        value = self._first.get(key.encode("latin-1"))
        if value is None:
            return None
        value = value.strip(_OWS)
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value.decode("latin-1")

    def getlist(self, key: str) -> list[str]:
        """Every value of header ``key`` (lower-case), in the order sent, one
        character per byte (latin-1)."""
        name = key.encode("latin-1")
        if self._repeated is not None:
            return [v.strip(_OWS).decode("latin-1") for v in self._repeated.get(name, ())]
        value = self._first.get(name)
        return [] if value is None else [value.strip(_OWS).decode("latin-1")]


_OWS = b" \t"


class BodyBudget:
    """The bytes of request bodies one worker holds for deliveries it has not yet
    answered (read, verified, claimed), against ``settings.max_buffered_body_bytes``.

    Without it an unauthenticated sender could make a worker buffer a whole body per
    connection before any signature is checked (40 bodies of 20 MiB made 1 GB of RSS). A
    declared length is taken whole before the body is read; a chunked body is taken
    chunk by chunk. What does not fit is refused at once (503 ``OVERLOADED``).
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True


class _Taken:
    """What one delivery took from the budget: given back when it is answered."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Webhooks:
    def __init__(
        self,
        app: Starlette,
        settings: Settings,
        delivery_log: DeliveryLog,
        deadlines: Deadlines,
    ) -> None:
        self.app = app  # everything that is not a webhook POST
        self.delivery_log = delivery_log
        self.deadlines = deadlines
        # The configuration serving now, and the delivery log's writer: set by the
        # app's lifespan, which opens the store; a reload swaps ``serving``.
        self.serving: Serving | None = None
        self.recorder: Recorder | None = None
        # This worker's spool (gateway/spool/), where a verified delivery goes when
        # Redis cannot take its claims in time; None: off (such a delivery gets 503).
        self.spool: Spool | None = None
        # Settings a reload cannot change (gateway/serving/reload.py refuses a file that does).
        self.settings = settings
        # Deliveries past their body read and not yet answered, in this worker. Past
        # the limit a delivery gets 503 at once: a queue that grows without bound
        # would only turn a burst into timeouts for everyone.
        self.in_flight = 0
        self.budget = BodyBudget(settings.max_buffered_body_bytes)
        # settings.ingress: per-path limits, checked in Redis before a body is read.
        self.ingress = IngressGate(deadlines)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serving = self.serving
        if scope["type"] == "http" and serving is not None:
            # The version current now serves this request to its end, whatever
            # reload happens meanwhile; the admin routes find it in request.state.
            state = scope["state"]
            state["serving"] = serving
            state["store"] = serving.store
            triggers = serving.by_path.get(scope["path"])
            if triggers is not None:
                # Each trigger takes the methods it declares (POST; GET for a sender's
                # handshake): a method none of the path's triggers takes is refused.
                method = scope["method"]
                taking = [t for t in triggers if method in t.methods]
                if method == "POST" and taking:
                    await self._deliver(scope, receive, send, taking, serving)
                elif method == "GET" and taking:
                    await self._handshake(scope, send, taking, serving)
                else:
                    await _reply(send, _not_allowed(triggers))
                return
        await self.app(scope, receive, send)

    async def _deliver(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        triggers: Sequence[Trigger],
        serving: Serving,
    ) -> None:
        started = time.perf_counter()
        received_ms = int(time.time() * 1000)
        settings = serving.config.settings
        body: bytes | None = None
        headers = RequestHeaders(scope["headers"])
        task = asyncio.current_task()
        assert task is not None
        claiming = False
        signatures: dict[str, str | None] | None = None
        taken = _Taken()
        # A limited path (settings.ingress, which a reload may change): first of all,
        # before a byte of the body is read or a signature checked, so a flood costs
        # one small Redis call per request. It fails open (gateway/ingest/ingress.py).
        limited = None
        ingress = settings.ingress.get(scope["path"]) if settings.ingress else None
        if ingress is not None:
            limited = await self.ingress.refusal(
                serving.store, scope["path"], ingress, settings.redis_timeout
            )
        # One deadline per delivery: first for the body, then for the claims.
        self.deadlines.set(task, settings.body_timeout)
        try:
            if limited is not None:
                read: bytes | delivery.Reply = limited  # unread: the server discards the body
            else:
                read = await self._read_body(headers, receive, taken, settings.max_body_bytes)
            if isinstance(read, delivery.Reply):
                reply = read
            else:
                body = read
                # Verified first, whatever follows: only a verified delivery may be
                # spooled when Redis cannot take it. An SNS message's signing
                # certificate is fetched first (once per worker and URL: cached).
                certificates = None
                if any(t.verify.scheme == "sns" for t in triggers):
                    self.deadlines.set(task, sns_certs.FETCH_TIMEOUT + 1)
                    certificates = await sns_certs.prepare_delivery(
                        [t.verify for t in triggers], read
                    )
                signatures = delivery.check_signatures(triggers, headers, read, certificates)
                if self.in_flight >= settings.max_in_flight:
                    reply = _overloaded(
                        f"more than {settings.max_in_flight} deliveries in flight; retry"
                    )
                else:
                    claiming = True
                    self.deadlines.set(task, settings.redis_timeout)
                    reply = await self._handle(scope, headers, read, triggers, serving, signatures)
        except ClientGone:
            self.deadlines.clear(task)
            self.budget.held -= taken.n
            return
        except asyncio.CancelledError:
            if not self.deadlines.clear(task):
                self.budget.held -= taken.n
                raise  # not our deadline: a shutdown, say
            task.uncancel()
            if claiming:
                reply = delivery.unavailable_reply(
                    f"Redis did not answer within {settings.redis_timeout:g} s; "
                    "the outcome is unknown, retry"
                )
            else:
                reply = delivery.error_reply(
                    408, "VALIDATION_BODY_TIMEOUT",
                    f"the body did not arrive within {settings.body_timeout:g} s",
                )  # fmt: skip
        else:
            # A deadline that passed just as the reply was ready has already asked for
            # a cancel: the reply's write is then cut, and the sender's retry finds
            # the stored decision. Rare (the sweep is every 50 ms) and never a lost run.
            self.deadlines.clear(task)
        delivery_id = None
        # Redis could not take it, and at least one trigger verified it: keep it.
        if (
            reply.status == 503
            and self.spool is not None
            and signatures is not None
            and None in signatures.values()
        ):
            assert body is not None
            reply, delivery_id = await self._spool(
                scope, body, triggers, signatures, reply, received_ms
            )
        # Answered: the body is no longer this worker's to hold (the reply holds none).
        self.budget.held -= taken.n
        self.delivery_log.observe(scope["path"], reply, started)
        if self.recorder is not None:
            # Built now and written at the recorder's next flush. Before the reply: a
            # spooled delivery's `accepted` record must be in before the drain's.
            self.recorder.add(
                Received(
                    received_ms, scope["path"], reply, (time.perf_counter() - started) * 1000,
                    serving.version, triggers, scope["headers"], body,
                    delivery_id=delivery_id,
                )
            )  # fmt: skip
        await _reply(send, reply)

    async def _handshake(
        self, scope: Scope, send: Send, triggers: Sequence[Trigger], serving: Serving
    ) -> None:
        """A GET: a sender's handshake (meta's subscription check, twitter's CRC, a
        respond rule), answered at once and recorded; never a delivery."""
        started = time.perf_counter()
        received_ms = int(time.time() * 1000)
        headers = RequestHeaders(scope["headers"])
        answer = handshakes.answer_get(triggers, headers, _query(scope))
        walk = [delivery.TriggerResult(t.name, t.workflow, "ignored", 200) for t in triggers]
        if answer.trigger is not None:
            result = walk[[t.name for t in triggers].index(answer.trigger)]
            reply = delivery.handshake_reply(answer, result, walk)
        else:
            reply = delivery.Reply(answer.status, orjson.loads(answer.body), walk=walk)
        self.delivery_log.observe(scope["path"], reply, started)
        if self.recorder is not None:
            self.recorder.add(
                Received(
                    received_ms, scope["path"], reply, (time.perf_counter() - started) * 1000,
                    serving.version, triggers, scope["headers"], b"",
                )
            )  # fmt: skip
        await _reply(send, reply)

    async def _spool(
        self,
        scope: Scope,
        body: bytes,
        triggers: Sequence[Trigger],
        signatures: dict[str, str | None],
        unavailable: delivery.Reply,
        received_ms: int,
    ) -> tuple[delivery.Reply, str | None]:
        """Keep a verified delivery that Redis could not take: 202 accepted once it is
        fsynced in the spool, with the delivery-log id its outcome will have; the 503
        as it was when the spool is full (or off, or the disk refused)."""
        assert self.spool is not None
        delivery_id = new_delivery_id(received_ms)
        verified = [t for t in triggers if signatures[t.name] is None]
        # The headers those triggers read, in order: never a signature or token.
        read = frozenset().union(*(t.headers_read for t in verified)) - authenticating(triggers)
        spooled = SpooledDelivery(
            delivery_id=delivery_id,
            received_ms=received_ms,
            path=scope["path"],
            verified=tuple(t.name for t in verified),
            headers=tuple((n, v) for n, v in scope["headers"] if n.decode("latin-1") in read),
            body=body,
        )
        if await self.spool.append(spooled):
            why = unavailable.body.get("message", "Redis could not take it")
            return delivery.accepted_reply(triggers, signatures, delivery_id, why), delivery_id
        unavailable.body["message"] += " (the spool is full: the delivery was not kept)"
        return unavailable, None

    async def _read_body(
        self, headers: RequestHeaders, receive: Receive, taken: _Taken, limit: int
    ) -> bytes | delivery.Reply:
        """The whole body, or the refusal as soon as one is known: a declared length
        over the limit or past the budget before any byte is read, a streamed one
        mid-way. A refusal leaves the rest unread: the server discards it."""
        budget = self.budget
        declared = headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit():
            # Compared as text first: a 5 000-digit length must not reach int().
            if len(declared) > 18 or int(declared) > limit:
                return _too_large(limit)
            if not budget.take(int(declared)):
                return _over_budget(budget)
            taken.n = int(declared)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _too_large(limit)
            if size > taken.n:  # chunked (the parser holds a declared length to it)
                if not budget.take(size - taken.n):
                    return _over_budget(budget)
                taken.n = size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _handle(
        self,
        scope: Scope,
        headers: RequestHeaders,
        body: bytes,
        triggers: Sequence[Trigger],
        serving: Serving,
        signatures: dict[str, str | None],
    ) -> delivery.Reply:
        self.in_flight += 1
        try:
            # bounded=False: _deliver's deadline already bounds the claims.
            return await delivery.handle(
                serving.store, triggers, headers, headers.get("content-type"), body,
                bounded=False, signatures=signatures, query=_query(scope),
            )  # fmt: skip
        except StoreUnavailable as exc:
            # Redis said "not now" (or did not answer) on a path other than a claim's.
            return delivery.unavailable_reply(exc.message)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            # Should the store ever let one through: still "not now", never a 500.
            return delivery.unavailable_reply(f"Redis is unavailable ({type(exc).__name__}); retry")
        except Exception as exc:
            # The type only: an exception's text may quote the delivery.
            log.error('{"event":"error","path":"%s","error":"%s"}', scope["path"],
                      type(exc).__name__)  # fmt: skip
            return delivery.error_reply(
                500, "INTERNAL", "unexpected error; the gateway log has its type"
            )
        finally:
            self.in_flight -= 1


async def _reply(send: Send, reply: delivery.Reply) -> None:
    payload = orjson.dumps(reply.body) if reply.raw is None else reply.raw
    raw_headers = [
        (b"content-type", reply.content_type.encode("latin-1")),
        (b"content-length", str(len(payload)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in reply.headers.items()),
    ]
    await send({"type": "http.response.start", "status": reply.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


def _not_allowed(triggers: Sequence[Trigger]) -> delivery.Reply:
    allowed = [m for m in handshakes.METHODS if any(m in t.methods for t in triggers)]
    return delivery.error_reply(
        405,
        "METHOD_NOT_ALLOWED",
        f"this webhook path takes {' and '.join(allowed)} only",
        Allow=", ".join(allowed),
    )


def _query(scope: Scope) -> dict[str, str]:
    """The request's query parameters, the first of each name (a handshake's tokens)."""
    raw = scope.get("query_string", b"")
    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, max_num_fields=100)
    except ValueError:  # more fields than any handshake sends: none is read
        return {}
    query: dict[str, str] = {}
    for name, value in pairs:
        query.setdefault(name, value)
    return query


def _too_large(limit: int) -> delivery.Reply:
    return delivery.error_reply(
        413, "VALIDATION_BODY_TOO_LARGE", f"body is larger than {limit} bytes"
    )


def _overloaded(message: str) -> delivery.Reply:
    return delivery.error_reply(503, "OVERLOADED", message, **{"Retry-After": "1"})


def _over_budget(budget: BodyBudget) -> delivery.Reply:
    return _overloaded(
        f"this worker already holds {budget.limit} bytes of request bodies "
        "(settings.max_buffered_body_bytes); retry"
    )
