"""Redis Cluster: ``redis+cluster://`` URLs, and the cluster client the store uses.

    redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?options]
    rediss+cluster://...    (TLS)

The hosts are seeds: any few nodes of the cluster (port 6379 when left out). The
client asks them for the slot map and discovers every other node from it, so the
list need not be complete or current. The password (and user) are the nodes'.
Options are those redis-py reads from a single-server URL (``ssl_ca_certs``,
``ssl_cert_reqs``, ``socket_connect_timeout``, ...); a cluster has database 0 only.

The client follows ``MOVED`` (it refreshes its slot map) and ``ASK`` (it sends
``ASKING`` first), and reads the topology again after a node dropped a connection,
so after a failover the next call finds the promoted replica. It retries nothing
else by itself: the store retries, within one deadline per operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
# Connections per node. redis-py's cluster client has no blocking pool: past this it
# refuses a call at once (503). Every call on one workflow goes to one node, so a
# burst of admin calls meets this bound first; connections open only when needed.
MAX_CONNECTIONS_PER_NODE = 1000


@dataclass(frozen=True)
class ClusterUrl:
    """A cluster URL, parsed: the seeds, TLS or not, and the options redis-py reads
    from a single-server URL (username, password, ssl_*, timeouts)."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool
    options: dict[str, Any]


def is_cluster_url(url: str) -> bool:
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.strip().lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterUrl:
    """The parts of a cluster URL, or ValueError saying what is wrong (never quoting
    the URL: the caller shows it redacted)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.strip().lower() not in CLUSTER_SCHEMES:
        raise ValueError("it must start with redis+cluster:// or rediss+cluster://")
    tls = scheme.strip().lower() == "rediss+cluster"
    rest, has_query, query = rest.partition("?")
    userinfo = ""
    if "@" in rest:  # up to the last '@': a password may hold an unescaped '@'
        userinfo, rest = rest.rsplit("@", 1)
    hosts, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"a cluster has one database, 0: remove '/{path}'")
    seeds = tuple(_seed(item.strip()) for item in hosts.split(","))
    # Username, password and options exactly as redis-py reads them for one server.
    host, port = seeds[0]
    first = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    single = f"{'rediss' if tls else 'redis'}://{userinfo}{'@' if userinfo else ''}{first}/0"
    options = parse_url(single + (f"?{query}" if has_query else ""))
    for name in ("host", "port", "db", "connection_class"):
        options.pop(name, None)
    if "ssl" in options:
        raise ValueError("for TLS, name the cluster rediss+cluster://, not ?ssl=")
    return ClusterUrl(seeds, tls, options)


def _seed(item: str) -> tuple[str, int]:
    if not item:
        raise ValueError("a seed address is empty: list them as host:port,host:port")
    if item.startswith("["):  # [IPv6]:port
        host, _, tail = item[1:].partition("]")
        if tail and not tail.startswith(":"):
            raise ValueError(f"seed address {item!r} is not host:port")
        port_text = tail[1:]
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"seed address {item!r} has no host")
    if not port_text:
        return host, DEFAULT_PORT
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"seed address {item!r}: the port must be 1-65535")
    return host, int(port_text)


def cluster_client(url: str, timeout: float, *, max_connections: int | None = None) -> RedisCluster:
    """A cluster client with the settings of ``gateway.link.connection.redis_client``: no
    hidden retries (``retry`` of 0; MOVED and ASK are still followed, bounded by
    redis-py's 16 redirections and by the store's deadline), no per-reply timeout,
    ``timeout`` to connect. Raises ValueError for a URL or option it cannot use.
    Nothing connects until the first call."""
    parsed = parse_cluster_url(url)
    options: dict[str, Any] = {
        "socket_timeout": None,
        "socket_connect_timeout": timeout,
        "max_connections": max_connections or MAX_CONNECTIONS_PER_NODE,
        **parsed.options,  # as for one server: what the URL says wins
    }
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.seeds],
            ssl=parsed.tls,
            retry=Retry(NoBackoff(), 0),
            # Slots left without a node fail alone (CLUSTERDOWN: 503), not every call.
            require_full_coverage=False,
            **options,
        )
    except TypeError as exc:
        # "...__init__() got an unexpected keyword argument 'x'": name the option only.
        raise ValueError(f"unknown option {str(exc).rpartition(' ')[2]}") from None
    except redis_errors.RedisClusterException as exc:
        raise ValueError(str(exc)) from None


async def ping_every_primary(client: Redis | RedisCluster) -> None:
    """PING the server, or every primary of a cluster (each node serving slots), so
    that every write has somewhere to land. Raises redis-py's errors; a cluster none
    of whose seeds answers is a ConnectionError."""
    if not isinstance(client, RedisCluster):
        await client.ping()
        return
    try:
        await client.ping(target_nodes=RedisCluster.PRIMARIES)
    except redis_errors.RedisClusterException as exc:
        # Not a RedisError: the slot map could not be read from any seed.
        raise redis_errors.ConnectionError(str(exc)) from None
