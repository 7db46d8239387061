"""Redis behind Sentinel: ``redis+sentinel://`` URLs, a client that follows the primary.

    redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db][?options]

The hosts are sentinels (port 26379 when left out), ``service`` is the name the
sentinels monitor (``sentinel monitor <service> ...``), ``db`` the database
number (0). The password (and user) are the data nodes'; ``password@`` alone,
without a colon, is a password too. Options: ``sentinel_password`` and
``sentinel_username`` when the sentinels themselves ask for a password
(``requirepass`` in sentinel.conf).

The client (redis-py's Sentinel support, for the CLI, the API and MCP) and the
listener's pipelined connection (``FollowingPipeline``) ask the sentinels for
the current primary whenever they connect, so after a failover their next
connection goes to the promoted replica: no restart. A connection still open to
a primary that was demoted gets READONLY, which drops that connection; the call
fails (503: nothing was written) and the retry connects anew. TLS to the
sentinels or the data nodes is not supported yet (the scheme has no ``rediss``
form).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from gateway.link.pipeline import Pipeline
from gateway.link.pool import QueuedPool

if TYPE_CHECKING:
    from gateway.model.config import Durability

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
OPTIONS = ("sentinel_password", "sentinel_username")


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url[: len(SENTINEL_SCHEME) + 3].lower() == SENTINEL_SCHEME + "://"


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a ``redis+sentinel://`` URL, or ValueError saying what is wrong
    (never quoting the URL: the caller shows it redacted)."""
    if not is_sentinel_url(url):
        raise ValueError(f"it must start with {SENTINEL_SCHEME}://")
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    rest = rest.split("#", 1)[0]
    netloc, slash, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        # Up to the last '@': a password may hold an unescaped '@'.
        userinfo, netloc = netloc.rsplit("@", 1)
        if ":" in userinfo:
            user, password = (unquote(p) for p in userinfo.split(":", 1))
            username = user or None
        else:
            password = unquote(userinfo)
        password = password or None
    sentinels = tuple(_host_port(item) for item in netloc.split(","))
    parts = [p for p in path.split("/")] if slash else []
    if not parts or not parts[0]:
        raise ValueError("the service name is missing: redis+sentinel://host:port/<service>")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("the path must be /<service> or /<service>/<db number>")
    db = int(parts[1]) if len(parts) == 2 else 0
    try:
        options = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError("the query string is malformed") from None
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}; allowed: {', '.join(OPTIONS)}")
    return SentinelUrl(
        sentinels=sentinels,
        service=unquote(parts[0]),
        db=db,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username", [None])[-1] or None,
        sentinel_password=options.get("sentinel_password", [None])[-1] or None,
    )


def _host_port(item: str) -> tuple[str, int]:
    if not item:
        raise ValueError("a sentinel address is empty: list them as host:port,host:port")
    if item.startswith("["):  # [IPv6]:port
        host, _, tail = item[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
        if tail and not tail.startswith(":"):
            raise ValueError(f"sentinel address {item!r} is not host:port")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"sentinel address {item!r} has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"sentinel address {item!r}: the port must be 1-65535")
    return host, int(port_text)


class _BlockingSentinelPool(SentinelConnectionPool, QueuedPool):
    """Sentinel's pool with the queued checkout of gateway.link.connection.redis_client:
    a burst waits for a free connection (gateway/link/pool.py) instead of failing."""


def sentinel_client(url: str, timeout: float, *, max_connections: int) -> Redis:
    """A client of the service's current primary, with the settings of
    ``gateway.link.connection.redis_client`` (no hidden retries, no per-reply timeout)."""
    parts = parse_sentinel_url(url)
    no_retry = Retry(NoBackoff(), 0)
    sentinel = Sentinel(
        list(parts.sentinels),
        # Questions to a sentinel are small: a sentinel that hangs is skipped after
        # ``timeout`` and the next one asked.
        sentinel_kwargs={
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "username": parts.sentinel_username,
            "password": parts.sentinel_password,
            "retry": no_retry,
        },
    )
    return sentinel.master_for(
        parts.service,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=None,
        socket_connect_timeout=timeout,
        retry=no_retry,
        db=parts.db,
        username=parts.username,
        password=parts.password,
    )


Address = dict[str, Any]


class FollowingPipeline(Pipeline):
    """The listener's pipelined connection (gateway/link/pipeline.py) under Sentinel: it
    asks the sentinels for the primary on every (re)connect, and a READONLY reply (a
    primary that was demoted while this connection stayed open) drops the
    connection, so the next call connects to the new primary. The READONLY call
    itself fails (503: it wrote nothing, the sender's retry is decided afresh)."""

    async def send(self, command: bytes, **options: Any) -> Any:
        sent_on = self._conn
        if sent_on is None or sent_on.closed:
            sent_on = await self._connect()  # the one super().send uses: no await between
        reply = await super().send(command, **options)
        if isinstance(reply, redis_errors.ReadOnlyError):
            # Only the connection it came from: another caller may have replaced it
            # already, and a fresh connection must not be dropped for an old reply.
            if self._conn is sent_on:
                self._conn = None
            sent_on.close()
        return reply


def sentinel_pipeline(
    redis: Redis | RedisCluster, timeout: float, durability: Durability | None
) -> FollowingPipeline | None:
    """A ``FollowingPipeline`` for a client made by ``sentinel_client``; None for
    any other client, or a kind of connection the pipeline does not speak (TLS)."""
    resolver = primary_resolver(redis)
    if resolver is None:
        return None
    pipeline = FollowingPipeline.for_client(
        redis, timeout, durability=durability, resolver=resolver
    )
    return pipeline if isinstance(pipeline, FollowingPipeline) else None


def primary_resolver(redis: Redis | RedisCluster) -> Callable[[], Awaitable[Address]] | None:
    """For a client made by ``sentinel_client``: an async function that asks the
    sentinels for the current primary and answers its address as redis-py's
    connection kwargs (host, port, db, username, password), for a connection of
    the store's own (gateway/link/pipeline.py) to call on every (re)connect. None for
    any other client."""
    pool = getattr(redis, "connection_pool", None)  # a cluster client has none
    if not isinstance(pool, SentinelConnectionPool):
        return None
    kwargs = pool.connection_kwargs
    auth = {k: kwargs.get(k) for k in ("db", "username", "password")}

    async def resolve() -> Address:
        # MasterNotFoundError is a ConnectionError: the claim is 503, as for a
        # primary that cannot be reached.
        host, port = await pool.sentinel_manager.discover_master(pool.service_name)
        return {"host": host, "port": int(port), **auth}

    return resolve
