"""Coalesces the script calls made in one event-loop turn into one pipeline.

Under load, many deliveries reach their claim in the same turn of the loop.
Sent one by one, each pays redis-py's per-call cost (a pool checkout, a
write, a read, a parse); sent together they share one checkout, one write and
one read. Each call still runs as its own atomic script, and its reply or
error reaches its own caller: nothing about the semantics changes.

At most ``MAX_IN_FLIGHT`` pipelines are out at once; calls made meanwhile wait
for the next one (as ioredis' auto-pipelining does). At low load nothing waits;
under load the pipelines grow instead of multiplying, which is what saves work.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

# A pipeline longer than this is split: one huge write would delay every reply in it.
MAX_PIPELINE = 256
# Pipelines awaiting their replies at once: two keep the connection busy while the
# previous replies are being parsed.
MAX_IN_FLIGHT = 2

Pending = tuple[AsyncScript, list[Any], list[Any], "asyncio.Future[Any]"]


class Coalescer:
    def __init__(self, redis: Redis, timeout: float) -> None:
        self.redis = redis
        # Bounds each pipeline: the client has no socket timeout (see connection.py).
        self.timeout = timeout
        self._pending: list[Pending] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._scheduled = False
        self._pool = redis.connection_pool
        # Connections between batches: taken from the pool once, kept while they work.
        self._idle: list[Any] = []

    async def call(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """EVALSHA ``script``; the reply, or the error Redis or the connection gave."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, future))
        if not self._scheduled and len(self._tasks) < MAX_IN_FLIGHT:
            # After this turn of the loop, so the calls made in it go together.
            self._scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._scheduled = False
        loop = asyncio.get_running_loop()
        while self._pending and len(self._tasks) < MAX_IN_FLIGHT:
            batch, self._pending = self._pending[:MAX_PIPELINE], self._pending[MAX_PIPELINE:]
            task = loop.create_task(self._send(batch))
            # The set keeps a reference (the loop holds tasks only weakly) and
            # counts the pipelines in flight.
            self._tasks.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._pending and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _send(self, batch: list[Pending]) -> None:
        try:
            replies = await self._execute(batch)
            missing = [
                i for i, r in enumerate(replies) if isinstance(r, redis_errors.NoScriptError)
            ]
            if missing:
                # The server lost its script cache (restart, SCRIPT FLUSH): a NOSCRIPT
                # call did not run, so load the scripts and send just those again.
                for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                    await self.redis.script_load(script.script)
                again = await self._execute([batch[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except BaseException as exc:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else
                                         redis_errors.ConnectionError(repr(exc)))  # fmt: skip
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, future), reply in zip(batch, replies, strict=True):
            if future.done():  # the caller gave up (its deadline passed)
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _execute(self, batch: list[Pending]) -> list[Any]:
        """Send a batch as one write on a connection of our own, and read its replies.

        redis-py's pipeline packs each command argument by argument and checks a
        connection out of the pool and back in per batch: measured, that was most
        of the claim's CPU. The commands here are all EVALSHA of bytes, strings and
        ints, so they are packed directly, and the coalescer keeps its (at most
        MAX_IN_FLIGHT) connections between batches.
        """
        connection = self._idle.pop() if self._idle else await self._pool.get_connection()
        try:
            async with asyncio.timeout(self.timeout):
                # It reconnects first if the connection was dropped.
                await connection.send_packed_command(
                    b"".join(_pack_evalsha(s.sha, k, a) for s, k, a, _ in batch),
                    check_health=False,
                )
                replies: list[Any] = []
                for _ in batch:
                    try:
                        replies.append(await connection.read_response())
                    except redis_errors.ResponseError as exc:  # this call's own error
                        replies.append(exc)
        except BaseException as exc:
            # Half a request or half the replies may be on the wire: never reuse it.
            await connection.disconnect()
            await self._pool.release(connection)
            if isinstance(exc, TimeoutError):
                # As redis-py's own timeout would: callers retry it, or give up at
                # their own deadline, as for any connection trouble.
                raise redis_errors.TimeoutError(f"no reply within {self.timeout:g} s") from None
            raise
        self._idle.append(connection)
        return replies


def _pack_evalsha(sha: str, keys: list[Any], args: list[Any]) -> bytes:
    """``EVALSHA sha numkeys keys... args...`` in the Redis protocol (RESP2 array)."""
    items = [b"EVALSHA", sha.encode(), b"%d" % len(keys)]
    items += [_arg(value) for value in keys]
    items += [_arg(value) for value in args]
    return b"*%d\r\n" % len(items) + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in items)


def _arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return b"%d" % value
    raise TypeError(f"a script argument must be bytes, str or int, not {type(value).__name__}")
