from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.store.runstore import RunStore
from tests.cluster import Cluster
from tests.listener import Listener
from tests.sentinel import SentinelDeployment
from tests.servers import RedisServer

WORKFLOWS_YAML = """
version: 1
workflows:
  sync:
    steps: [fetch, transform, load]
    retention: 2h
  deploy:
    steps: [fetch, build, release]
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {type: string}
        sha: {type: string, pattern: "^[0-9a-f]{7,40}$"}
  single:
    steps: [only]
    retention: 90m
"""


@pytest.fixture(scope="session", autouse=True)
def no_secret_in_any_listener_log() -> Iterator[None]:
    """After the whole suite: no listener log holds a secret or token it was given."""
    yield
    from tests.listener import LOGS

    leaks = [
        f"{path}: holds the value of a secret it was given"
        for path, secrets in LOGS
        if path.exists()
        for secret in secrets
        if secret in path.read_text(errors="replace")
    ]
    assert not leaks, "\n".join(leaks)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private server for the session; each test starts from an empty one."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private server for one test module, beside that module's listener."""
    server = RedisServer(tmp_path_factory.mktemp("module-redis")).start()
    yield server
    server.stop()


@pytest.fixture
def db(module_redis: RedisServer) -> Iterator[redis_sync.Redis]:
    """A flushed synchronous client of the module's server."""
    client = redis_sync.Redis.from_url(module_redis.url, decode_responses=True, socket_timeout=5)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def http(gateway: Listener, db: redis_sync.Redis) -> Iterator[httpx.Client]:
    """A client of the module's ``gateway`` listener (each module defines its own)."""
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        yield client


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start servers of the test's own (for kills, restarts, settings)."""
    started: list[RedisServer] = []

    def start(*extra: str, appendonly: bool = False) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(started)}", *extra, appendonly=appendonly)
        started.append(server.start())
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A private 3-primary, 3-replica cluster shared by one test module (tests/cluster.py).
    Tests use ``cluster_db`` too, which makes it whole and empty first."""
    started = Cluster(tmp_path_factory.mktemp("cluster")).start()
    yield started
    started.stop()


@pytest.fixture
def cluster_db(cluster: Cluster) -> Iterator[redis_sync.RedisCluster]:
    """The module's cluster with every node up (killed ones revived) and flushed; a
    synchronous cluster client of it."""
    cluster.ensure_whole()
    cluster.flushall()
    client = cluster.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelDeployment]:
    """A private primary, two replicas and 3 sentinels shared by one test module
    (tests/sentinel.py). Tests use ``sentinel_db`` too, which makes it whole and empty.
    Two replicas: after a failover the new primary still has one (durability)."""
    started = SentinelDeployment(tmp_path_factory.mktemp("sentinel"), replicas=2).start()
    yield started
    started.stop()


@pytest.fixture
def sentinel_db(sentinel: SentinelDeployment) -> Iterator[redis_sync.Redis]:
    """The module's Sentinel deployment with every node up (killed ones back as
    replicas) and flushed; a synchronous client of its current primary."""
    sentinel.heal()
    client = sentinel.client()
    client.flushall()
    sentinel.wait_until_agreed()  # the flush is on the replica too
    yield client
    client.close()


@pytest.fixture
def config() -> Config:
    return parse_config(WORKFLOWS_YAML, file="test.yaml", with_triggers=False)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = redis_client(redis_server.url, 5.0)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis: Redis, config: Config) -> RunStore:
    return RunStore(redis, config, timeout=5.0)
