"""Everything but the listener's claims, on a real Redis Cluster (3 primaries, 3 replicas):
the store's calls, reconcile over every primary, the CLI, the admin API and /readyz
through a failover, and 503 (never 500) while the cluster is changing."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from gateway.link.connection import BadRedisUrl, check_redis_url, redact_url, redis_client
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.reconcile import count_runs, reconcile
from gateway.store.runs import Flow, StartResult
from gateway.store.runstore import RunStore
from gateway.store.starts import Marker
from gateway.store.sweep import start_due, sweep
from tests.cluster import Cluster, ClusterNode, key_slot
from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.mcp_client import mcp_session
from tests.test_cli import UUID, realm

# sync's tag is served by the third primary, orders' by the first, ingest's by the
# second (slots 11216, 4717 and 6549 of the 3 equal ranges the cluster starts with).
YAML = (
    WORKFLOWS_YAML
    + """  orders:
    steps: [charge, ship]
  ingest:
    steps: [pull, store]
  hot:
    steps: [go]
    partitions: 4
"""
)
SPREAD = ("sync", "orders", "ingest")
TOKEN = "cluster-api-token-5d1c"


def tag_slot(workflow: str) -> int:
    return key_slot(f"realm:{{{workflow}}}:runs".encode())


@pytest.fixture
def cluster_config() -> Config:
    return parse_config(YAML, file="test.yaml", with_triggers=False)


@pytest.fixture
async def cluster_store(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster, cluster_config: Config
) -> AsyncIterator[RunStore]:
    client = redis_client(cluster.seeds_url, 5.0)
    store = RunStore(client, cluster_config, timeout=5.0)
    yield store
    await client.aclose()


def owner(cluster: Cluster, workflow: str) -> ClusterNode:
    return cluster.primary_for_slot(tag_slot(workflow))


# -- the URL ---------------------------------------------------------------------------


def test_cluster_urls_are_checked_and_redacted() -> None:
    good = "redis+cluster://user:s3cret@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002?socket_connect_timeout=2"
    assert check_redis_url(good) == good
    assert redact_url(good) == (
        "redis+cluster://user:***@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002?socket_connect_timeout=2"
    )
    assert redact_url("rediss+cluster://:pw@h:1?password=pw2") == (
        "rediss+cluster://:***@h:1?password=***"
    )
    for url, says in [
        ("redis+cluster://:s3cret@h:1,,h:2", "a seed address is empty"),
        ("redis+cluster://:s3cret@h:99999", "the port must be 1-65535"),
        ("redis+cluster://:s3cret@h:1/3", "a cluster has one database, 0"),
        ("redis+cluster://:s3cret@h:1?nonsense=1", "unknown option 'nonsense'"),
        ("redis+cluster://:s3cret@h:1?ssl=true", "name the cluster rediss+cluster://"),
    ]:
        with pytest.raises(BadRedisUrl, match=re.escape(says)) as caught:
            check_redis_url(url)
        assert "s3cret" not in str(caught.value) and "***" in str(caught.value)


def test_a_cluster_url_gives_a_cluster_client_with_its_seeds_and_password() -> None:
    client = redis_client("rediss+cluster://u:pw@a:7000,b?ssl_cert_reqs=none", 2.0)
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.connection import SSLConnection

    assert isinstance(client, RedisCluster)
    assert [n.name for n in client.startup_nodes] == ["a:7000", "b:6379"]
    kwargs = client.connection_kwargs
    assert (kwargs["username"], kwargs["password"]) == ("u", "pw")
    assert kwargs["connection_class"] is SSLConnection
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (None, 2.0)
    assert client.retry.get_retries() == 0


# -- the store -------------------------------------------------------------------------


async def test_every_store_call_works_on_a_cluster(
    cluster: Cluster, cluster_store: RunStore
) -> None:
    assert len({owner(cluster, w).node_id for w in SPREAD}) == 3
    await cluster_store.load_scripts()
    await cluster_store.ping()
    # Loaded on every primary: a call by SHA finds its script wherever its slot is.
    sha = cluster_store.scripts.start_run.sha
    assert [p.call("SCRIPT", "EXISTS", sha) for p in cluster.primaries()] == [[1]] * 3
    started = {w: await cluster_store.start_run(w, {}, f"key-{w}") for w in SPREAD}
    for w, result in started.items():
        again = await cluster_store.start_run(w, {}, f"key-{w}")
        assert (again.deduped, again.run_id) == (True, result.run_id)
        # The run lives on the primary of its workflow's slot.
        assert owner(cluster, w).call("HGET", f"realm:{{{w}}}:run:{result.run_id}", "phase") == (
            "running"
        )
        assert (await cluster_store.get_run(result.run_id)).workflow == w

    batch = await cluster_store.start_run_batch(
        "orders", [{"idempotency_key": "a"}, {"idempotency_key": "b"}, {"idempotency_key": "a"}]
    )
    assert [e.result.deduped for e in batch if e.result] == [False, False, True]
    runs, cursor = await cluster_store.list_runs("orders")
    assert cursor is None and len(runs) == 3

    sync_run = started["sync"].run_id
    assert (await cluster_store.complete_step(sync_run, "fetch")).next_step == "transform"
    assert (await cluster_store.fail_run(sync_run, "boom")).phase == "failed"
    assert await cluster_store.cancel_run(sync_run) == 0
    assert await cluster_store.cancel_run(started["ingest"].run_id) == 1
    assert await cluster_store.cancel_key("orders", "a") == 1
    assert await count_runs(cluster_store) == 5
    for w in SPREAD:
        report = await sweep(cluster_store, w)
        assert report.calls >= 1


async def test_reconcile_walks_every_primary(
    cluster: Cluster, cluster_store: RunStore, cluster_db: redis_sync.RedisCluster
) -> None:
    ids = {w: (await cluster_store.start_run(w, {}, "k")).run_id for w in SPREAD}
    # A pointer lost on each primary: only a walk of every primary finds all three.
    for w in SPREAD:
        cluster_db.delete(f"realm:{{{w}}}:key:k")
    checked = await reconcile(cluster_store, dry_run=True)
    assert (checked.groups, checked.missing) == (3, 3)
    repaired = await reconcile(cluster_store, dry_run=False)
    assert repaired.written == 3
    for w in SPREAD:
        assert cluster_db.hget(f"realm:{{{w}}}:key:k", "run") == ids[w]
    assert (await reconcile(cluster_store, dry_run=True)).current == 3


async def test_reconcile_walks_every_partition_on_every_primary(
    cluster: Cluster, cluster_store: RunStore, cluster_db: redis_sync.RedisCluster
) -> None:
    keys = [f"key-{i}" for i in range(12)]
    ids = {k: (await cluster_store.start_run("hot", {}, k)).run_id for k in keys}
    pointers = {k: cluster_store.keys_for_key("hot", k).pointer(k) for k in keys}
    homes = {cluster.primary_for_key(p).node_id for p in pointers.values()}
    assert len(homes) >= 2  # the partitions' tags are spread over the primaries
    for pointer in pointers.values():
        cluster_db.delete(pointer)
    assert (await reconcile(cluster_store, workflow="hot", dry_run=True)).missing == 12
    assert (await reconcile(cluster_store, workflow="hot", dry_run=False)).written == 12
    assert {k: cluster_db.hget(p, "run") for k, p in pointers.items()} == ids
    assert await count_runs(cluster_store, "hot") == 12


async def test_reconcile_reads_each_partitions_key_index_on_its_primary_and_scans_nothing(
    cluster: Cluster, cluster_store: RunStore, cluster_db: redis_sync.RedisCluster
) -> None:
    """The walk reads the key index of each partition, in its own slot, and
    never SCANs a primary; ``scan=True`` (keys from before the index) SCANs every one."""
    keys = [f"key-{i}" for i in range(12)]
    for k in keys:
        await cluster_store.start_run("hot", {}, k)
    for w in SPREAD:  # other workflows' keys, on every primary
        await cluster_store.start_run_batch(w, [{"idempotency_key": f"o{i}"} for i in range(50)])
    parts = cluster_store.partitions("hot")
    homes = [cluster.primary_for_key(p.key_index()) for p in parts]
    for node in cluster.primaries():
        node.call("CONFIG", "RESETSTAT")

    report = await reconcile(cluster_store, workflow="hot", dry_run=True)

    assert (report.groups, report.current) == (12, 12)
    for node in cluster.primaries():
        calls = {n.removeprefix("cmdstat_"): int(v["calls"])
                 for n, v in node.call("INFO", "commandstats").items()}  # fmt: skip
        assert "scan" not in calls, node
        # One ZSCAN per partition, on the primary that holds its index.
        assert calls.get("zscan", 0) == sum(h is node for h in homes), node

    for p in parts:
        cluster_db.delete(p.key_index())  # as a gateway without the index left them
    assert (await reconcile(cluster_store, workflow="hot", dry_run=True)).groups == 0
    scanned = await reconcile(cluster_store, workflow="hot", dry_run=False, scan=True)
    assert (scanned.groups, scanned.current) == (12, 12)
    for node in cluster.primaries():
        assert node.info("commandstats")["cmdstat_scan"].startswith("{'calls': "), node
    assert (await reconcile(cluster_store, workflow="hot", dry_run=True)).groups == 12


async def test_a_half_migrated_slot_is_503_then_works_once_moved(
    cluster: Cluster, cluster_store: RunStore, cluster_db: redis_sync.RedisCluster
) -> None:
    """A script whose keys are split between two nodes gets TRYAGAIN until the slot
    has moved: the store says 503 (retry), never 500, and writes nothing."""
    first = await cluster_store.start_run("orders", {}, "k1")
    slot = tag_slot("orders")
    source = cluster.primary_for_slot(slot)
    target = next(n for n in cluster.primaries() if n is not source)
    cluster.begin_migration(slot, target)
    try:
        # Only the run index moves: a start names it and the stream, now apart.
        source.call("MIGRATE", "127.0.0.1", target.port, "realm:{orders}:runs", 0, 5000)
        with pytest.raises(StoreUnavailable, match="the cluster is not ready"):
            await cluster_store.start_run("orders", {}, "k2")
        while cluster.move_keys(slot, source, target):
            pass
        cluster.finish_migration(slot, source, target)
        second = await cluster_store.start_run("orders", {}, "k2")
        repeat = await cluster_store.start_run("orders", {}, "k1")
        assert (repeat.deduped, repeat.run_id) == (True, first.run_id)
        runs, _ = await cluster_store.list_runs("orders")
        assert [r.id for r in runs] == [second.run_id, first.run_id]
    finally:
        if cluster.primary_for_slot(slot) is not source:
            cluster.migrate_slot(slot, source)


async def test_a_slot_no_node_serves_is_503(cluster: Cluster, cluster_store: RunStore) -> None:
    await cluster_store.start_run("ingest", {}, "k")
    node = owner(cluster, "ingest")
    slot = tag_slot("ingest")
    node.call("CLUSTER", "DELSLOTS", slot)
    try:
        with pytest.raises(StoreUnavailable):
            await cluster_store.start_run("ingest", {}, "k2")
        with pytest.raises(StoreUnavailable):
            await cluster_store.list_runs("ingest")
    finally:
        node.call("CLUSTER", "ADDSLOTS", slot)
    cluster.wait_ok()
    assert (await cluster_store.start_run("ingest", {}, "k")).deduped


# -- the CLI ---------------------------------------------------------------------------


@pytest.fixture
def cli(
    tmp_path: Path, cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> Iterator[callable]:
    (tmp_path / "triggers.yaml").write_text(YAML)

    def run(*args: str):
        return realm(*args, "--redis-url", cluster.seeds_url, cwd=tmp_path)

    yield run


def test_the_cli_on_a_cluster(cli, cluster: Cluster) -> None:
    started = cli("run", "start", "orders", "--key", "order-1")
    assert started.returncode == 0, started.stderr
    run_id = re.search(rf"run_id: ({UUID})", started.stdout).group(1)
    assert f"using Redis at {cluster.seeds_url}" in started.stderr
    again = cli("run", "start", "orders", "--key", "order-1", "--json")
    assert json.loads(again.stdout)["run_id"] == run_id
    other = json.loads(cli("run", "start", "sync", "--key", "s", "--json").stdout)["run_id"]

    shown = cli("run", "show", run_id, "--json")
    assert json.loads(shown.stdout)["workflow"] == "orders"
    listed = json.loads(cli("run", "list", "--workflow", "orders", "--json").stdout)
    assert [r["run_id"] for r in listed["runs"]] == [run_id]
    cancelled = cli("run", "cancel", run_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cli("run", "show", run_id, "--json").stdout)["phase"] == "cancelled"

    report = cli("run", "reconcile", "--dry-run")
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith(
        "Would write 0 pointers across 2 key groups; 2 already current."
    )
    scanned = cli("run", "reconcile", "--dry-run", "--scan")
    assert scanned.stdout == report.stdout, scanned.stderr
    assert other in cli("run", "show", other).stdout


def test_the_cli_says_a_bad_cluster_url_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "triggers.yaml").write_text(YAML)
    out = realm("run", "list", "--workflow", "sync", "--redis-url",
                "redis+cluster://:hunter22@127.0.0.1:7000,,x", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2
    assert "hunter22" not in out.stderr and "Traceback" not in out.stderr
    assert "a seed address is empty" in out.stderr


async def test_the_mcp_tools_on_a_cluster(
    tmp_path: Path, cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    (tmp_path / "triggers.yaml").write_text(YAML)
    async with mcp_session(tmp_path / "triggers.yaml", cluster.seeds_url) as tools:
        run_id = await tools.start(workflow_id="orders", params={}, idempotency_key="k")
        assert await tools.start(workflow_id="orders", params={}, idempotency_key="k") == run_id
        assert "Phase: running" in await tools.ok("get_run", run_id=run_id)
        assert run_id in await tools.ok("list_runs", workflow_id="orders")
        await tools.ok("cancel_run", run_id=run_id)
    assert cluster_db.hget(f"realm:{{orders}}:run:{run_id}", "phase") == "cancelled"


# -- a listener: the admin API and /readyz through a failover ---------------------------


@pytest.fixture
def listener(tmp_path: Path, cluster: Cluster, cluster_db: redis_sync.RedisCluster):
    listener = Listener(
        tmp_path, YAML, redis_url=cluster.seeds_url, env={"REALM_API_TOKEN": TOKEN}
    ).start()
    yield listener
    listener.stop()


def _api(listener: Listener) -> httpx.Client:
    return httpx.Client(
        base_url=listener.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )


def test_the_admin_api_on_a_cluster(listener: Listener) -> None:
    with _api(listener) as api:
        assert api.get("/readyz").status_code == 200
        ids = {}
        for w in SPREAD:
            reply = api.post(f"/v1/workflows/{w}/runs", json={"idempotency_key": "k"})
            assert reply.status_code == 202, reply.text
            ids[w] = reply.json()["run_id"]
            again = api.post(f"/v1/workflows/{w}/runs", json={"idempotency_key": "k"})
            assert (again.status_code, again.json()["run_id"]) == (200, ids[w])
        got = api.get(f"/v1/runs/{ids['ingest']}")
        assert (got.status_code, got.json()["workflow"]) == (200, "ingest")
        page = api.get("/v1/workflows/orders/runs").json()
        assert [r["run_id"] for r in page["runs"]] == [ids["orders"]]
        batch = api.post("/v1/workflows/sync/batch", json={"items": [{"idempotency_key": "b"}]})
        assert batch.status_code == 200, batch.text
        assert api.post(f"/v1/runs/{ids['sync']}/cancel").json() == {"cancelled": 1}
        report = api.post("/v1/reconcile", json={"dry_run": True})
        assert report.status_code == 200
        assert report.json()["groups"] == 4
        scanned = api.post("/v1/reconcile", json={"dry_run": True, "scan": True})
        assert (scanned.status_code, scanned.json()["groups"]) == (200, 4)
        bad = api.post("/v1/reconcile", json={"scan": "yes"})
        assert (bad.status_code, bad.json()) == (422, {
            "status": "error", "code": "VALIDATION_BODY",
            "message": "field 'scan' must be of type bool",
        })  # fmt: skip


@pytest.mark.slow
def test_readyz_says_the_store_is_down_while_a_primary_is_and_ok_once_its_replica_took_over(
    listener: Listener, cluster: Cluster
) -> None:
    """Ready throughout: while the store cannot answer, deliveries go to the spool, so a
    probe must not take the gateway out of its balancer; the reply says what is down."""
    with _api(listener) as api:
        assert api.get("/readyz").status_code == 200
        started = api.post("/v1/workflows/orders/runs", json={"idempotency_key": "k"})
        assert started.status_code == 202
        victim = owner(cluster, "orders")
        victim.call("WAIT", 1, 5000)
        cluster.kill(victim)
        down = api.get("/readyz")
        assert down.status_code == 200
        assert (down.json()["store"], down.json()["spool"]) == ("unavailable", "accepting")
        # Calls on the dead primary's slots are 503, never 500.
        assert api.get(f"/v1/runs/{started.json()['run_id']}").status_code in (200, 503)
        cluster.wait_promoted(victim)
        deadline = time.monotonic() + 10
        while "store" in (ready := api.get("/readyz")).json() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (ready.status_code, ready.json()["status"], "store" in ready.json()) == (
            200, "ok", False,
        )  # fmt: skip
        again = api.post("/v1/workflows/orders/runs", json={"idempotency_key": "k"})
        assert (again.status_code, again.json()["run_id"]) == (200, started.json()["run_id"])
    assert "Traceback" not in listener.log()


async def test_the_delivery_log_records_and_pages_in_one_slot(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    """Its scripts name every key they touch, records trimmed or listed too: all
    share the log's hash tag, so a cluster serves them from one slot."""
    from gateway.deliveries.log import get_delivery, list_deliveries, write_records
    from tests.deliveries_scaffold import deliver, load, push, signed

    client = redis_client(cluster.seeds_url, 5.0)
    try:
        config = load()
        store = RunStore(client, config, timeout=5.0)
        body = push()
        item = await deliver(store, body, signed(body))
        ids = []
        for _ in range(4):  # the cap (50) trims the oldest
            ids += await write_records(store, config.settings, [item] * 20)
        newest = sorted(ids, reverse=True)  # ids of one millisecond sort by their random part
        page, cursor = await list_deliveries(store, limit=30)
        assert [d["delivery_id"] for d in page] == newest[:30]
        page, cursor = await list_deliveries(store, limit=30, cursor=cursor)
        assert [d["delivery_id"] for d in page] == newest[30:50]
        assert (await get_delivery(store, newest[0]))["status"] == 202
    finally:
        await client.aclose()


async def test_queues_schedules_order_and_rate_keys_meet_in_one_slot_on_the_cluster(
    cluster_store: RunStore,
) -> None:
    """Each claim's new keys (a key's queue, the queued and due indexes, an entity's
    order mark, a rate window) are in its partition's slot: on a partitioned workflow
    spread over the primaries, queues start their next runs, due runs start, stale
    events are refused and windows fill, per key."""
    store = cluster_store
    keys = [f"k{n}" for n in range(8)]
    first = {k: await store.start_run("hot", {}, k, "queue", "rerun") for k in keys}
    behind = {k: await store.start_run("hot", {}, k, "queue", "rerun") for k in keys}
    assert {r.phase for r in behind.values()} == {"queued"}
    for k in keys:
        await store.complete_step(first[k].run_id, "go")
        assert (await store.get_run(behind[k].run_id)).phase == "running"
    assert await store.cancel_key("hot", keys[0]) == 1

    flow = Flow(debounce_ms=1, max_wait_ms=0)
    scheduled = [
        await store.start_run("hot", {"n": n}, f"d{n}", "use_existing", "rerun", flow=flow)
        for n in range(8)
    ]
    assert {s.phase for s in scheduled} == {"scheduled"}
    started = 0
    for _ in range(100):
        started += await start_due(store, "hot")
        if started == 8:
            break
    assert started == 8
    assert {(await store.get_run(s.run_id)).phase for s in scheduled} == {"running"}

    # An entity's mark and a key's window live in the key's partition: on a partitioned
    # workflow the entity is the key.
    for n in range(8):
        entity = f"cus_{n}"

        async def again(marker: Marker, entity: str = entity) -> StartResult:
            return await store.start_run(
                "hot", {}, entity, "cancel_existing", "rerun", markers=[marker]
            )

        await again(store.order_marker(entity, 2.0, 0, "accept", "2"))
        with pytest.raises(RealmError) as stale:
            await again(store.order_marker(entity, 1.0, 0, "accept", "1"))
        assert stale.value.code == "STATE_EVENT_STALE"
        window = store.rate_marker("t", entity, 1, 60_000)
        await again(window)
        with pytest.raises(RealmError) as limited:
            await again(window)
        assert limited.value.code == "STATE_RATE_LIMITED"
