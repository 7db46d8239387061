"""One pipelined connection to Redis for the listener's claims.

Under load many deliveries reach their claim at once. Through redis-py each
claim pays a pool checkout, a write, a read per reply and a parse, all in
Python: measured, that was most of a delivery's CPU. Here the claims share
one connection: the ``EVALSHA`` commands made in one turn of the event loop go
out in one write at the end of that turn, and while two writes' replies are
still due, those of the turns meanwhile wait and go out together as the oldest
is answered (at low load nothing is due, so nothing waits).
Each chunk the socket delivers is fed to hiredis, whose replies are handed to
their callers in order, straight from ``data_received``: no task, stream or
timer per call. Each call still runs as its own atomic script, and its reply or
error reaches its own caller.

Errors are redis-py's exception classes (the store maps them to outcomes):
a dropped connection fails every call on it with ``ConnectionError``, and a
connection whose oldest reply is ``timeout`` seconds late is dropped and fails
its calls with ``TimeoutError``. The next call connects again.

Where it connects is looked up on every (re)connect when a ``resolver`` is given
(Sentinel: the primary promoted after a failover is found again).

With ``durability`` (``settings.durability``, gateway/link/durability.py), each write
that carries a claim ends with one ``WAIT`` (or ``WAITAOF``) on the same connection,
and each claim of that write succeeds only when it confirms enough replicas (group
commit: one replication round trip for the whole write, however many claims it
carries; a ``WAIT`` after each claim would cost one round trip each, since a
blocked client's next command waits for it). Not confirmed in time:
``StoreUnavailable`` (503).

On Redis Cluster, ``ClusterPipeline`` (gateway/link/cluster_pipeline.py, which builds
on this module and also chooses between the two: ``pipeline_for``) keeps one such
connection per primary and routes each call by its hash slot, following ``MOVED``
and ``ASK``.

Plain TCP and unix sockets only; for other connections (TLS) ``for_client``
returns None and the store calls through redis-py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import hiredis
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.commands.core import AsyncScript

from gateway.link.durability import FSYNC_SLICE, check_confirmed, confirm_command, is_confirmed
from gateway.link.reply_errors import error_of

if TYPE_CHECKING:
    from gateway.model.config import Durability

log = logging.getLogger("realm")

# Looked up on every (re)connect: the fields of the address to use now (``host`` and
# ``port``, or ``path``), laid over the static address (which keeps the credentials).
Resolver = Callable[[], Awaitable[Mapping[str, Any]]]

_ASKING = hiredis.pack_command((b"ASKING",))

# Writes on one connection whose replies are still due, at most: while there are
# this many, what comes is held and goes out in one write as the oldest is answered
# (see _Connection). Two, not one: Redis always has the next write queued while it
# runs one, so it never waits for the gateway's loop to come round to its replies
# (a loop turn under load is milliseconds); and while Redis is behind (a long
# script, or no CPU for it), the claims of every turn meanwhile share one write.
MAX_WRITES_IN_FLIGHT = 2


class NotConnected(redis_errors.ConnectionError):
    """The connection could not be made: nothing was sent, so the call may go
    elsewhere (another node, after a fresh slot map)."""


class Pipeline:
    """Sends commands on one connection as they come and matches replies in order."""

    def __init__(
        self,
        address: Mapping[str, Any],
        timeout: float,
        connect_timeout: float,
        *,
        resolver: Resolver | None = None,
        durability: Durability | None = None,
    ) -> None:
        """``address``: host and port, or path, plus db, username and password, as in
        redis-py's connection kwargs. ``timeout``: how late a reply may be before the
        connection is given up on. ``resolver``: where to connect, asked on every
        (re)connect (its fields override the address's). ``durability``: confirm
        each script call's writes on replicas (and fsyncs) before returning it."""
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.resolver = resolver
        self.durability = durability
        self._confirm = confirm_command(durability) if durability else None
        # Script calls may skip ``send`` (one call less each) unless it has work to
        # do: a confirmation, or a subclass's own (gateway/link/sentinel.py).
        self._direct = durability is None and type(self).send is Pipeline.send
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    @classmethod
    def for_client(
        cls,
        redis: Redis,
        timeout: float,
        *,
        durability: Durability | None = None,
        resolver: Resolver | None = None,
    ) -> Pipeline | None:
        """A pipeline to the server ``redis`` talks to, or None if its kind of
        connection is not one this module speaks (TLS, say)."""
        pool = redis.connection_pool
        kind = pool.connection_class
        if issubclass(kind, SSLConnection) or (
            # With a resolver (Sentinel), a subclass that finds its server itself is fine.
            resolver is None and kind not in (Connection, UnixDomainSocketConnection)
        ):
            return None
        kwargs = pool.connection_kwargs
        connect_timeout = kwargs.get("socket_connect_timeout") or timeout
        return cls(kwargs, timeout, connect_timeout, resolver=resolver, durability=durability)

    async def evalsha(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """``EVALSHA`` ``script``: its reply, or the error Redis or the connection gave.
        With durability, only once its writes are confirmed (else StoreUnavailable)."""
        command = hiredis.pack_command((b"EVALSHA", script.sha, len(keys), *keys, *args))
        if self._direct:  # the hot path, as lean as before durability existed
            conn = self._conn
            if conn is None or conn.closed:
                conn = await self._connect()
            reply = await conn.send(command)
        else:
            reply = await self.send(command)
        if isinstance(reply, redis_errors.NoScriptError):
            # The server lost its script cache (restart, SCRIPT FLUSH): the call did
            # not run, so load the script and send it once more.
            await self.execute(b"SCRIPT", b"LOAD", script.script)
            reply = await self.send(command)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def execute(self, *args: Any) -> Any:
        """Any other command (never confirmed): its reply, or raises the error."""
        reply = await self.send(hiredis.pack_command(args), confirm=False)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def send(self, command: bytes, *, asking: bool = False, confirm: bool = True) -> Any:
        """One packed command: its reply (an error reply as a value). ``asking``: send
        ``ASKING`` right before it, on the same connection (a cluster's ASK).
        Raises on connection trouble, and StoreUnavailable when durability is set
        and the command's writes are not confirmed in time."""
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connect()
        if asking:
            # Its +OK (or its failure, which the command shares) is not waited for.
            _quiet(conn.send(_ASKING))
        if self._confirm is None or not confirm:
            return await conn.send(command)
        if self.durability.fsync:  # type: ignore[union-attr]
            # WAITAOF goes after the reply, not in the same write: a replica answers
            # the primary's ack request with the offset it has fsynced so far, and one
            # that reads the writes and the request together has not fsynced them yet;
            # it then tells only on its once-a-second ack (1 s a claim, measured).
            reply = await conn.send(command)
            if isinstance(reply, Exception):
                return reply
            durability = cast("Durability", self.durability)
            loop = asyncio.get_running_loop()
            until = loop.time() + durability.timeout - FSYNC_SLICE
            while not is_confirmed(durability, confirmed := await conn.confirm(self._confirm)):
                if loop.time() >= until or isinstance(confirmed, Exception):
                    check_confirmed(durability, confirmed)
            return reply
        reply_future, confirmed_future = conn.send_confirmed(command, self._confirm)
        _quiet(confirmed_future)  # the reply's own failure is what its caller sees
        reply = await reply_future
        confirmed = await confirmed_future
        if not isinstance(reply, Exception):
            check_confirmed(self.durability, confirmed)  # type: ignore[arg-type]
        return reply

    async def _connect(self) -> _Connection:
        # Callers that arrive while a connection is being made wait for that one; a
        # caller that gives up (its deadline) leaves it to finish for the others.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            # The connect itself was cancelled (close(): a node left the cluster map),
            # not this caller: that is a connection failure (503), not a cancel for the
            # caller to pass on (which made the delivery a 500).
            task = asyncio.current_task()
            if connecting.cancelled() and task is not None and not task.cancelling():
                raise NotConnected("the connection was closed while it was being made") from None
            raise

    def _connected(self, connecting: asyncio.Future[_Connection]) -> None:
        # Runs before the waiting callers resume, and also when none is left.
        self._connecting = None
        if not connecting.cancelled() and connecting.exception() is None:
            self._conn = connecting.result()

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        a = self.address
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.resolver is not None:
                    a = {**a, **(await self.resolver())}
                if a.get("path"):
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(self.timeout), a["path"]
                    )
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self.timeout), a.get("host", "localhost"),
                        a.get("port", 6379),
                    )  # fmt: skip
        except (OSError, TimeoutError, redis_errors.RedisError) as exc:
            where = a.get("path") or f"{a.get('host', 'localhost')}:{a.get('port', 6379)}"
            if isinstance(exc, TimeoutError):
                reason: object = "timed out"
            elif isinstance(exc, OSError):
                reason = exc.strerror or exc
            else:  # the resolver's own trouble (no Sentinel answers, say)
                reason = exc
            raise NotConnected(f"cannot connect to {where}: {reason}") from None
        try:
            # The handshake redis-py would make: AUTH, then SELECT.
            if a.get("password"):
                auth = [a["username"]] if a.get("username") else []
                await self._checked(conn, b"AUTH", *auth, a["password"])
            if a.get("db"):
                await self._checked(conn, b"SELECT", a["db"])
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    async def _checked(conn: _Connection, *args: Any) -> None:
        reply = await conn.send(hiredis.pack_command(args))
        if isinstance(reply, Exception):
            raise reply

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _quiet(future: asyncio.Future[Any]) -> None:
    """A future whose failure may go unread (asyncio would log it as never retrieved)."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


# -- one connection ----------------------------------------------------------------------


class _Fanout:
    """The waiting entry of a write's confirmation: its one reply goes to the future
    of each call of that write (each caller awaits its own, so one giving up
    cancels nothing for the others)."""

    __slots__ = ("futures",)

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[Any]] = []

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def set_result(self, reply: Any) -> None:
        for f in self.futures:
            if not f.done():
                f.set_result(reply)

    def set_exception(self, error: BaseException) -> None:
        for f in self.futures:
            if not f.done():
                f.set_exception(error)


class _Connection(asyncio.Protocol):
    """One socket: a write per loop turn at most (fewer while Redis is behind),
    replies dispatched as they arrive."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.closed = False
        self._transport: asyncio.Transport | None = None
        # Error replies become redis-py's public exception classes (reply_errors.py).
        self._reader = hiredis.Reader(
            protocolError=redis_errors.InvalidResponse, replyError=error_of
        )
        # One entry per command sent or about to be, oldest first: its future and
        # the loop time by which its reply is due.
        self._waiting: collections.deque[tuple[Any, float]] = collections.deque()
        self._out: list[bytes] = []
        # The next write's confirmation (durability): its command and who waits for it.
        self._confirm: tuple[bytes, _Fanout] | None = None
        # The writes on their way, oldest first: [replies still due, carries a
        # confirmation]. While MAX_WRITES_IN_FLIGHT of them are, or one carrying a
        # confirmation is, what comes is held, and written as one the moment the
        # oldest is answered (in data_received). Sent at once, it would only queue on
        # the server behind them; held, the commands of several loop turns share one
        # write (each write on loopback TCP costs the sender the receiver's half of
        # the stack too, and Redis a read). Otherwise a command goes out at the end
        # of its loop turn, with the others of that turn: at low load, nothing waits.
        # With durability the write's confirmation is its last reply: group commit,
        # one WAIT per write, and never a WAIT queued behind another one (Redis 7.0
        # answers that one only on its next cron tick, up to 100 ms, measured).
        self._in_flight: collections.deque[list[int]] = collections.deque()
        self._held = False  # as said above: MAX_WRITES_IN_FLIGHT or a confirmation
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Queue ``command`` for the next write; the future gets its reply."""
        future = self._loop.create_future()
        if self.closed:
            future.set_exception(redis_errors.ConnectionError("connection to Redis lost"))
            return future
        self._waiting.append((future, self._loop.time() + self.timeout))
        if not self._held and not self._out and self._confirm is None:
            # The first since the last write: it goes at the end of this turn (the
            # next pass of the loop's ready queue), with whatever comes meanwhile.
            self._loop.call_soon(self._write)
        self._out.append(command)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self.timeout, self._check_late)
        return future

    def send_confirmed(
        self, command: bytes, confirm: bytes
    ) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
        """``send``, and ``confirm`` once at the end of this turn's write: the second
        future gets its reply, which covers every write before it."""
        future = self.send(command)
        return future, self.confirm(confirm)

    def confirm(self, confirm: bytes) -> asyncio.Future[Any]:
        """``confirm`` once at the end of this turn's write, for every caller of the
        turn: the future gets its reply, which covers every write before it."""
        confirmed = self._loop.create_future()
        if self.closed:
            confirmed.set_exception(redis_errors.ConnectionError("connection to Redis lost"))
            return confirmed
        if self._confirm is None:
            if not self._held and not self._out:
                self._loop.call_soon(self._write)
            self._confirm = (confirm, _Fanout())
        self._confirm[1].futures.append(confirmed)
        return confirmed

    def _write(self) -> None:
        if self._held or self.closed or not (self._out or self._confirm):
            return
        out, self._out = self._out, []
        confirms = self._confirm is not None
        if self._confirm is not None:
            # Last in the write, so its reply comes after every reply of the write.
            command, fanout = self._confirm
            self._confirm = None
            out.append(command)
            self._waiting.append((fanout, self._loop.time() + self.timeout))
        self._in_flight.append([len(out), confirms])
        self._held = confirms or len(self._in_flight) >= MAX_WRITES_IN_FLIGHT
        if self._transport is not None:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        while True:
            try:
                reply = reader.gets()
            except redis_errors.InvalidResponse as exc:
                self._fail(exc)
                return
            if reply is False:
                break
            in_flight = self._in_flight
            if not in_flight:
                self._fail(redis_errors.InvalidResponse("a reply that no command asked for"))
                return
            oldest = in_flight[0]
            oldest[0] -= 1
            if not oldest[0]:  # that write is answered
                in_flight.popleft()
                self._held = len(in_flight) >= MAX_WRITES_IN_FLIGHT or any(w[1] for w in in_flight)
            future, _ = waiting.popleft()
            if future.done():  # its caller gave up (a deadline passed)
                continue
            # An error reply is handed over as the reply: the caller raises it, or
            # loads the script and goes again on NOSCRIPT.
            future.set_result(reply)
        if not self._held and (self._out or self._confirm is not None):
            # A write is answered: what was held goes out now, as one.
            self._write()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(redis_errors.ConnectionError("connection to Redis lost"))

    # -- failure ---------------------------------------------------------------------

    def _check_late(self) -> None:
        self._watchdog = None
        if not self._waiting or self.closed:
            return
        _, due = self._waiting[0]
        now = self._loop.time()
        if due <= now:
            self._fail(redis_errors.TimeoutError(f"no reply from Redis within {self.timeout:g} s"))
        else:
            self._watchdog = self._loop.call_later(due - now, self._check_late)

    def _fail(self, error: Exception) -> None:
        """Give up on this connection: every call on it gets ``error``."""
        self.closed = True
        self._in_flight.clear()
        if self._transport is not None:
            self._transport.abort()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._confirm is not None:  # queued, never written
            self._confirm[1].set_exception(error)
            self._confirm = None
        while self._waiting:
            future, _ = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._fail(redis_errors.ConnectionError("connection to Redis closed"))
