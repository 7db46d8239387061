"""The listener's claims on a Redis Cluster: one pipelined connection
(gateway/link/pipeline.py) per primary, each call routed by its hash slot, following
``MOVED``, ``ASK`` and ``TRYAGAIN`` within the claim's deadline, and a fresh slot
map when a node goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import hiredis
from prometheus_client import Counter
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from gateway.link.pipeline import NotConnected, Pipeline
from gateway.model.errors import StoreUnavailable

if TYPE_CHECKING:
    from gateway.model.config import Durability

log = logging.getLogger("realm")

REDIRECTIONS = Counter(
    "realm_redis_redirections_total",
    "Redis Cluster replies the listener's claims followed: moved (the slot has a new "
    "owner), ask (the slot is migrating), tryagain (its keys are split by a migration)",
    ["kind"],
)

# Redirections and retries one call may follow (the caller's deadline bounds the time).
MAX_REDIRECTS = 64


class ClusterPipeline:
    """One ``Pipeline`` per primary of a Redis Cluster, each call sent to the primary
    that owns its hash slot (the slot of its first key: all keys of a script share
    one hash tag).

    ``MOVED``: the slot has a new owner; the map takes it at once, is refreshed from
    the cluster in the background, and the call goes again. ``ASK``: the slot is
    being migrated and the key is already on the target; the call goes there after
    ``ASKING``, the map unchanged. ``TRYAGAIN`` (a multi-key call while its keys are
    split by a migration): again after a short pause. A node that refuses
    connections: the map is refreshed and the call goes again. All of these mean
    the command did not run, so resending it is safe. A connection dropped after
    sending is an unknown outcome and raises (the store answers 503; its retry
    deduplicates); the map is refreshed for the next call.
    """

    def __init__(
        self,
        seeds: list[tuple[str, int]],
        credentials: Mapping[str, Any],
        timeout: float,
        connect_timeout: float,
        *,
        durability: Durability | None = None,
    ) -> None:
        self.seeds = list(seeds)
        self.credentials = dict(credentials)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.durability = durability
        # Counters, also in /metrics (gateway/serving/metrics.py).
        self.moved = 0
        self.asked = 0
        self.tryagain = 0
        self.refreshes = 0
        self._slots: list[tuple[str, int] | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._nodes: dict[tuple[str, int], Pipeline] = {}
        self._refreshing: asyncio.Task[None] | None = None

    @classmethod
    def for_client(
        cls, redis: RedisCluster, timeout: float, *, durability: Durability | None = None
    ) -> ClusterPipeline | None:
        kwargs = redis.get_connection_kwargs()
        if kwargs.get("connection_class", Connection) is not Connection or kwargs.get("ssl"):
            return None
        seeds = [(n.host, int(n.port)) for n in redis.nodes_manager.startup_nodes.values()]
        credentials = {k: kwargs[k] for k in ("username", "password") if kwargs.get(k)}
        connect_timeout = kwargs.get("socket_connect_timeout") or timeout
        return cls(seeds, credentials, timeout, connect_timeout, durability=durability)

    async def evalsha(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """``EVALSHA`` on the primary owning the slot of ``keys[0]``: as Pipeline.evalsha."""
        first = keys[0]
        slot = key_slot(first.encode() if isinstance(first, str) else first)
        command = hiredis.pack_command((b"EVALSHA", script.sha, len(keys), *keys, *args))
        target: tuple[str, int] | None = None
        asking = False
        loaded: set[tuple[str, int]] = set()
        for attempt in range(MAX_REDIRECTS):
            if target is None:
                target = await self._owner(slot)
            node = self._node(target)
            try:
                reply = await node.send(command, asking=asking)
            except NotConnected:
                # Nothing was sent: the node is gone. Ask the others who serves the
                # slot now (after a failover, its promoted replica) and go again.
                await self.refresh(avoid=target)
                target, asking = None, False
                await asyncio.sleep(_pause(attempt))
                continue
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                self._refresh_soon()
                raise
            if not isinstance(reply, redis_errors.ResponseError):
                return reply
            if isinstance(reply, redis_errors.MovedError):
                self.moved += 1
                REDIRECTIONS.labels("moved").inc()
                target, asking = (reply.host, reply.port), False
                self._slots[slot] = target
                self._refresh_soon()
            elif isinstance(reply, redis_errors.AskError):
                self.asked += 1
                REDIRECTIONS.labels("ask").inc()
                target, asking = (reply.host, reply.port), True
            elif isinstance(reply, redis_errors.TryAgainError):
                self.tryagain += 1
                REDIRECTIONS.labels("tryagain").inc()
                target, asking = None, False
                await asyncio.sleep(_pause(attempt))
            elif isinstance(reply, redis_errors.NoScriptError) and target not in loaded:
                loaded.add(target)
                await node.execute(b"SCRIPT", b"LOAD", script.script)
            else:
                raise reply
        raise StoreUnavailable(f"slot {slot} kept moving ({MAX_REDIRECTS} redirections); retry")

    async def _owner(self, slot: int) -> tuple[str, int]:
        owner = self._slots[slot]
        if owner is None:
            await self.refresh()
            owner = self._slots[slot]
            if owner is None:
                raise redis_errors.ClusterDownError(f"CLUSTERDOWN no node serves slot {slot}")
        return owner

    def _node(self, address: tuple[str, int]) -> Pipeline:
        node = self._nodes.get(address)
        if node is None:
            host, port = address
            node = Pipeline(
                {**self.credentials, "host": host, "port": port},
                self.timeout, self.connect_timeout, durability=self.durability,
            )  # fmt: skip
            self._nodes[address] = node
        return node

    def _refresh_soon(self) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh(None))
            self._refreshing.add_done_callback(self._refreshed)

    async def refresh(self, avoid: tuple[str, int] | None = None) -> None:
        """Read the slot map again (one read at a time; callers share it)."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh(avoid))
            self._refreshing.add_done_callback(self._refreshed)
        await asyncio.shield(self._refreshing)

    def _refreshed(self, task: asyncio.Future[None]) -> None:
        self._refreshing = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("cluster slot map not refreshed: %s", task.exception())

    async def _refresh(self, avoid: tuple[str, int] | None) -> None:
        known = list(dict.fromkeys([a for a in self._slots if a is not None]))
        candidates = [a for a in dict.fromkeys([*known, *self.seeds]) if a != avoid]
        if avoid is not None:
            candidates.append(avoid)
        last: Exception | None = None
        for address in candidates:
            try:
                reply = await self._node(address).execute(b"CLUSTER", b"SLOTS")
            except (redis_errors.RedisError, OSError) as exc:
                last = exc
                continue
            slots: list[tuple[str, int] | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
            for lo, hi, primary, *_ in reply:
                host = primary[0].decode() if primary[0] else address[0]
                owner = (host, int(primary[1]))
                slots[lo : hi + 1] = [owner] * (hi - lo + 1)
            self._slots = slots
            self.refreshes += 1
            # Connections to nodes that serve nothing any more are closed.
            owners = set(slots)
            for gone in [a for a in self._nodes if a not in owners and a not in self.seeds]:
                self._nodes.pop(gone).close()
            return
        raise redis_errors.ConnectionError(f"no cluster node answered CLUSTER SLOTS: {last}")

    def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        for node in self._nodes.values():
            node.close()
        self._nodes.clear()


def _pause(attempt: int) -> float:
    """A short, growing pause before going again (a migration or failover in progress)."""
    return min(0.1, 0.002 * (2 ** min(attempt, 6)))


def pipeline_for(
    redis: Redis | RedisCluster, timeout: float, *, durability: Durability | None = None
) -> Pipeline | ClusterPipeline | None:
    """A pipeline to the server (or cluster) ``redis`` talks to, or None if its kind
    of connection is not one the pipelines speak (TLS, say)."""
    if isinstance(redis, RedisCluster):
        return ClusterPipeline.for_client(redis, timeout, durability=durability)
    return Pipeline.for_client(redis, timeout, durability=durability)


def script_pipeline(
    redis: Redis | RedisCluster, timeout: float, pipelined: bool, durability: Durability | None
) -> Pipeline | ClusterPipeline | None:
    """The store's pipeline for its script calls: when ``pipelined`` (the listener),
    and for a cluster with durability (where redis-py cannot confirm a write: it
    sends WAIT to every node); None means through redis-py."""
    if pipelined or (durability is not None and isinstance(redis, RedisCluster)):
        return pipeline_for(redis, timeout, durability=durability)
    return None
