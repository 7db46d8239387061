"""The test cluster itself (tests/cluster.py): built right, keys where their slots say,
slots that migrate with their keys, primaries whose replicas take over."""

from __future__ import annotations

import pytest
import redis as redis_sync
from redis.exceptions import AskError, MovedError

from tests.cluster import SLOTS, Cluster, ClusterNode, key_slot

KEY = "realm:{deploy}:runs"


def test_cluster_is_ok_with_three_primaries_each_with_a_replica(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    primaries = cluster.primaries()
    assert len(primaries) == 3
    for node in cluster.nodes:
        assert "cluster_state:ok" in node.call("CLUSTER", "INFO")
    for primary in primaries:
        (replica,) = cluster.replicas_of(primary)
        assert replica.info("replication")["master_link_status"] == "up"
    served = sum(hi - lo + 1 for lo, hi, *_ in cluster.nodes[0].call("CLUSTER", "SLOTS"))
    assert served == SLOTS
    assert cluster.seeds_url.startswith("redis+cluster://127.0.0.1:")


def test_a_key_lands_on_the_primary_of_its_slot_and_its_replica(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    cluster_db.zadd(KEY, {"run-1": 1})
    owner = cluster.primary_for_slot(key_slot(KEY.encode()))
    assert owner.call("ZRANGE", KEY, 0, -1) == ["run-1"]
    for other in cluster.primaries():
        if other is not owner:
            with pytest.raises(MovedError):
                other.call("ZRANGE", KEY, 0, -1)
    (replica,) = cluster.replicas_of(owner)
    owner.call("WAIT", 1, 5000)
    with replica.client() as client:
        client.execute_command("READONLY")
        assert client.zrange(KEY, 0, -1) == ["run-1"]


def test_a_migrating_slot_answers_ask_then_moves_with_its_keys(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    for i in range(250):
        cluster_db.set(f"realm:{{deploy}}:k{i}", i)
    slot = key_slot(KEY.encode())
    source = cluster.primary_for_slot(slot)
    target = next(n for n in cluster.primaries() if n is not source)
    assert cluster.begin_migration(slot, target) is source
    assert cluster.move_keys(slot, source, target, batch=100) == 100
    moved = [k for k in (f"realm:{{deploy}}:k{i}" for i in range(250)) if target_has(target, k)]
    assert len(moved) == 100
    with pytest.raises(AskError):
        source.call("GET", moved[0])
    # The cluster client follows ASK while the slot is half-moved.
    assert cluster_db.get(moved[0]) is not None
    while cluster.move_keys(slot, source, target):
        pass
    cluster.finish_migration(slot, source, target)
    assert cluster.primary_for_slot(slot) is target
    with pytest.raises(MovedError):
        source.call("GET", moved[0])
    with cluster.client() as fresh:
        assert [fresh.get(f"realm:{{deploy}}:k{i}") for i in range(250)] == [
            str(i) for i in range(250)
        ]


def target_has(node: ClusterNode, key: str) -> bool:
    with node.client() as client:
        client.execute_command("ASKING")
        return bool(client.exists(key))


@pytest.mark.slow
def test_a_killed_primary_is_replaced_by_its_replica_and_revived_as_a_replica(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster
) -> None:
    cluster_db.set("realm:{sync}:x", "1")
    owner = cluster.primary_for_key("realm:{sync}:x")
    owner.call("WAIT", 1, 5000)
    (replica,) = cluster.replicas_of(owner)
    cluster.kill(owner)
    assert cluster.wait_promoted(owner) is replica
    assert replica.call("GET", "realm:{sync}:x") == "1"
    cluster.ensure_whole()
    assert cluster.replicas_of(replica) == [owner]
    assert len(cluster.primaries()) == 3
