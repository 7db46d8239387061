"""A private Sentinel deployment for tests: one primary, its replicas, 3 sentinels.

Every process is a real redis-server / valkey-server (found as the gateway finds it,
so the pip-shipped Valkey does) on a free loopback port, started by the test
session and killed with it. Settings are small so that a failover takes about
1-3 s: a primary is subjectively down after ``DOWN_AFTER_MS`` without a reply,
objectively down when 2 of the 3 sentinels agree (the quorum), and one
sentinel, elected by the others, then promotes a replica.

The data nodes require ``PASSWORD`` and the sentinels ``SENTINEL_PASSWORD``,
so the gateway's URL is exercised with both, as an operator would run it.

``kill_primary()`` is ``kill -9``; ``wait_for_promotion()`` polls the sentinels
until all of them name another primary and that server says it is one;
``heal()`` starts the killed servers again on their ports (empty: no
persistence) and waits until the sentinels have made them replicas of the new
primary and they are in sync, so the next test starts from a whole deployment.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis as redis_sync

from tests.servers import RedisServer, _die_with_parent, free_port

SERVICE = "realm-primary"
PASSWORD = "sentinel-data-8c1f2e"
SENTINEL_PASSWORD = "sentinel-own-4b9d07"
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


class SentinelDeployment:
    """``replicas`` replicas of one primary, watched by ``sentinels`` sentinels."""

    def __init__(self, root: Path, *, replicas: int = 1, sentinels: int = 3) -> None:
        self.root = root
        # requirepass is set once a node answers (see _start_node): the start-up
        # probe of tests/servers.py pings without a password.
        flags = ["--masterauth", PASSWORD, "--repl-diskless-sync", "yes",
                 "--repl-diskless-sync-delay", "0"]  # fmt: skip
        self.nodes = [RedisServer(root / f"node{i}", *flags) for i in range(1 + replicas)]
        self.sentinel_ports = [0] * sentinels
        self.sentinels: list[RedisServer] = []
        self.primary_port = 0

    # -- addresses ---------------------------------------------------------------------

    def url(self, *, db: int = 0, sentinel_auth: bool = True) -> str:
        """The gateway's URL for this deployment (docs/redis.md)."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        query = f"?sentinel_password={SENTINEL_PASSWORD}" if sentinel_auth else ""
        return f"redis+sentinel://:{PASSWORD}@{hosts}/{SERVICE}/{db}{query}"

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    @property
    def primary(self) -> RedisServer:
        return self.node(self.primary_port)

    @property
    def replicas(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.port != self.primary_port]

    def client(self, port: int | None = None) -> redis_sync.Redis:
        """A synchronous client of a data node (by default the current primary)."""
        return redis_sync.Redis(
            host="127.0.0.1", port=port or self.primary_port, password=PASSWORD,
            decode_responses=True, socket_timeout=5,
        )  # fmt: skip

    def _sentinel(self, port: int) -> redis_sync.Redis:
        return _sentinel_client(port, timeout=2)

    # -- life cycle --------------------------------------------------------------------

    def start(self) -> SentinelDeployment:
        primary, *replicas = self.nodes
        _start_node(primary)
        self.primary_port = primary.port
        for replica in replicas:
            replica.extra += ["--replicaof", "127.0.0.1", str(primary.port)]
            _start_node(replica)
        for i in range(len(self.sentinel_ports)):
            self.sentinels.append(self._start_sentinel(i))
        self.wait_until_agreed()
        return self

    def _start_sentinel(self, i: int) -> RedisServer:
        folder = self.root / f"sentinel{i}"
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        # Sentinel rewrites its config file (it records what it learns), so each
        # sentinel has a file of its own, written before it starts.
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f"requirepass {SENTINEL_PASSWORD}\n"
            # Sentinels talk to each other with the password they ask for.
            f"sentinel sentinel-pass {SENTINEL_PASSWORD}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} {QUORUM}\n"
            f"sentinel auth-pass {SERVICE} {PASSWORD}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        sentinel = _SentinelProcess(folder, conf, port)
        sentinel.start()
        self.sentinel_ports[i] = sentinel.port
        return sentinel

    def stop(self) -> None:
        for process in [*self.sentinels, *self.nodes]:
            process.stop()

    # -- faults and their end ----------------------------------------------------------

    def kill_primary(self) -> RedisServer:
        """``kill -9`` the current primary; returns it (dead)."""
        old = self.primary
        old.kill()
        return old

    def wait_for_promotion(self, old_port: int, timeout: float = 20.0) -> float:
        """Poll until every sentinel names a primary other than ``old_port`` and that
        server answers as a primary; the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            named = self._named_primaries()
            if len(named) == 1 and None not in named:
                port = next(iter(named))
                if port != old_port and self._role(port) == "master":
                    self.primary_port = port
                    return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise AssertionError(f"no promotion within {timeout} s; sentinels name {named}")
            time.sleep(0.05)

    def heal(self, timeout: float = 30.0) -> None:
        """Start every killed node again (same port, empty) as a replica of the
        current primary, and wait until it is in sync and the sentinels see it."""
        for node in self.nodes:
            if node.process is None:
                # As an operator would: back as a replica of the new primary. (Left to
                # the sentinels, an old primary back as an empty primary is converted
                # only after some 20 s of INFO polls.)
                if "--replicaof" in node.extra:
                    at = node.extra.index("--replicaof")
                    del node.extra[at : at + 3]
                node.extra += ["--replicaof", "127.0.0.1", str(self.primary_port)]
                _start_node(node)
        self.wait_until_agreed(timeout)

    def wait_until_agreed(self, timeout: float = 30.0) -> None:
        """Poll until every sentinel names the same primary, sees the other sentinels
        and every replica, and every replica's link to the primary is up and caught up."""
        deadline = time.monotonic() + timeout
        want_replicas = len(self.nodes) - 1
        state = ""
        while time.monotonic() < deadline:
            state = self._agreement(want_replicas)
            if not state:
                return
            time.sleep(0.05)
        raise AssertionError(f"the sentinels did not agree within {timeout} s: {state}")

    def _agreement(self, want_replicas: int) -> str:
        """'' when the deployment is whole, else what is missing."""
        named = self._named_primaries()
        if len(named) != 1 or None in named:
            return f"sentinels name {named}"
        self.primary_port = next(iter(named))  # type: ignore[assignment]
        for port in self.sentinel_ports:
            try:
                with self._sentinel(port) as s:
                    master = s.sentinel_master(SERVICE)
                    replicas = s.sentinel_slaves(SERVICE)
            except redis_sync.RedisError as exc:
                return f"sentinel {port}: {exc}"
            if master["num-other-sentinels"] != len(self.sentinel_ports) - 1:
                return f"sentinel {port} sees {master['num-other-sentinels']} other sentinels"
            if master["is_sdown"] or master["is_odown"]:
                return f"sentinel {port} thinks the primary is down"
            up = [r for r in replicas if not r["is_sdown"] and r["master-link-status"] == "ok"]
            if len(up) != want_replicas:
                return f"sentinel {port} sees {len(up)} of {want_replicas} replicas up"
        try:
            with self.client() as primary:
                info = primary.info("replication")
        except redis_sync.RedisError as exc:
            return f"primary: {exc}"
        if info.get("role") != "master" or info.get("connected_slaves") != want_replicas:
            return f"primary has {info.get('connected_slaves')} replicas"
        offset = info["master_repl_offset"]
        for i in range(want_replicas):
            replica = info[f"slave{i}"]
            if replica["state"] != "online" or replica["offset"] < offset:
                return f"replica {replica['port']} is at {replica['offset']} of {offset}"
        return ""

    def _named_primaries(self) -> set[int | None]:
        named: set[int | None] = set()
        for port in self.sentinel_ports:
            try:
                with self._sentinel(port) as s:
                    address = s.sentinel_get_master_addr_by_name(SERVICE)
            except redis_sync.RedisError:
                address = None
            named.add(int(address[1]) if address else None)
        return named

    def _role(self, port: int) -> str | None:
        try:
            with self.client(port) as node:
                return str(node.info("replication").get("role"))
        except redis_sync.RedisError:
            return None


def _sentinel_client(port: int, timeout: float) -> redis_sync.Redis:
    return redis_sync.Redis(host="127.0.0.1", port=port, password=SENTINEL_PASSWORD,
                            decode_responses=True, socket_timeout=timeout)  # fmt: skip


def _start_node(node: RedisServer) -> None:
    node.start()
    with redis_sync.Redis(host="127.0.0.1", port=node.port, socket_timeout=5) as client:
        client.config_set("requirepass", PASSWORD)


class _SentinelProcess(RedisServer):
    """A sentinel: a server started with its config file and ``--sentinel``."""

    def __init__(self, folder: Path, conf: Path, port: int) -> None:
        super().__init__(folder)
        self.conf = conf
        self.port = port

    def start(self) -> _SentinelProcess:
        args = [self.binary, str(self.conf), "--sentinel", "--dir", str(self.data_dir),
                "--logfile", "sentinel.log"]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with _sentinel_client(self.port, timeout=1) as s:
                    if s.ping():
                        return self
            except redis_sync.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"could not start a sentinel; see {self.data_dir}/sentinel.log")
