"""Exactly once under load, as the fault, failover and cluster tests check it
(tests/test_faults.py, test_failover.py, test_pipeline_cluster.py; test_durability.py
and test_sentinel.py take the trigger and the events).

The load: distinct GitHub push deliveries, signed as GitHub signs them (``make_events``),
each sent some times in any order (``redelivered``), by senders that retry like GitHub
(tests/senders.py), to a real `realm listen --workers 2` (``listening``). The verdict
(``judge``) reads what Redis holds for the `deploy` workflow and sets it against what
the senders were told: one piece of work, one run and one stream entry per event, and every 2xx
names a run that is stored (``assert_exactly_once``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis as redis_sync

from gateway.store.keys import Keys
from tests.listener import Listener
from tests.senders import Attempt, Delivery, Outcome, Tally, send_all
from tests.signing import github_headers

GITHUB_SECRET = "gh-faults-7d41c09e2b5a83f6"
ENV = {"GITHUB_WEBHOOK_SECRET": GITHUB_SECRET}
DEPLOY = Keys("realm", "deploy")
SENDERS = 32

# As in the benchmark: one workflow, one GitHub trigger keyed by X-GitHub-Delivery.
CONFIG = """\
version: 1
workflows:
  deploy:
    steps: [fetch, build]
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {type: string}
        sha: {type: string, pattern: "^[0-9a-f]{40}$"}
triggers:
  github-push:
    workflow: deploy
    path: /hooks/github
    verify: {scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}
    when:
      - {header: X-GitHub-Event, equals: push}
    event_id: {header: X-GitHub-Delivery}
    params:
      repo: $.repository.full_name
      sha: $.after
"""


def make_events(n: int, seed: int) -> list[Delivery]:
    """``n`` distinct GitHub push deliveries, signed as GitHub signs them."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        event_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        sha = hashlib.sha1(event_id.encode()).hexdigest()
        body = orjson.dumps(
            {
                "ref": "refs/heads/main",
                "before": hashlib.sha1(sha.encode()).hexdigest(),
                "after": sha,
                "repository": {"full_name": f"octo-org/repo-{i % 17}", "private": True},
                "pusher": {"name": "mona", "email": "mona@example.com"},
                "head_commit": {"id": sha, "message": f"change {i}"},
            }
        )
        headers = github_headers(
            body, GITHUB_SECRET, delivery=event_id, **{"User-Agent": "GitHub-Hookshot/7f3d1c2"}
        )
        events.append(Delivery(event_id, body, headers))
    return events


def redelivered(events: Sequence[Delivery], times: int, seed: int) -> list[Delivery]:
    """Each event ``times`` times, shuffled: redeliveries arrive in any order."""
    deliveries = [e for e in events for _ in range(times)]
    random.Random(seed).shuffle(deliveries)
    return deliveries


@contextmanager
def listening(tmp_path: Path, redis_url: str, config: str = CONFIG) -> Iterator[Listener]:
    """A `realm listen --workers 2` of ``config``, both workers serving."""
    workdir = tmp_path / "listen"
    workdir.mkdir(parents=True, exist_ok=True)
    listener = Listener(workdir, config, redis_url=redis_url, env=ENV, workers=2).start()
    try:
        wait_for_workers(listener, 2)
        yield listener
    finally:
        listener.stop()


async def loaded(
    listener: Listener,
    deliveries: Sequence[Delivery],
    tally: Tally,
    *,
    acked: int,
    seconds: float,
    **more: Any,
) -> asyncio.Task[list[Outcome]]:
    """Start SENDERS senders on ``deliveries`` in the background and return once ``acked``
    of them were acknowledged (the moment a test brings its fault): the load, to await
    for its outcomes. ``more`` goes to send_all (``give_up``)."""
    load = asyncio.create_task(
        send_all(listener.base_url, deliveries, concurrency=SENDERS, seconds=seconds,
                 tally=tally, **more)
    )  # fmt: skip
    await reached(tally.acked_at_least(acked), load, timeout=60)
    return load


@contextmanager
def admin(url: str) -> Iterator[redis_sync.Redis]:
    db = redis_sync.Redis.from_url(url, decode_responses=True, socket_timeout=10)
    try:
        yield db
    finally:
        db.close()


@dataclass
class Stored:
    """What Redis holds for the `deploy` workflow after a load."""

    runs: list[str]
    key_of: dict[str, str | None]  # run id -> the key (event id) in its run hash
    stream: Counter[str]  # run id -> stream entries naming it
    pointer: dict[str, str | None]  # event id -> the run its key pointer names

    @property
    def runs_by_event(self) -> dict[str, list[str]]:
        by_event: dict[str, list[str]] = {}
        for run_id in self.runs:
            key = self.key_of[run_id]
            if key is not None:
                by_event.setdefault(key, []).append(run_id)
        return by_event


def read_store(url: str, event_ids: Sequence[str]) -> Stored:
    with admin(url) as db:
        runs = db.zrange(DEPLOY.runs(), 0, -1)
        pipe = db.pipeline(transaction=False)
        for run_id in runs:
            pipe.hget(DEPLOY.run(run_id), "key")
        keys = pipe.execute()
        stream = Counter(fields["run_id"] for _, fields in db.xrange(DEPLOY.stream()))
        pipe = db.pipeline(transaction=False)
        for event_id in event_ids:
            pipe.hget(DEPLOY.pointer(event_id), "run")
        pointers = pipe.execute()
    return Stored(
        runs=runs,
        key_of=dict(zip(runs, keys, strict=True)),
        stream=stream,
        pointer=dict(zip(event_ids, pointers, strict=True)),
    )


@dataclass
class Verdict:
    """One piece of work, one run, checked over one load: events, runs, what senders heard."""

    events: int
    deliveries: int
    acked: int  # deliveries that ended with a 2xx
    unacked: int  # deliveries whose sender gave up
    attempts: int
    runs: int
    stream: int
    events_without_run: int
    events_with_several_runs: int
    runs_without_one_stream_entry: int
    acked_lost: int  # events acknowledged with a run id that is not fully stored
    acked_other_run: int  # events acknowledged with a run id that is not their run
    started: int  # 202 `started` replies
    statuses: Counter[str]  # non-2xx attempts by status ("conn" = no HTTP reply)

    @property
    def duplicates(self) -> int:
        """Runs beyond the first of each event."""
        return self.runs - (self.events - self.events_without_run)

    @property
    def non2xx(self) -> int:
        return sum(self.statuses.values())


def judge(url: str, events: Sequence[Delivery], outcomes: Sequence[Outcome]) -> Verdict:
    event_ids = [e.event_id for e in events]
    stored = read_store(url, event_ids)
    by_event = stored.runs_by_event
    acked_runs: dict[str, set[str]] = {}
    for o in outcomes:
        if o.acked is not None and o.acked.run_id is not None:
            acked_runs.setdefault(o.delivery.event_id, set()).add(o.acked.run_id)
    lost = other = 0
    run_set = set(stored.runs)
    for event_id, run_ids in acked_runs.items():
        if any(r not in run_set or stored.stream[r] != 1 for r in run_ids):
            lost += 1
        elif by_event.get(event_id) != sorted(run_ids) or stored.pointer[event_id] not in run_ids:
            other += 1
    attempts = [a for o in outcomes for a in o.attempts]
    return Verdict(
        events=len(events),
        deliveries=len(outcomes),
        acked=sum(o.acked is not None for o in outcomes),
        unacked=sum(o.acked is None for o in outcomes),
        attempts=len(attempts),
        runs=len(stored.runs),
        stream=sum(stored.stream.values()),
        events_without_run=sum(e not in by_event for e in event_ids),
        events_with_several_runs=sum(len(r) > 1 for r in by_event.values()),
        runs_without_one_stream_entry=sum(stored.stream[r] != 1 for r in stored.runs),
        acked_lost=lost,
        acked_other_run=other,
        started=sum(a.ok and a.outcome == "started" for a in attempts),
        statuses=Counter(
            "conn" if a.status is None else str(a.status) for a in attempts if not a.ok
        ),
    )


def assert_exactly_once(v: Verdict) -> None:
    """Every event has one run and one stream entry; every 2xx named that run."""
    assert v.unacked == 0, v
    assert v.events_without_run == 0, v
    assert v.events_with_several_runs == 0, v
    assert v.runs == v.events, v
    assert v.stream == v.events and v.runs_without_one_stream_entry == 0, v
    assert v.acked_lost == 0 and v.acked_other_run == 0, v


def figures(name: str, **values: Any) -> None:
    parts = [f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()]
    print(f"\nFIGURES {name}: {' '.join(parts)}")


def count(v: Verdict, status: str) -> int:
    return v.statuses.get(status, 0)


def first_2xx_after(attempts: Sequence[Attempt], t: float) -> float | None:
    """Seconds from ``t`` to the first 2xx reply that arrived after it."""
    done = [a.done for a in attempts if a.ok and a.done >= t]
    return min(done) - t if done else None


def connections_per_worker(listener: Listener) -> list[int]:
    """Established connections to the listener's port held by each of its worker
    processes (from /proc), most first: which workers the senders reached."""
    assert listener.process is not None
    proc = Path("/proc")
    established: set[str] = set()  # socket inodes
    for table in ("tcp", "tcp6"):
        path = proc / "net" / table
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if port == listener.port and fields[3] == "01":
                established.add(fields[9])
    counts = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != listener.process.pid:
                continue
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        sockets = [link[8:-1] for link in links if link.startswith("socket:[")]
        counts.append(sum(inode in established for inode in sockets))
    return sorted((c for c in counts if c), reverse=True)


def wait_for_workers(listener: Listener, workers: int, timeout: float = 20.0) -> None:
    """Poll until ``workers`` worker processes serve requests: Listener.start()
    returns as soon as one answers, while the other may still be starting."""
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{listener.port}\r\n\r\n".encode()
    deadline = time.monotonic() + timeout
    while True:
        sockets = [socket.create_connection(("127.0.0.1", listener.port), 5) for _ in range(16)]
        try:
            for sock in sockets:
                sock.sendall(request)
            for sock in sockets:
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            serving = len(connections_per_worker(listener))
        finally:
            for sock in sockets:
                sock.close()
        if serving >= workers:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"only {serving} of {workers} workers serve after {timeout} s")
        time.sleep(0.1)


async def reached(event: asyncio.Event, load: asyncio.Task[Any], timeout: float) -> None:
    """Wait until ``event`` is set; fail if the load ends first or time runs out."""
    waiter = asyncio.ensure_future(event.wait())
    done, _ = await asyncio.wait({waiter, load}, timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    waiter.cancel()
    assert waiter in done or event.is_set(), "the load ended (or stalled) before the threshold"


async def polled(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    """Wait, polling, until ``condition()`` is true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def metric(listener: Listener, name: str, *, labelled: bool = False) -> float:
    """The sum of ``name``'s samples on /metrics (every label, every worker). A
    ``labelled`` one has no sample before its first (and, with several workers, no
    HELP line either): 0 then."""
    text = httpx.get(f"{listener.base_url}/metrics", timeout=5).text
    if not labelled and f"# HELP {name.removesuffix('_total')}" not in text:
        raise AssertionError(f"/metrics has no {name}")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    )


async def spool_drained(listener: Listener, timeout: float = 60.0) -> None:
    """Wait until the listener's workers hold nothing in their spools: what they
    accepted while Redis could not take it has been claimed, so its runs are there
    to judge."""
    await polled(
        lambda: metric(listener, "realm_spool_records") == 0, "the spools to drain", timeout
    )
