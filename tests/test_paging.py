"""Paging by position: runs started while a caller pages never shift a later page.

Each listing pages with a cursor that names the last run shown (its index score and
id). These tests page through runs while other runs are being started (one
workflow, a partitioned one, several at once, one key's runs, a phase filter) and
check every run that existed when paging began is seen exactly once, in order.
The HTTP API is paged the same way against a real listener."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from gateway.loading import parse_config
from gateway.model.errors import RealmError
from gateway.store.paging import list_runs_across
from gateway.store.runstore import RunStore
from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.servers import RedisServer

YAML = WORKFLOWS_YAML + "  spread:\n    steps: [a]\n    partitions: 4\n"
TOKEN = "paging-token-8c1e"


@pytest.fixture
async def paging_store(redis: Redis) -> RunStore:
    return RunStore(redis, parse_config(YAML, file="t.yaml", with_triggers=False), timeout=5.0)


async def _page_all(
    store: RunStore, workflows: list[str], limit: int, read: asyncio.Event, **where: str
) -> tuple[list[str], int]:
    """Every run id the pages show, in order, and how many pages there were; ``read``
    is set once the first page is read, and other runs are started between pages."""
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        runs, cursor = await list_runs_across(store, workflows, limit=limit, cursor=cursor, **where)
        pages += 1
        read.set()
        seen += [run.id for run in runs]
        await asyncio.sleep(0)  # the starters run between pages
        if cursor is None:
            return seen, pages


async def _starting(
    store: RunStore, workflows: list[str], go: asyncio.Event, stop: asyncio.Event, **kw: str
) -> int:
    """Starts runs from when ``go`` is set until ``stop`` is."""
    await go.wait()
    n = 0
    while not stop.is_set():
        await store.start_run(workflows[n % len(workflows)], {}, **kw)
        n += 1
        await asyncio.sleep(0)
    return n


@pytest.mark.parametrize(
    "workflows",
    [["sync"], ["spread"], ["sync", "single", "spread"]],
    ids=["one", "partitioned", "several"],
)
async def test_every_run_is_seen_once_while_runs_are_started(
    paging_store: RunStore, workflows: list[str]
) -> None:
    before = [
        (await paging_store.start_run(workflows[i % len(workflows)], {})).run_id for i in range(97)
    ]
    go, stop = asyncio.Event(), asyncio.Event()
    starter = asyncio.create_task(_starting(paging_store, workflows, go, stop))
    try:
        seen, pages = await _page_all(paging_store, workflows, 7, go)
    finally:
        stop.set()
        go.set()
        started_meanwhile = await starter
    assert started_meanwhile > 0
    assert len(seen) == len(set(seen))  # none twice
    assert [r for r in seen if r in set(before)] == before[::-1]  # none skipped, in order
    assert set(seen) == set(before)  # those started meanwhile come before page 1's
    assert pages == 14


async def test_a_keys_runs_and_a_phase_filter_page_by_position(paging_store: RunStore) -> None:
    runs = []
    for _ in range(12):
        runs.append(
            (await paging_store.start_run("sync", {}, "k", on_live_match="cancel_existing")).run_id
        )
    go, stop = asyncio.Event(), asyncio.Event()
    starter = asyncio.create_task(
        _starting(
            paging_store, ["sync"], go, stop, idempotency_key="k", on_live_match="cancel_existing"
        )
    )
    try:
        keyed, _ = await _page_all(paging_store, ["sync"], 5, go, key="k")
        cancelled, _ = await _page_all(paging_store, ["sync"], 4, go, phase="cancelled")
    finally:
        stop.set()
        go.set()
        await starter
    assert keyed == runs[::-1]
    # All 12 were cancelled by the next start (the last by the starter's first), once
    # each and in order; the starter's own cancelled runs may come first.
    assert len(cancelled) == len(set(cancelled))
    assert [r for r in cancelled if r in set(runs)] == runs[::-1]


async def test_a_cursor_that_is_not_a_position_is_refused(paging_store: RunStore) -> None:
    for bad in ("3", "12.9.-.30", "1.not-a-run", "x.6c48086c-cb0f-47ea-9c33-6279fe42ffdc"):
        with pytest.raises(RealmError) as refused:
            await paging_store.list_runs("sync", cursor=bad)
        assert (refused.value.code, refused.value.message) == (
            "VALIDATION_PARAMS",
            f"cursor {bad!r} is not one this API returned",
        )


@pytest.fixture(scope="module")
def api_listener(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Listener, str]]:
    server = RedisServer(tmp_path_factory.mktemp("paging-redis")).start()
    workdir = tmp_path_factory.mktemp("paging")
    listener = Listener(workdir, YAML, redis_url=server.url, env={"REALM_API_TOKEN": TOKEN}).start()
    yield listener, server.url
    listener.stop()
    server.stop()


def test_the_api_pages_by_position_while_runs_are_started(
    api_listener: tuple[Listener, str], tmp_path: Path
) -> None:
    listener, _ = api_listener
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=listener.base_url, headers=auth, timeout=10) as api:
        before = [
            api.post("/v1/workflows/spread/runs", json={}).json()["run_id"] for _ in range(40)
        ]
        stop = threading.Event()
        started: list[str] = []

        def keep_starting() -> None:
            with httpx.Client(base_url=listener.base_url, headers=auth, timeout=10) as other:
                while not stop.is_set():
                    reply = other.post("/v1/workflows/spread/runs", json={})
                    started.append(reply.json()["run_id"])

        starter = threading.Thread(target=keep_starting)
        starter.start()
        seen: list[str] = []
        params: dict[str, str | int] = {"limit": 6}
        try:
            while True:
                page = api.get("/v1/workflows/spread/runs", params=params).json()
                seen += [run["run_id"] for run in page["runs"]]
                if page["cursor"] is None:
                    break
                params["cursor"] = page["cursor"]
                # A run is started between every two pages.
                now = len(started)
                deadline = time.monotonic() + 10
                while len(started) == now and time.monotonic() < deadline:
                    time.sleep(0.001)
        finally:
            stop.set()
            starter.join()
    assert len(started) >= 6
    assert len(seen) == len(set(seen))
    assert set(seen) == set(before)
    assert [r for r in seen if r in set(before)] == before[::-1]
