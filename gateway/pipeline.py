"""One pipelined connection to Redis for the listener's claims.

Under load many deliveries reach their claim at once. Through redis-py each
claim pays a pool checkout, a write, a read per reply and a parse, all in
Python: measured, that was most of a delivery's CPU. Here the claims share
one connection: the ``EVALSHA`` commands made in one turn of the event loop
go out in one write, and each chunk the socket delivers is fed to hiredis,
whose replies are handed to their callers in order, straight from
``data_received``: no task, stream or timer per call. Each call still runs as
its own atomic script, and its reply or error reaches its own caller.

Errors are redis-py's exception classes (the store maps them to outcomes):
a dropped connection fails every call on it with ``ConnectionError``, and a
connection whose oldest reply is ``timeout`` seconds late is dropped and fails
its calls with ``TimeoutError``. The next call connects again.

Plain TCP and unix sockets only; for other connections (TLS) ``for_client``
returns None and the store calls through redis-py.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from typing import Any, cast

import hiredis
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.commands.core import AsyncScript


class Pipeline:
    """Sends commands on one connection as they come and matches replies in order."""

    def __init__(self, address: Mapping[str, Any], timeout: float, connect_timeout: float) -> None:
        """``address``: host and port, or path, plus db, username and password, as in
        redis-py's connection kwargs. ``timeout``: how late a reply may be before the
        connection is given up on."""
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    @classmethod
    def for_client(cls, redis: Redis, timeout: float) -> Pipeline | None:
        """A pipeline to the server ``redis`` talks to, or None if its kind of
        connection is not one this module speaks (TLS, say)."""
        pool = redis.connection_pool
        if pool.connection_class not in (Connection, UnixDomainSocketConnection):
            return None
        kwargs = pool.connection_kwargs
        connect_timeout = kwargs.get("socket_connect_timeout") or timeout
        return cls(kwargs, timeout, connect_timeout)

    async def evalsha(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """``EVALSHA`` ``script``: its reply, or the error Redis or the connection gave."""
        command = hiredis.pack_command((b"EVALSHA", script.sha, len(keys), *keys, *args))
        reply = await self._send(command)
        if isinstance(reply, redis_errors.NoScriptError):
            # The server lost its script cache (restart, SCRIPT FLUSH): the call did
            # not run, so load the script and send it once more.
            await self.execute(b"SCRIPT", b"LOAD", script.script)
            reply = await self._send(command)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def execute(self, *args: Any) -> Any:
        """Any other command: its reply, or raises the error."""
        reply = await self._send(hiredis.pack_command(args))
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _send(self, command: bytes) -> Any:
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connect()
        return await conn.send(command)

    async def _connect(self) -> _Connection:
        # Callers that arrive while a connection is being made wait for that one; a
        # caller that gives up (its deadline) leaves it to finish for the others.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

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
                if a.get("path"):
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(self.timeout), a["path"]
                    )
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self.timeout), a.get("host", "localhost"),
                        a.get("port", 6379),
                    )  # fmt: skip
        except (OSError, TimeoutError) as exc:
            where = a.get("path") or f"{a.get('host', 'localhost')}:{a.get('port', 6379)}"
            reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or exc
            raise redis_errors.ConnectionError(f"cannot connect to {where}: {reason}") from None
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


class _Connection(asyncio.Protocol):
    """One socket: a write per event-loop turn, replies dispatched as they arrive."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.closed = False
        self._transport: asyncio.Transport | None = None
        # Error replies become redis-py's exception classes through redis-py's own
        # mapping (a private module, but the classes the store catches are its own).
        self._reader = hiredis.Reader(
            protocolError=redis_errors.InvalidResponse, replyError=BaseParser.parse_error
        )
        # One entry per command sent or about to be, oldest first: its future and
        # the loop time by which its reply is due.
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._out: list[bytes] = []
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Queue ``command`` for this turn's write; the future gets its reply."""
        future = self._loop.create_future()
        if self.closed:
            future.set_exception(redis_errors.ConnectionError("connection to Redis lost"))
            return future
        self._waiting.append((future, self._loop.time() + self.timeout))
        if not self._out:
            self._loop.call_soon(self._write)
        self._out.append(command)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self.timeout, self._check_late)
        return future

    def _write(self) -> None:
        out, self._out = self._out, []
        if self._transport is not None and not self.closed:
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
                return
            if not waiting:
                self._fail(redis_errors.InvalidResponse("a reply that no command asked for"))
                return
            future, _ = waiting.popleft()
            if future.done():  # its caller gave up (a deadline passed)
                continue
            # An error reply is handed over as the reply: the caller raises it, or
            # loads the script and goes again on NOSCRIPT.
            future.set_result(reply)

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
        if self._transport is not None:
            self._transport.abort()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self._waiting:
            future, _ = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._fail(redis_errors.ConnectionError("connection to Redis closed"))
