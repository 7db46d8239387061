"""What one delivery costs Redis, counted by the server rather than timed: a real
`realm listen` with its default settings (delivery log on, the replay guard on for a
GitHub trigger) takes 200 unique signed 3 KB pushes, and the Redis it uses says how
many commands it ran for them (``INFO commandstats``, which counts the commands run
inside Lua scripts too) and how many bytes it read (``INFO stats``
``total_net_input_bytes``). Counts, unlike req/s, do not move with the load of the
machine, so a change to the request path shows in them exactly.

The trigger and the bodies are the benchmark's (bench/listen_bench.py): the GitHub
push trigger of the shipped triggers.yaml (event id from ``X-GitHub-Delivery``) and
push payloads of ≈ 3 KB, each with its own commits, so no body repeats.

Two states of the log are measured: ``fresh`` (it holds a few records) and ``full``
(at ``max_deliveries``, where each record written makes the oldest leave: the steady
state of any gateway that has taken that many deliveries within the retention; past
the retention each record leaves the same way, one trim each).

Each measurement prints ``FIGURES delivery-cost-<state>: ...``: commands and bytes
per delivery, and the commands by name. ``REALM_COST_VARIANTS=1`` also measures the
listener with the delivery log off, the replay guard off, and both
(``test_variants``; not run by default).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync
import yaml

from bench.listen_bench import TRIGGERS_YAML, encode, push_payload
from gateway.model.config import DEFAULT_MAX_DELIVERIES
from tests.listener import Listener
from tests.servers import RedisServer
from tests.signing import github_headers

# -- the budget -----------------------------------------------------------------------
# What one unique delivery may cost Redis with the default settings, on average over
# 200 (the listener's background work taken out, below). The table is the split of the
# commands; the test holds the total to MAX_COMMANDS and prints the measured figure of
# each command beside its share here, so an overrun shows where. A change that adds a
# command to the hot path says so here.
MAX_COMMANDS = 12
BUDGET: dict[str, float] = {
    # The claim, one script call (start_run.lua) for a new event of a new key:
    "evalsha": 1,  # the call itself
    "time": 1,  # the server's clock: the run index's and the key's scores
    "hmget": 1,  # the key's pointer: who holds the key
    "hset": 2,  # the run hash; the key's pointer
    "zadd": 3,  # the workflow's run index; the key's run set; the workflow's key index
    "xadd": 1,  # the runners' stream entry
    # The replay guard's marker (placed, read and dated by one SET … NX GET PX), and
    # the delivery log's record (one SET … PX: its summary, and its JSON and body
    # compressed).
    "set": 2,
    # What is left, 1 command, is for what a batch of log records costs together (a
    # flush's reads of the index, its script call, the index's ZADD and the trims of
    # a full log, shared by the records of the flush) and rounding.
}
# Bytes Redis reads per delivery, beyond the delivery's own body (whose one copy the
# log keeps, compressed): the claim's script call, the replay guard's digest, the
# log's headers and summary.
BYTES_OVER_BODY = 1024
assert sum(BUDGET.values()) <= MAX_COMMANDS

# -- what a delivery costs today ------------------------------------------------------
# Commands per delivery now, fresh log: the budget's split exactly. ``BATCHED``
# commands cost more than this by the share of the log's flushes (every 100 ms: one
# pipeline of ZCARD and ZRANGE on the index, then per 32 records one
# record_deliveries.lua call with one ZADD to the index): between 0 and
# ``BATCH_SHARE`` more per delivery, as the deliveries fall into flushes.
TODAY: dict[str, float] = dict(BUDGET)
BATCHED = ("evalsha", "zadd", "zcard", "zrange")
BATCH_SHARE = 1.0
# At its cap a flush's call also makes as many old records leave as it writes: which
# are still there (ZMSCORE), out of the index (ZREM), their records (DEL); and the
# index's size (ZCARD), once per call.
BATCHED_FULL = ("zmscore", "zrem", "del")
# Bytes read per delivery beyond its body now (fresh log): the claim's call, the
# log's record less what compressing the body saves. Below zero: a 3 KB GitHub push
# compresses more than 3 times.
TODAY_BYTES_OVER_BODY = (-600, 100)

# -- the measurement ------------------------------------------------------------------
DELIVERIES = 200  # measured, all unique
WARM = 20  # first: scripts loaded, connections made, the log's first flush done
CONNECTIONS = 32  # concurrent senders: the log's flushes then take tens of records each
# The listener's own background work (the sweep of each workflow about every second,
# the log's trim every second while idle; /metrics reads the queues only when
# scraped, and nothing scrapes it here) runs during a window too. Its rate is taken
# over an idle window of IDLE_SECONDS first and taken out of each window in
# proportion to its length (≈ 1 s: ≈ 25 commands and ≈ 1 KB, ≈ 0.12 commands and
# 5 bytes per delivery). The sweep ticks at random (0.5-1.5 s), so what is taken out
# is right within about one tick (≈ 25 commands: 0.1 per delivery over all commands).
IDLE_SECONDS = 3.0
DEADLINE = 30.0  # seconds for the log to show every record
LOG = "realm:{deliveries:log}"
RUNS = "realm:{deploy}:runs"
SECRET_ENV = "GITHUB_WEBHOOK_SECRET"
_PACKER = redis_sync.Connection()  # packs commands as the probe's client sends them


class Probe:
    """The test's one connection to the server. It counts what it sends after each
    reset, so that exactly that is taken out of the server's figures: every poll,
    the reset, the read of the figures.

    How the server counts the two commands around a window (checked by
    ``test_the_probe_takes_out_exactly_what_it_sent``): CONFIG RESETSTAT zeroes the
    figures as it runs, so its bytes are not counted and its call is; INFO reads the
    figures after its own bytes were counted and before its own call is."""

    def __init__(self, url: str) -> None:
        # One connection, made now: redis-py's greeting on connecting (CLIENT SETINFO)
        # comes before any window, never inside one.
        self.db = redis_sync.Redis.from_url(url, single_connection_client=True, socket_timeout=10)
        self.db.ping()
        self.calls: Counter[str] = Counter()
        self.bytes = 0

    def close(self) -> None:
        self.db.close()

    def run(self, *args: str | int) -> Any:
        self.calls[str(args[0]).lower()] += 1
        self.bytes += sum(len(part) for part in _PACKER.pack_command(*args))
        return self.db.execute_command(*args)

    def reset(self) -> None:
        self.db.config_resetstat()
        self.calls, self.bytes = Counter({"config|resetstat": 1}), 0

    def figures(self) -> tuple[Counter[str], int]:
        """Calls by command and bytes read by the server since the reset, less the
        probe's own."""
        self.bytes += sum(len(part) for part in _PACKER.pack_command("INFO", "commandstats",
                                                                      "stats"))  # fmt: skip
        info = self.db.info("commandstats", "stats")
        calls = Counter(
            {name.removeprefix("cmdstat_"): int(value["calls"])
             for name, value in info.items() if name.startswith("cmdstat_")}
        )  # fmt: skip
        calls.subtract(self.calls)
        bytes_in = int(info["total_net_input_bytes"]) - self.bytes
        return Counter({name: n for name, n in calls.items() if n}), bytes_in


@dataclass
class Window:
    """What the listener sent Redis over ``seconds``."""

    calls: Counter[str]
    bytes: int
    seconds: float


@dataclass
class Cost:
    """Per delivery, the background taken out."""

    state: str
    commands: dict[str, float]  # by name
    bytes: float
    body: float  # mean body length
    window: Window
    background: Window  # what was taken out

    @property
    def total(self) -> float:
        return sum(self.commands.values())

    def figures(self, name: str) -> str:
        shown = sorted(self.commands.items(), key=lambda kv: (-kv[1], kv[0]))
        return (
            f"FIGURES delivery-cost-{name}: deliveries={DELIVERIES} "
            f"commands={self.total:.2f} bytes={self.bytes:.0f} body={self.body:.0f} "
            f"over_body={self.bytes - self.body:.0f} window_s={self.window.seconds:.2f} "
            f"background_commands={sum(self.background.calls.values()):.1f} "
            f"background_bytes={self.background.bytes:.0f} "
            + " ".join(f"{c}={n:.2f}" for c, n in shown)
        )


def _window(probe: Probe, started: float) -> Window:
    calls, bytes_in = probe.figures()
    return Window(calls, bytes_in, time.monotonic() - started)


def _cost(state: str, window: Window, idle: Window, body: float) -> Cost:
    scale = window.seconds / idle.seconds
    background = Window(
        Counter({c: n * scale for c, n in idle.calls.items()}),  # type: ignore[misc]
        round(idle.bytes * scale),
        window.seconds,
    )
    commands = {
        c: (window.calls[c] - background.calls[c]) / DELIVERIES
        for c in {*window.calls, *background.calls}
    }
    kept = {c: n for c, n in commands.items() if abs(n) >= 0.005}
    return Cost(state, kept, (window.bytes - background.bytes) / DELIVERIES, body, window,
                background)  # fmt: skip


# The log's layout, in these two functions only: when it changes, so do they.
def records_since(probe: Probe, floor: str) -> int:
    """Records the log holds whose id is above ``floor`` ('-': all)."""
    return int(probe.run("ZLEXCOUNT", f"{LOG}:index", floor, "+"))


def fill_log(probe: Probe, cap: int) -> str:
    """Fill the log's index to ``cap`` with ids older than any record (an hour old,
    inside the retention), so that each record written from now on makes one leave;
    the highest of those ids. Only the index is filled: a trim's DEL of the record is
    one command whether or not the record is there."""
    held = int(probe.run("ZCARD", f"{LOG}:index"))
    ms = int(time.time() * 1000) - 3_600_000
    ids = [f"dlv-{ms:012x}-{i:08x}" for i in range(cap - held)]
    for start in range(0, len(ids), 1000):
        probe.run("ZADD", f"{LOG}:index", *(x for i in ids[start : start + 1000] for x in (0, i)))
    return "(" + ids[-1]


async def _post_all(base_url: str, secret: str, bodies: list[bytes]) -> list[int]:
    limits = httpx.Limits(max_connections=CONNECTIONS)
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:

        async def one(body: bytes) -> int:
            reply = await client.post("/hooks/github", content=body,
                                      headers=github_headers(body, secret))  # fmt: skip
            return reply.status_code

        return list(await asyncio.gather(*(one(body) for body in bodies)))


def _wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE:g}s"
        time.sleep(0.02)


def measure(workdir: Path, config_text: str, *, log: bool = True) -> dict[str, Cost]:
    """Start Redis and a listener of ``config_text``, warm them, take the background's
    rate over an idle window, then measure DELIVERIES deliveries with the log fresh
    and, with the log on, DELIVERIES more with the log full."""
    server = RedisServer(workdir / "redis").start()
    secret = secrets.token_hex(20)
    listener = Listener(workdir, config_text, redis_url=server.url,
                        env={SECRET_ENV: secret})  # fmt: skip
    probe = Probe(server.url)
    rng = random.Random(7)
    made = [0]

    def bodies(n: int) -> list[bytes]:
        made[0] += n
        return [encode(push_payload(rng, made[0] - n + i)) for i in range(n)]

    def deliver(n: int) -> float:
        sent = bodies(n)
        codes = asyncio.run(_post_all(listener.base_url, secret, sent))
        assert Counter(codes) == {202: n}  # every one new: a run started for each
        return sum(map(len, sent)) / n

    try:
        listener.start()
        deliver(WARM)
        if log:
            _wait_for("the warm-up's records", lambda: records_since(probe, "-") == WARM)
        probe.reset()
        started = time.monotonic()
        # An idle window: nothing to synchronise with, a time to measure over.
        time.sleep(IDLE_SECONDS)
        idle = _window(probe, started)

        costs: dict[str, Cost] = {}
        states = [("fresh", "-"), ("full", None)] if log else [("fresh", "-")]
        for state, floor in states:
            if floor is None:
                floor = fill_log(probe, DEFAULT_MAX_DELIVERIES)
            want = (records_since(probe, floor) if log else 0) + DELIVERIES
            probe.reset()
            started = time.monotonic()
            body = deliver(DELIVERIES)
            if log:
                # Each record is in once the log shows it: the flush that wrote it (and
                # the trims it made) is done.
                _wait_for(f"{state}: every record in the log",
                          lambda f=floor, n=want: records_since(probe, f) == n)  # fmt: skip
            costs[state] = _cost(state, _window(probe, started), idle, body)
        # Every delivery started exactly one run (read after the windows).
        assert int(probe.run("ZCARD", RUNS)) == WARM + DELIVERIES * len(states)
        return costs
    finally:
        probe.close()
        listener.stop()
        server.stop()


def _config(*, delivery_log: bool = True, replay_guard: bool = True) -> str:
    doc = yaml.safe_load(TRIGGERS_YAML)
    assert "settings" not in doc  # the benchmark's trigger, with every default
    if not delivery_log:
        doc["settings"] = {"delivery_log": False}
    if not replay_guard:
        doc["triggers"]["github-push"]["replay_guard"] = False
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Cost]:
    costs = measure(tmp_path_factory.mktemp("cost"), _config())
    for state, cost in costs.items():
        print(f"\n{cost.figures(state)}")
    return costs


# -- the tests ------------------------------------------------------------------------


def test_the_probe_takes_out_exactly_what_it_sent(
    start_redis: Callable[..., RedisServer],
) -> None:
    """Nothing but the probe talks to this server: what is left of the server's figures
    once the probe's own are taken out is nothing, calls and bytes."""
    server = start_redis()
    probe = Probe(server.url)
    try:
        for _ in range(3):
            probe.reset()
            for n in range(5):
                probe.run("ZLEXCOUNT", f"{LOG}:index", "-", "+")
                probe.run("ZADD", "probe:z", n, f"member-{n}")
            assert probe.figures() == (Counter(), 0)
    finally:
        probe.close()


@pytest.mark.slow
@pytest.mark.parametrize("state", ["fresh", "full"])
def test_a_delivery_costs_what_the_breakdown_says(defaults: dict[str, Cost], state: str) -> None:
    """Today's figures, command by command: the measurement is the one the budget test
    reads, and this says it counts what it should. A change to the request path
    changes these figures: update TODAY (and the budget test's mark) with it."""
    cost = defaults[state]
    want = Counter(TODAY)
    batched = BATCHED + (BATCHED_FULL if state == "full" else ())
    measured = cost.commands
    # Per-record commands: whole numbers, give or take what the background leaves.
    for command in sorted({*want, *measured} - set(batched)):
        got, expected = measured.get(command, 0.0), want.get(command, 0)
        assert abs(got - expected) < 0.1, f"{command}: {cost.figures(state)}"
    for command in batched:
        share = measured.get(command, 0.0) - want.get(command, 0)
        assert 0 < share <= BATCH_SHARE, f"{command}: {cost.figures(state)}"
    # What the background leaves behind (sweep commands, within a tick): little.
    rest = [n for c, n in measured.items() if c not in {*want, *batched}]
    assert sum(abs(n) for n in rest) < 0.25, cost.figures(state)
    low, high = TODAY_BYTES_OVER_BODY
    assert low <= cost.bytes - cost.body <= high, cost.figures(state)


@pytest.mark.slow
def test_a_delivery_fits_the_budget(defaults: dict[str, Cost]) -> None:
    for state, cost in defaults.items():
        over = {
            c: f"{n:.2f} > {BUDGET.get(c, 0):g}"
            for c, n in sorted(cost.commands.items())
            if n > BUDGET.get(c, 0) + 0.05
        }
        assert cost.total <= MAX_COMMANDS, f"{state}: {cost.total:.2f} commands; over: {over}"
        assert cost.bytes <= cost.body + BYTES_OVER_BODY, (
            f"{state}: {cost.bytes:.0f} bytes for a {cost.body:.0f}-byte body"
        )


VARIANTS = {
    "nolog": {"delivery_log": False},
    "noguard": {"replay_guard": False},
    "neither": {"delivery_log": False, "replay_guard": False},
}


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("REALM_COST_VARIANTS"),
    reason="diagnostic: REALM_COST_VARIANTS=1 measures the features one by one",
)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants(tmp_path: Path, variant: str) -> None:
    """What each feature costs: the same measurement with it off. Each variant costs
    less than the defaults by at least its feature's commands per record."""
    options = VARIANTS[variant]
    costs = measure(tmp_path, _config(**options), log=options.get("delivery_log", True))
    for state, cost in costs.items():
        print(f"\n{cost.figures(f'{variant}-{state}')}")
    fresh = costs["fresh"].total
    saved = 1 * (not options.get("delivery_log", True)) + 1 * (
        not options.get("replay_guard", True)
    )
    assert fresh <= sum(TODAY.values()) - saved + BATCH_SHARE
