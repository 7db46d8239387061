"""Failover under load: a primary is killed right after acknowledgements and its
replica is promoted, by Sentinel and in a Redis Cluster, with and without
``settings.durability`` (README "Failover", docs/reliability.md).

What each test does, exactly:

1. A real `realm listen --workers 2` takes GitHub deliveries (every event twice,
   shuffled) from 32 senders that retry any non-2xx (tests/senders.py).
2. When 300 deliveries have been acknowledged, the primary's replicas are frozen
   (SIGSTOP) and the primary drops their replication links (``CLIENT KILL TYPE
   replica``): from then on the primary acknowledges writes that exist nowhere
   else, the window in which asynchronous replication loses data. (On loopback
   a replica is otherwise never more than a few commands behind, and a frozen
   replica alone still gets what the kernel holds in its socket buffer.)
3. 0.4 s later (or after 150 more acknowledgements; well inside the 1 s after
   which a frozen replica would be held down and not promoted), the primary is
   killed with SIGKILL and the replicas resumed.
4. Sentinel (primary + 2 replicas, 3 sentinels) or the cluster (3 primaries with
   one replica each) promotes a replica. In the cluster the killed node is then
   started again and rejoins as the new primary's replica, as a supervisor would
   restart it: with one replica per primary, ``durability: {replicas: 1}`` refuses
   every claim of a promoted primary until it has a replica again (Sentinel keeps
   one: the second replica). The senders' retries go on until every delivery is
   acknowledged or 60 s have passed.
5. The new primary is read: an acknowledged start is **lost** when the run id a
   sender was given is not stored; an event is **doubled** when it has two runs.

With ``durability: {replicas: 1}`` a claim is acknowledged only once a
replica has its writes, so step 2's writes are answered 503 and retried:
nothing acknowledged is lost and every event has exactly one run (asserted).
Without it the figures are reported, not asserted (loss depends on timing).
Each test prints ``FIGURES failover-<how> durable=<yes|no>: ...``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis as redis_sync

from tests.cluster import Cluster, ClusterNode
from tests.exactly_once import (
    CONFIG,
    DEPLOY,
    assert_exactly_once,
    count,
    figures,
    judge,
    listening,
    loaded,
    make_events,
    redelivered,
    spool_drained,
)
from tests.senders import Attempt, Delivery, Outcome, Tally
from tests.sentinel import PASSWORD, SentinelDeployment
from tests.servers import RedisServer

EVENTS = 1500
ACKED_BEFORE = 300  # acknowledgements before the fault
ACKED_IN_WINDOW = 150  # at most this many more while the replica is cut off
WINDOW_S = 0.4  # and at most this long (a replica frozen for 1 s is held down)

durability = pytest.mark.parametrize("durable", [False, True], ids=["async", "durable"])


def config_text(durable: bool) -> str:
    if not durable:
        return CONFIG
    return CONFIG + "settings:\n  durability: {replicas: 1}\n"


def cut_off(primary: redis_sync.Redis, replicas: Sequence[RedisServer]) -> None:
    """Freeze the replicas and drop their links: the primary's next writes are its alone."""
    for replica in replicas:
        replica.pause()
    primary.execute_command("CLIENT", "KILL", "TYPE", "replica")


async def window(tally: Tally) -> int:
    """Let the primary acknowledge alone for a moment; how many it did."""
    start = tally.acked
    deadline = time.monotonic() + WINDOW_S
    more = tally.acked_at_least(start + ACKED_IN_WINDOW)
    while time.monotonic() < deadline and not more.is_set():
        await asyncio.sleep(0.01)
    return tally.acked - start


async def revive(cluster: Cluster, node: ClusterNode) -> None:
    """Start a killed node again and wait until the cluster is ok. The process is
    started from this thread, the waiting done in another: Linux kills a test server
    when the thread that started it ends (PR_SET_PDEATHSIG, tests/servers.py), and the
    worker threads of asyncio.to_thread end when the test's event loop closes. A node
    revived from one was killed then, at the start of the next test of the module,
    which found the workflow's primary without a replica (with durability, every
    claim refused)."""
    node.server.start()
    await asyncio.to_thread(cluster.wait_ok)


def first_2xx_sent_after(attempts: Sequence[Attempt], t: float) -> float | None:
    """Seconds from ``t`` to the first 2xx of a request sent after ``t``: how long
    senders were turned away (replies already on their way at ``t`` do not count)."""
    done = [a.done for a in attempts if a.ok and a.sent > t]
    return min(done) - t if done else None


def conclude(
    how: str,
    durable: bool,
    url: str,
    events: Sequence[Delivery],
    outcomes: Sequence[Outcome],
    t_kill: float,
    **extra: float,
) -> None:
    """Judge what the new primary at ``url`` holds, print the figures, and check them.
    Either way: only retryable answers reach a sender, every run is queued once;
    durable: 0 lost, one run per event, every delivery acknowledged."""
    v = judge(url, events, outcomes)
    recovery = first_2xx_sent_after([a for o in outcomes for a in o.attempts], t_kill)
    figures(
        f"failover-{how} durable={'yes' if durable else 'no'}",
        events=v.events,
        deliveries=v.deliveries,
        acked=v.acked,
        unacked=v.unacked,
        runs=v.runs,
        lost=v.acked_lost,
        doubled=v.events_with_several_runs,
        events_without_run=v.events_without_run,
        replies_503=count(v, "503"),
        conn_errors=count(v, "conn"),
        other_non2xx=v.non2xx - count(v, "503") - count(v, "conn"),
        **extra,
        back_after_kill_s=recovery if recovery is not None else -1.0,
    )
    assert v.non2xx == count(v, "503") + count(v, "conn"), v.statuses
    assert v.runs_without_one_stream_entry == 0, v
    if durable:
        assert_exactly_once(v)


# --------------------------------------------------------------------------- Sentinel


@pytest.mark.slow
@pytest.mark.faults
@durability
async def test_sentinel_failover_under_load(
    tmp_path: Path, sentinel: SentinelDeployment, sentinel_db: redis_sync.Redis, durable: bool
) -> None:
    events = make_events(EVENTS, seed=41)
    deliveries = redelivered(events, 2, seed=41)
    tally = Tally()
    replicas = sentinel.replicas
    async with asyncio.timeout(150):
        with listening(tmp_path, sentinel.url(), config_text(durable)) as listener:
            load = await loaded(listener, deliveries, tally, acked=ACKED_BEFORE, seconds=60)
            with sentinel.client() as primary:
                cut_off(primary, replicas)
            in_window = await window(tally)
            old = sentinel.kill_primary()
            t_kill = time.monotonic()
            for replica in replicas:
                replica.resume()
            promoted_s = await asyncio.to_thread(sentinel.wait_for_promotion, old.port)
            outcomes = await load
            await spool_drained(listener)  # what was accepted meanwhile, claimed
    assert sentinel.primary_port in {r.port for r in replicas}
    url = f"redis://:{PASSWORD}@127.0.0.1:{sentinel.primary_port}/0"
    conclude("sentinel", durable, url, events, outcomes, t_kill,
             acked_in_window=in_window, failover_s=promoted_s)  # fmt: skip


# --------------------------------------------------------------------------- Cluster


@pytest.mark.slow
@pytest.mark.faults
@durability
async def test_cluster_failover_under_load(
    tmp_path: Path, cluster: Cluster, cluster_db: object, durable: bool
) -> None:
    events = make_events(EVENTS, seed=42)
    deliveries = redelivered(events, 2, seed=42)
    tally = Tally()
    primary = cluster.primary_for_key(DEPLOY.runs())  # the workflow's one slot
    [replica] = cluster.replicas_of(primary)
    async with asyncio.timeout(150):
        with listening(tmp_path, cluster.seeds_url, config_text(durable)) as listener:
            load = await loaded(listener, deliveries, tally, acked=ACKED_BEFORE, seconds=60)
            with primary.client() as client:
                cut_off(client, [replica.server])
            in_window = await window(tally)
            cluster.kill(primary)
            t_kill = time.monotonic()
            replica.server.resume()
            promoted = await asyncio.to_thread(cluster.wait_promoted, primary)
            promoted_s = time.monotonic() - t_kill
            # As a supervisor would: the crashed node is started again and rejoins as
            # the new primary's replica (without it, `durability: {replicas: 1}`
            # would refuse every claim of these slots: no replica is left).
            await revive(cluster, primary)
            revived_s = time.monotonic() - t_kill
            outcomes = await load
            await spool_drained(listener)  # what was accepted meanwhile, claimed
    assert promoted is replica
    url = f"redis://127.0.0.1:{replica.port}/0"
    conclude("cluster", durable, url, events, outcomes, t_kill,
             acked_in_window=in_window, failover_s=promoted_s, revived_s=revived_s)  # fmt: skip


@pytest.mark.slow
@pytest.mark.faults
def test_a_revived_node_outlives_the_event_loop_that_revived_it(
    cluster: Cluster, cluster_db: object
) -> None:
    """What the next test of the module finds: the node ``revive`` started is still up
    after the loop that ran it closed (its worker threads ended)."""
    primary = cluster.primary_for_key(DEPLOY.runs())
    [replica] = cluster.replicas_of(primary)
    cluster.kill(replica)
    asyncio.run(revive(cluster, replica))
    assert replica.alive, "the revived node was killed with the thread that started it"
    cluster.wait_ok()
    assert replica.alive and cluster.replicas_of(primary) == [replica]
