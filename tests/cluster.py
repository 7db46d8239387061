"""A private Redis/Valkey Cluster for tests: real server processes on free loopback ports.

Built with plain commands (CLUSTER ADDSLOTSRANGE, SET-CONFIG-EPOCH, MEET, REPLICATE),
so no ``valkey-cli``/``redis-cli`` is needed, and the same code works with the
system redis-server (7.0+) and the pip-shipped valkey-server (tests/servers.py
finds the binary). Typical use, through the fixtures of tests/conftest.py::

    def test_x(cluster: Cluster) -> None:          # flushed, every node up
        url = cluster.seeds_url                    # redis+cluster://127.0.0.1:p1,...
        node = cluster.primary_for_slot(key_slot(b"realm:{deploy}:runs"))
        cluster.kill(node)                         # SIGKILL
        new = cluster.wait_promoted(node)          # its replica owns its slots now
        cluster.migrate_slot(slot, to=other)       # IMPORTING/MIGRATING, MIGRATE, NODE

Killed nodes come back (as replicas of whoever took their slots) with
``revive``; the ``cluster`` fixture revives them before each test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_sync
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.cluster import key_slot

from tests.servers import RedisServer

SLOTS = 16384
__all__ = ["SLOTS", "Cluster", "ClusterNode", "key_slot"]


@dataclass(eq=False)
class ClusterNode:
    """One server of the cluster. ``node_id`` is its cluster id (stable across restarts:
    it lives in the node's nodes.conf)."""

    server: RedisServer
    node_id: str = ""
    name: str = ""

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def client(self, timeout: float = 5.0) -> redis_sync.Redis:
        """A plain (non-cluster) client of this one node; the caller closes it."""
        return redis_sync.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout, decode_responses=True
        )

    def call(self, *args: Any, timeout: float = 5.0) -> Any:
        with self.client(timeout) as client:
            return client.execute_command(*args)

    def info(self, section: str) -> dict[str, str]:
        # redis-py parses INFO into a dict (numbers as ints).
        return {k: str(v) for k, v in self.call("INFO", section).items()}

    def __repr__(self) -> str:
        return f"<{self.name} {self.address} {self.node_id[:8]}>"


@dataclass
class _View:
    """One node's view of the cluster, from CLUSTER NODES."""

    primaries: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # id -> slot ranges
    replica_of: dict[str, str] = field(default_factory=dict)  # replica id -> primary id
    failed: set[str] = field(default_factory=set)
    known: set[str] = field(default_factory=set)
    handshake: bool = False


def _parse_nodes(text: str) -> _View:
    view = _View()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        node_id, flags, master = parts[0], parts[2].split(","), parts[3]
        if "handshake" in flags or "noaddr" in flags:
            view.handshake = True
            continue
        view.known.add(node_id)
        if "fail" in flags or "fail?" in flags:
            view.failed.add(node_id)
        if "master" in flags:
            ranges = []
            for item in parts[8:]:
                if item.startswith("["):
                    continue  # a slot being imported or migrated
                lo, _, hi = item.partition("-")
                ranges.append((int(lo), int(hi or lo)))
            view.primaries[node_id] = ranges
        elif master != "-":
            view.replica_of[node_id] = master
    return view


class Cluster:
    """``primaries`` primaries with ``replicas`` replicas each (3 + 3 by default).

    ``node_timeout_ms`` is cluster-node-timeout: a killed primary is failed over
    about 2-3 times that later. No persistence unless ``appendonly``."""

    def __init__(
        self,
        base_dir: Path,
        primaries: int = 3,
        replicas: int = 1,
        *,
        node_timeout_ms: int = 1000,
        appendonly: bool = False,
        extra: Iterable[str] = (),
    ) -> None:
        self.base_dir = base_dir
        self.n_primaries = primaries
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.extra = list(extra)
        self.nodes: list[ClusterNode] = []

    # -- building ----------------------------------------------------------------------

    def _server_args(self) -> list[str]:
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-announce-ip", "127.0.0.1",
            # A replica may always take over, however long its link was down: tests
            # kill primaries right after writes.
            "--cluster-replica-validity-factor", "0",
            # The topology the test built stays put (no replica moves to an orphan).
            "--cluster-allow-replica-migration", "no",
            # Replicas sync at once, without an RDB file on disk.
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            *self.extra,
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> Cluster:
        total = self.n_primaries * (1 + self.n_replicas)
        try:
            for i in range(total):
                server = RedisServer(
                    self.base_dir / f"node{i}", *self._server_args(), appendonly=self.appendonly
                )
                node = ClusterNode(server.start(), name=f"node{i}")
                node.node_id = node.call("CLUSTER", "MYID")
                self.nodes.append(node)
            primaries = self.nodes[: self.n_primaries]
            for i, node in enumerate(primaries):
                lo, hi = i * SLOTS // len(primaries), (i + 1) * SLOTS // len(primaries) - 1
                node.call("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for epoch, node in enumerate(self.nodes, start=1):
                # Distinct config epochs up front: no collision to resolve at start.
                node.call("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            first = self.nodes[0]
            for node in self.nodes[1:]:
                first.call("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait(lambda: self._all_know_all(), timeout, "every node to know every other")
            for i, node in enumerate(self.nodes[self.n_primaries :]):
                primary = primaries[i % self.n_primaries]
                self._wait(
                    lambda node=node, primary=primary: self._try_replicate(node, primary),
                    timeout,
                    f"{node} to replicate {primary}",
                )
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _all_know_all(self) -> bool:
        ids = {n.node_id for n in self.nodes}
        for node in self.nodes:
            view = _parse_nodes(node.call("CLUSTER", "NODES"))
            if view.handshake or view.known != ids:
                return False
        return True

    @staticmethod
    def _try_replicate(node: ClusterNode, primary: ClusterNode) -> bool:
        try:
            node.call("CLUSTER", "REPLICATE", primary.node_id)
            return True
        except redis_sync.ResponseError:
            return False  # "Unknown node": the gossip has not reached it yet

    # -- state -------------------------------------------------------------------------

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive]

    def by_id(self, node_id: str) -> ClusterNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    def view(self, node: ClusterNode | None = None) -> _View:
        return _parse_nodes((node or self.live()[0]).call("CLUSTER", "NODES"))

    def primaries(self) -> list[ClusterNode]:
        """The primaries that serve slots now (as a live node sees them)."""
        view = self.view()
        return [self.by_id(i) for i, r in view.primaries.items() if r and i not in view.failed]

    def replicas_of(self, primary: ClusterNode) -> list[ClusterNode]:
        view = self.view()
        return [self.by_id(r) for r, p in view.replica_of.items() if p == primary.node_id]

    def primary_for_slot(self, slot: int) -> ClusterNode:
        """The node that owns ``slot`` now, asked of the nodes themselves."""
        node = self.live()[0]
        for lo, hi, primary, *_ in node.call("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return self.by_id(primary[2])
        raise LookupError(f"no node serves slot {slot}")

    def primary_for_key(self, key: str | bytes) -> ClusterNode:
        return self.primary_for_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def is_ok(self) -> bool:
        """cluster_state:ok on every live node, every live node agreeing on who serves
        every slot, and every live replica in sync with its primary."""
        views = []
        for node in self.live():
            try:
                if "cluster_state:ok" not in node.call("CLUSTER", "INFO"):
                    return False
                views.append(_parse_nodes(node.call("CLUSTER", "NODES")))
            except redis_sync.RedisError:
                return False
        alive = {n.node_id for n in self.live()}
        if any(v.failed & alive or not alive <= v.known for v in views):
            return False  # a revived node not yet seen as up by everyone
        owners = [
            {i: r for i, r in v.primaries.items() if r and i in alive and i not in v.failed}
            for v in views
        ]
        if any(o != owners[0] for o in owners) or any(
            sum(hi - lo + 1 for lo, hi in r) == 0 for r in owners[0].values()
        ):
            return False
        if sum(hi - lo + 1 for r in owners[0].values() for lo, hi in r) != SLOTS:
            return False
        for node in self.live():
            if node.node_id in owners[0]:
                continue
            repl = node.info("replication")
            if repl.get("master_link_status") != "up" or repl.get("master_sync_in_progress") != "0":
                return False
        return True

    def wait_ok(self, timeout: float = 30.0) -> None:
        self._wait(self.is_ok, timeout, "the cluster to be ok on every node")

    # -- faults and changes ------------------------------------------------------------

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL the node: no goodbye, no flush."""
        node.server.kill()

    def wait_promoted(self, killed: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """Wait until ``killed``'s slots are served by a live primary (its replica,
        promoted) and the cluster is ok again; return that primary."""
        view = self.view()
        slots = view.primaries.get(killed.node_id) or []
        if not slots:
            raise ValueError(f"{killed} served no slots")
        slot = slots[0][0]
        alive = {n.node_id for n in self.live()}

        def promoted() -> bool:
            try:
                owner = self.primary_for_slot(slot)
            except (LookupError, redis_sync.RedisError):
                return False
            return owner.node_id in alive and owner is not killed and self.is_ok()

        self._wait(promoted, timeout, f"a replica of {killed} to be promoted")
        return self.primary_for_slot(slot)

    def revive(self, node: ClusterNode, timeout: float = 30.0) -> None:
        """Start a killed node again on its port and folder: it rejoins (from its
        nodes.conf) as a replica of the node that took its slots."""
        if node.alive:
            return
        node.server.start()
        self.wait_ok(timeout)

    def ensure_whole(self, timeout: float = 30.0) -> None:
        """Every node running and the cluster ok (after a test that killed one)."""
        dead = [n for n in self.nodes if not n.alive]
        for node in dead:
            node.server.start()
        if dead or not self.is_ok():
            self.wait_ok(timeout)

    def begin_migration(self, slot: int, to: ClusterNode) -> ClusterNode:
        """Mark ``slot`` IMPORTING on ``to`` and MIGRATING on its owner; return the owner.
        From now on the owner answers ASK for keys of the slot it no longer holds."""
        source = self.primary_for_slot(slot)
        if source is to:
            raise ValueError(f"{to} already serves slot {slot}")
        to.call("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        source.call("CLUSTER", "SETSLOT", slot, "MIGRATING", to.node_id)
        return source

    def move_keys(self, slot: int, source: ClusterNode, to: ClusterNode, batch: int = 100) -> int:
        """MIGRATE up to ``batch`` keys of ``slot`` from ``source`` to ``to``; the count
        moved (0 when the slot is empty on ``source``)."""
        keys = source.call("CLUSTER", "GETKEYSINSLOT", slot, batch)
        if keys:
            source.call("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys, timeout=10)
        return len(keys)

    def finish_migration(self, slot: int, source: ClusterNode, to: ClusterNode) -> None:
        """SETSLOT NODE: on the target first, then the source, then every other primary."""
        to.call("CLUSTER", "SETSLOT", slot, "NODE", to.node_id)
        source.call("CLUSTER", "SETSLOT", slot, "NODE", to.node_id)
        for node in self.primaries():
            if node is not to and node is not source:
                node.call("CLUSTER", "SETSLOT", slot, "NODE", to.node_id)

    def migrate_slot(
        self,
        slot: int,
        to: ClusterNode,
        *,
        batch: int = 100,
        between: Callable[[int], None] | None = None,
        timeout: float = 60.0,
    ) -> int:
        """Move ``slot`` with its keys to ``to``, as valkey-cli's reshard does; the keys
        moved. ``between(moved_so_far)`` runs after each MIGRATE batch (to interleave
        load or pause). Keys written meanwhile through ASK land on ``to`` directly."""
        source = self.begin_migration(slot, to)
        moved = 0
        deadline = time.monotonic() + timeout
        while n := self.move_keys(slot, source, to, batch):
            moved += n
            if between:
                between(moved)
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot} still had keys after {timeout}s")
        self.finish_migration(slot, source, to)
        self._wait(lambda: self.primary_for_slot(slot) is to, 10, f"slot {slot} on {to}")
        return moved

    def flushall(self) -> None:
        """Empty every primary (replicas follow), and wait until replicas have it too."""
        for node in self.primaries():
            node.call("FLUSHALL")
        for node in self.primaries():
            node.call("WAIT", self.n_replicas, 5000, timeout=10)

    # -- clients and stop --------------------------------------------------------------

    @property
    def seeds_url(self) -> str:
        """The URL the gateway takes: three seeds (the topology is discovered)."""
        seeds = ",".join(n.address for n in self.nodes[: max(3, self.n_primaries)])
        return f"redis+cluster://{seeds}"

    def client(self, **kwargs: Any) -> SyncRedisCluster:
        """A synchronous cluster client for assertions; the caller closes it."""
        node = self.live()[0]
        options: dict[str, Any] = {"decode_responses": True, "socket_timeout": 5}
        options.update(kwargs)
        return SyncRedisCluster(host="127.0.0.1", port=node.port, **options)

    def stop(self) -> None:
        for node in self.nodes:
            node.server.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (redis_sync.RedisError, OSError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
