"""Opens the Redis the gateway uses: a URL, or the embedded server."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_plus

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url

from gateway.link.cluster_client import cluster_client, is_cluster_url, ping_every_primary
from gateway.link.embedded import EmbeddedServer
from gateway.link.pool import QueuedPool
from gateway.link.sentinel import (
    SENTINEL_SCHEME,
    is_sentinel_url,
    parse_sentinel_url,
    sentinel_client,
)

DEFAULT_DATA_DIR = ".realm"
# Connections per client (per worker process): what redis-py's own pool allows.
MAX_CONNECTIONS = 100


def redis_client(
    url: str, timeout: float, *, max_connections: int | None = None
) -> Redis | RedisCluster:
    """An asyncio client: of one server, of a cluster (``redis+cluster://``, see
    gateway/link/cluster_client.py) or of a primary under Sentinel (gateway/link/sentinel.py).
    No hidden retries: the store decides what to retry
    (``RunStore._retrying``) within one deadline per operation.

    No ``socket_timeout``: redis-py would wrap every single reply it reads in a
    timeout of its own, which costs more CPU than the reply (half of reconcile's
    time, measured). The store's deadline (``settings.redis_timeout``) bounds each
    operation instead (the listener's own pipelined connection has a watchdog of
    its own, gateway/link/pipeline.py); a read they cancel drops its connection.
    Connecting keeps its own timeout.

    A queued pool (gateway/link/pool.py): when all its connections are busy, a call
    waits for one, and its operation's deadline does not run while it waits; past
    ``MAX_WAITING`` waiting calls it is refused at once (503 ``OVERLOADED``). redis-py's
    default pool refuses the 101st concurrent call, and a wait counted in the deadline
    made a burst of 250 admin reads answer 503 STORE_UNAVAILABLE on a healthy Redis."""
    if is_cluster_url(url):
        return cluster_client(url, timeout, max_connections=max_connections)
    if is_sentinel_url(url):
        return sentinel_client(url, timeout, max_connections=max_connections or MAX_CONNECTIONS)
    pool = QueuedPool.from_url(
        url,
        max_connections=max_connections or MAX_CONNECTIONS,
        socket_timeout=None,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )
    return Redis.from_pool(pool)


async def ping_url(url: str, timeout: float) -> None:
    """``ping_every_primary`` on a client of its own, within ``timeout``: raises a
    ``redis.RedisError`` saying why not."""
    client = redis_client(url, timeout)
    try:
        async with asyncio.timeout(timeout):
            await ping_every_primary(client)
    except TimeoutError:
        raise redis_errors.TimeoutError(f"no answer within {timeout:g} s") from None
    finally:
        await client.aclose()


def redact_url(url: str) -> str:
    """The URL without its password, fit for logs, banners and error messages: the
    one in the user part (``redis://:pw@host``) and a ``password`` query argument
    (``unix:///run/redis.sock?password=pw``, which redis-py reads too). Worked on
    as text, so the rest of the URL is shown exactly as it was given."""
    base, sep, query = url.partition("?")
    if sep:
        query = _redact_query(query)
    scheme, slashes, rest = base.partition("://")
    if slashes and "@" in rest:
        # Up to the last '@': a password holding an unescaped '/' or '@' stays hidden.
        userinfo, after = rest.rsplit("@", 1)
        if ":" in userinfo:
            base = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{after}"
        elif scheme.lower() == SENTINEL_SCHEME:  # `password@`: that scheme has no bare user
            base = f"{scheme}://***@{after}"
    return base + sep + query


def _redact_query(query: str) -> str:
    # redis-py parses the query with parse_qs, which also decodes %-escapes and '+'
    # in names: compare the names the same way.
    out = []
    for item in query.split("&"):
        name, sep, _ = item.partition("=")
        # `password`, and `sentinel_password` of a redis+sentinel:// URL.
        if sep and unquote_plus(name).strip().lower().endswith("password"):
            item = f"{name}=***"
        out.append(item)
    return "&".join(out)


def unreachable(exc: BaseException, url: str | None = None) -> str:
    """The one sentence for a Redis that could not be reached, the same from every
    command and the listener: ``Redis is unreachable: connection refused``, or with
    ``url`` ``Redis at <url without its password> is unreachable: …``."""
    where = f"Redis at {redact_url(url)}" if url else "Redis"
    return f"{where} is unreachable: {_unreachable_reason(exc)}"


# Why a connection failed, by its OSError's errno: words rather than redis-py's
# "Error 111 connecting to host:port. Connect call failed (…)".
_CONNECT_ERRORS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ENOENT: "no such socket file",
    errno.EACCES: "permission denied",
    errno.EHOSTUNREACH: "no route to the host",
    errno.ENETUNREACH: "the network is unreachable",
    errno.ECONNRESET: "the connection was reset",
    errno.ETIMEDOUT: "no answer in time",
}


def _unreachable_reason(exc: BaseException) -> str:
    seen: BaseException | None = exc
    while seen is not None:  # redis-py raises its own error while handling the OSError
        if isinstance(seen, socket.gaierror):
            return "cannot resolve the host name"
        if isinstance(seen, OSError) and seen.errno in _CONNECT_ERRORS:
            return _CONNECT_ERRORS[seen.errno]
        seen = seen.__cause__ or seen.__context__
    # One line, never the URL: redis-py's messages name the host (and a URL may
    # hold a password).
    text = " ".join(str(exc).split(" connecting to ")[0].split()).rstrip(".")
    return text[:300] or type(exc).__name__


class BadRedisUrl(ValueError):
    """A Redis URL the client cannot use; the message shows it redacted."""


def check_redis_url(url: str) -> str:
    """``url`` when redis-py can use it, else ``BadRedisUrl`` naming what is wrong."""
    shown = redact_url(url)
    # The scheme as text: urlsplit refuses a cluster URL's host list with an IPv6
    # host in it ('Invalid IPv6 URL') on Python 3.11.4+ and 3.12+.
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if is_cluster_url(url):
        try:
            cluster_client(url, 1.0)  # checks every option; connects on first use only
        except ValueError as exc:
            raise BadRedisUrl(f"{shown!r} is not a usable cluster URL: {exc}") from None
        return url
    if scheme == SENTINEL_SCHEME:
        try:
            parse_sentinel_url(url)
        except ValueError as exc:
            raise BadRedisUrl(f"{shown!r} is not a usable Sentinel URL: {exc}") from None
        return url
    if scheme not in ("redis", "rediss", "unix"):
        raise BadRedisUrl(
            f"{shown!r} is not a Redis URL: it must start with redis://, rediss:// or unix:// "
            "(one server), redis+cluster:// or rediss+cluster:// (a cluster) or "
            "redis+sentinel:// (a primary under Sentinel)"
        )
    try:
        parse_url(url)
    except ValueError as exc:
        # redis-py's messages quote no part of the URL.
        raise BadRedisUrl(f"{shown!r} is not a usable Redis URL: {exc}") from None
    return url


@dataclass(frozen=True)
class Target:
    url: str
    description: str


@contextmanager
def redis_target(
    redis_url: str | None, data_dir: str | os.PathLike[str] | None
) -> Iterator[Target]:
    """The server to use for the span of a command: the URL given (or
    ``REALM_REDIS_URL``), else the embedded server of ``data_dir``, started
    here and stopped on exit unless it was already running."""
    url = redis_url or os.environ.get("REALM_REDIS_URL")
    if url:
        yield Target(url, f"Redis at {redact_url(url)}")
        return
    with EmbeddedServer(Path(data_dir or DEFAULT_DATA_DIR)) as server:
        yield Target(server.url, server.describe())
