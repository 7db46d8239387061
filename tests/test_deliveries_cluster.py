"""The delivery log on a real Redis Cluster while its slot moves to another primary:
`/v1/deliveries` answers 200 or 503, never 500, and once the slot has moved the log
holds every delivery, listed and paged as before. Its scripts name every key they
touch (a key a script builds itself is refused while its slot is being migrated).
A real `realm listen` on the cluster (3 primaries, 3 replicas; tests/cluster.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from gateway.deliveries.log import LogKeys
from tests.cluster import Cluster, key_slot
from tests.deliveries_scaffold import API_TOKEN, CONFIG, ENV, plain
from tests.listener import Listener

pytestmark = pytest.mark.slow
KEYS = LogKeys("realm")
SLOT = key_slot(KEYS.index.encode())


@pytest.fixture
def listener(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster, tmp_path: Path
) -> Iterator[Listener]:
    started = Listener(tmp_path, CONFIG, redis_url=cluster.seeds_url, env=ENV).start()
    yield started
    started.stop()


def logged(db: redis_sync.RedisCluster) -> int:
    return int(db.zcard(KEYS.index)) + int(db.zcard(KEYS.refused))


def test_the_log_answers_200_or_503_while_its_slot_moves(
    cluster: Cluster, cluster_db: redis_sync.RedisCluster, listener: Listener
) -> None:
    for n in range(40):
        assert plain(listener.base_url, f"e-{n}").status_code == 202
    for n in range(5):  # refused: the other index
        assert plain(listener.base_url, f"bad-{n}", token="wrong").status_code == 401
    deadline = time.monotonic() + 20
    while logged(cluster_db) < 45:
        assert time.monotonic() < deadline, listener.log()[-3000:]
        time.sleep(0.02)
    source = cluster.primary_for_slot(SLOT)
    target = next(n for n in cluster.primaries() if n is not source)

    statuses: list[int] = []
    api = httpx.Client(
        base_url=listener.base_url, headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=20
    )
    oldest = api.get("/v1/deliveries", params={"limit": 1000}).json()["deliveries"][-1]

    def read_the_log(moved: int) -> None:
        """Between two batches of keys moved: every way of reading the log."""
        for path, query in (
            ("/v1/deliveries", {"limit": 1000}),
            ("/v1/deliveries", {"limit": 7, "outcome": "started"}),
            ("/v1/deliveries", {"status": "4xx"}),
            (f"/v1/deliveries/{oldest['delivery_id']}", {}),
        ):
            reply = api.get(path, params=query)
            statuses.append(reply.status_code)
            assert reply.status_code in (200, 503), reply.text
        # A delivery during the move: its record waits until the log takes it.
        assert plain(listener.base_url, f"during-{moved}").status_code == 202

    try:
        cluster.migrate_slot(SLOT, target, batch=4, between=read_the_log)
        assert 200 in statuses
        deadline = time.monotonic() + 30
        while True:
            reply = api.get("/v1/deliveries", params={"limit": 1000})
            assert reply.status_code == 200, reply.text
            found = reply.json()["deliveries"]
            if len(found) == logged(cluster_db) and len(found) >= 45 + len(statuses) // 4:
                break
            assert time.monotonic() < deadline, listener.log()[-3000:]
            time.sleep(0.05)
        assert len({d["delivery_id"] for d in found}) == len(found)
        assert sum(d["status"] == 401 for d in found) == 5
        page = api.get("/v1/deliveries", params={"limit": 10, "outcome": "started"}).json()
        assert len(page["deliveries"]) == 10 and page["cursor"] is not None
    finally:
        api.close()
        if cluster.primary_for_slot(SLOT) is not source:
            cluster.migrate_slot(SLOT, source)
    assert "Traceback" not in listener.log()
    assert '"status":500' not in listener.log()
