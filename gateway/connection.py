"""Opens the Redis the gateway uses: a URL, or the embedded server (DESIGN §8)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.embedded import EmbeddedServer

DEFAULT_DATA_DIR = ".realm"


def redis_client(url: str, timeout: float, *, max_connections: int | None = None) -> Redis:
    """An asyncio client with no hidden retries: the store decides what to retry
    (``RunStore._retrying``) within one deadline per operation.

    No ``socket_timeout``: redis-py would wrap every single reply it reads in a
    timeout of its own, which costs more CPU than the reply (half of reconcile's
    time, measured). The store's deadline (``settings.redis_timeout``) bounds each
    operation instead (the listener's own pipelined connection has a watchdog of
    its own, gateway/pipeline.py); a read they cancel drops its connection.
    Connecting keeps its own timeout."""
    return Redis.from_url(
        url,
        socket_timeout=None,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        max_connections=max_connections,
    )


def redact_url(url: str) -> str:
    """The URL without its password, fit for logs and banners."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


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
