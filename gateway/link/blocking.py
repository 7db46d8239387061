"""Blocking reads of consumer groups (XREADGROUP ... BLOCK) on a connection of their own.

An idle runner waits on Redis for the next ready step rather than polling on a timer
(gateway/store/steps.py, ``wait_for_steps``). Its read holds a connection for as long
as it blocks, so that connection is not one of the client's pool, which the store's
calls share: a ``BlockingReader`` has one connection of its own, made with the pool's
settings (the URL's password, TLS, the primary Sentinel names, a cluster node's
address). A reader can be stopped at once: CLIENT UNBLOCK, sent on another connection,
ends the read as its timeout would, and hands no entry to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster

# One entry read: the stream, the entry's id, its fields.
Entry = tuple[str, str, Mapping[bytes, bytes]]


async def server_of(redis: Redis | RedisCluster, key: str) -> str:
    """The name of the server ``key`` lives on: a cluster node's, or '' for one server
    (the primary, under Sentinel)."""
    if not isinstance(redis, RedisCluster):
        return ""
    await redis.initialize()  # the slot map, once
    return str(redis.get_node_from_key(key).name)


def slot_of(redis: Redis | RedisCluster, key: str) -> int:
    """The cluster slot of ``key`` (0 for one server): one blocking read names keys
    of one slot only."""
    return int(redis.keyslot(key)) if isinstance(redis, RedisCluster) else 0


class BlockingReader:
    """Blocking group reads, one at a time, on one connection of its own to the server
    ``key`` lives on (``server_of`` first, for a cluster's slot map)."""

    def __init__(self, redis: Redis | RedisCluster, key: str) -> None:
        if isinstance(redis, RedisCluster):
            node = redis.get_node_from_key(key)
            self._settings: tuple[Any, dict[str, Any]] = (
                node.connection_class,
                node.connection_kwargs,
            )
        else:
            pool = redis.connection_pool
            self._settings = (pool.connection_class, pool.connection_kwargs)
        self._client = self._connect()
        # The server's id of the connection, for CLIENT UNBLOCK: asked once, as the
        # connection is the same until an error or a cancel, after which the caller
        # drops this reader.
        self._client_id: int | None = None

    def _connect(self) -> Redis:
        connection_class, kwargs = self._settings
        pool = ConnectionPool(connection_class=connection_class, max_connections=1, **kwargs)
        return Redis.from_pool(pool)

    async def read_group(
        self,
        group: str,
        consumer: str,
        streams: Sequence[str],
        *,
        count: int,
        block_ms: int,
        timeout: float,
        stop: asyncio.Event | None = None,
    ) -> list[Entry]:
        """New entries (``>``) of ``streams`` for ``consumer`` of ``group``, at most
        ``count`` per stream; waits up to ``block_ms`` for the first one, or until
        ``stop`` is set ([] then). ``timeout``: how long past ``block_ms`` Redis may take
        to answer; then TimeoutError (the connection is dropped). Raises redis-py's
        errors as they come."""
        async with asyncio.timeout(block_ms / 1000 + timeout):
            if stop is not None and self._client_id is None:
                self._client_id = int(await self._client.client_id())
            read = asyncio.ensure_future(
                self._client.xreadgroup(
                    group, consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms
                )
            )
            try:
                if stop is not None:
                    stopped = asyncio.ensure_future(stop.wait())
                    try:
                        await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stopped.cancel()
                    if not read.done():
                        await self._unblock(self._client_id)
                reply = await read
            finally:
                # This call cancelled (or out of time): the read goes with it, and
                # redis-py drops its connection.
                read.cancel()
        return [
            (_text(stream), _text(entry_id), fields or {})
            for stream, found in reply or []
            for entry_id, fields in found
        ]

    async def _unblock(self, client_id: int | None) -> None:
        # A connection of its own for the one command: the reader's is blocked.
        other = self._connect()
        try:
            await other.client_unblock(client_id)
        finally:
            await other.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
