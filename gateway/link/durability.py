"""Durable acknowledgements (``settings.durability``): a claim is acknowledged only
once ``WAIT`` (or ``WAITAOF`` with fsync) on its own connection confirms its writes
on N replicas. Used by the listener's pipelined connection (gateway/link/pipeline.py:
one confirmation per write of claims) and by the store's redis-py path.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import hiredis
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from gateway.model.errors import StoreUnavailable
from gateway.model.words import plural

if TYPE_CHECKING:
    from gateway.model.config import Durability


# WAITAOF is sent in slices of at most this long, again until the whole timeout: each
# one makes the primary ask its replicas afresh. A replica answers the primary's ask
# with the offset it has fsynced so far, and one that read the writes and the ask
# together has not fsynced them yet; unasked, it tells only once a second.
FSYNC_SLICE = 0.005


def confirm_command(durability: Durability) -> bytes:
    """The command that confirms a write's writes: ``WAITAOF 1 N ms`` with fsync (it
    implies the replicas have the writes too; one slice of the timeout, see
    FSYNC_SLICE), else ``WAIT N ms``. Never a 0 timeout, which blocks for ever."""
    if durability.fsync:
        ms = max(1, round(min(durability.timeout, FSYNC_SLICE) * 1000))
        return hiredis.pack_command((b"WAITAOF", 1, durability.replicas, ms))
    ms = max(1, round(durability.timeout * 1000))
    return hiredis.pack_command((b"WAIT", durability.replicas, ms))


def is_confirmed(durability: Durability, reply: Any) -> bool:
    if isinstance(reply, Exception):
        return False
    if durability.fsync:
        local, replicas = (int(x) for x in reply)
        return local >= 1 and replicas >= durability.replicas
    return int(reply) >= durability.replicas


def check_confirmed(durability: Durability, reply: Any) -> None:
    """Raise StoreUnavailable unless ``reply`` (of ``confirm_command``) confirms
    ``durability``: the claim ran, but it must not be acknowledged (the sender's
    retry deduplicates onto it)."""
    n, timeout = durability.replicas, durability.timeout
    if isinstance(reply, Exception):
        text = str(reply)
        if durability.fsync and ("unknown command" in text.lower() or "WAITAOF" in text):
            raise StoreUnavailable(
                f"durability fsync needs WAITAOF (Redis 7.2+ or Valkey) with appendonly on "
                f"the primary; the server said: {text}"
            )
        raise StoreUnavailable(f"writes not confirmed: {text}; retry")
    if durability.fsync:
        local, replicas = (int(x) for x in reply)
        if local < 1 or replicas < n:
            raise StoreUnavailable(
                f"not fsynced on the primary and {plural(n, 'replica')} within {timeout:g} s "
                f"(primary {local}, replicas {replicas}); retry"
            )
    elif int(reply) < n:
        raise StoreUnavailable(
            f"not confirmed on {plural(n, 'replica')} within {timeout:g} s "
            f"(got {int(reply)}); retry"
        )


async def confirmed_script(
    redis: Redis, script: AsyncScript, keys: list[Any], args: list[Any], durability: Durability
) -> Any:
    """``script`` through redis-py, then the confirmation, on one connection (a
    redis-py pipeline without MULTI): a confirmation on another connection would
    confirm nothing of this one's writes."""
    if isinstance(redis, RedisCluster):
        # redis-py sends WAIT to every node of a cluster and sums the replies; the
        # store routes a cluster's scripts through ClusterPipeline instead.
        raise StoreUnavailable("durability on a TLS cluster is not supported; use plain TCP")
    confirm = ("WAITAOF", 1) if durability.fsync else ("WAIT",)
    ms = max(1, round(durability.timeout * 1000))
    if durability.fsync:
        # After the reply, as in Pipeline.send (why there); on the same connection.
        ms = max(1, round(min(durability.timeout, FSYNC_SLICE) * 1000))
        until = time.monotonic() + durability.timeout - FSYNC_SLICE
        async with redis.client() as one:
            reply = await script(keys, args, client=one)
            while True:
                try:
                    confirmed = await one.execute_command(*confirm, durability.replicas, ms)
                except redis_errors.ResponseError as exc:
                    confirmed = exc
                if is_confirmed(durability, confirmed):
                    return reply
                if time.monotonic() >= until or isinstance(confirmed, Exception):
                    check_confirmed(durability, confirmed)
    for attempt in (1, 2):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command(*confirm, durability.replicas, ms)
            reply, confirmed = await pipe.execute(raise_on_error=False)
        if isinstance(reply, redis_errors.NoScriptError) and attempt == 1:
            await redis.script_load(script.script)
            continue
        if isinstance(reply, Exception):
            raise reply
        check_confirmed(durability, confirmed)
        return reply
    raise AssertionError("unreachable")
