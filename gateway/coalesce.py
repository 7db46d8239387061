"""Coalesces the script calls made in one event-loop turn into one pipeline.

Under load, many deliveries reach their claim in the same turn of the loop.
Sent one by one, each pays redis-py's per-call cost (a pool checkout, a
write, a read, a parse); sent together they share one checkout, one write and
one read. Each call still runs as its own atomic script, and its reply or
error reaches its own caller: nothing about the semantics changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

# A pipeline longer than this is split: one huge write would delay every reply in it.
MAX_PIPELINE = 256

Pending = tuple[AsyncScript, list[Any], list[Any], "asyncio.Future[Any]"]


class Coalescer:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._pending: list[Pending] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def call(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """EVALSHA ``script``; the reply, or the error Redis or the connection gave."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((script, keys, args, future))
        return await future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), MAX_PIPELINE):
            task = asyncio.get_running_loop().create_task(
                self._send(pending[start : start + MAX_PIPELINE])
            )
            # Keep a reference: the loop holds tasks only weakly.
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return await pipe.execute(raise_on_error=False)
