"""Hot-workflow partitions: `partitions: N` spreads a workflow's keys over N
hash tags; every policy on a repeated key holds unchanged, because one idempotency key
always lives in one partition. Against a real Redis of the tests' own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
from redis.asyncio import Redis

from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, RealmError
from gateway.store.keys import Keys, partition_of, partition_of_run
from gateway.store.runstore import RunStore
from gateway.store.sweep import sweep
from tests.listener import Listener

N = 4
YAML = f"""
version: 1
workflows:
  hot:
    steps: [fetch, load]
    retention: 1s
    partitions: {N}
  plain:
    steps: [only]
"""


@pytest.fixture
def hot_config() -> Config:
    return parse_config(YAML, file="hot.yaml", with_triggers=False)


@pytest.fixture
async def hot(redis: Redis, hot_config: Config) -> RunStore:
    return RunStore(redis, hot_config, timeout=5.0)


def part_keys(p: int) -> Keys:
    return Keys("realm", "hot", p)


async def sizes(redis: Redis) -> list[int]:
    return [await redis.zcard(part_keys(p).runs()) for p in range(N)]


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ where things live


async def test_keyless_starts_spread_over_every_partition(hot: RunStore, redis: Redis) -> None:
    runs = await asyncio.gather(*(hot.start_run("hot", {"n": n}) for n in range(200)))
    counts = await sizes(redis)
    assert sum(counts) == 200 and all(c > 0 for c in counts), counts
    # Each run's id names its partition, and get_run finds it from the id alone.
    for run in runs[:20]:
        p = partition_of_run(run.run_id, N)
        assert await redis.exists(part_keys(p).run(run.run_id))
        assert (await hot.get_run(run.run_id)).id == run.run_id
    assert not await redis.exists("realm:{hot}:runs"), "nothing under the unpartitioned tag"


@pytest.mark.parametrize("live", ["use_existing", "fail", "cancel_existing"])
async def test_a_key_lives_in_one_partition_and_its_policies_hold(
    hot: RunStore, redis: Redis, live: str
) -> None:
    key = "order-4417"
    p = partition_of(key, N)
    outcomes = await asyncio.gather(
        *(hot.start_run("hot", {"n": n}, key, live) for n in range(20)),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    started = [o for o in outcomes if not isinstance(o, BaseException) and not o.deduped]
    refused = [o for o in outcomes if isinstance(o, RealmError)]
    assert (
        len(started)
        + len(refused)
        + sum(1 for o in outcomes if not isinstance(o, BaseException) and o.deduped)
        == 20
    ), outcomes
    if live == "fail":
        assert {e.code for e in refused} == {"STATE_RUN_ALREADY_ACTIVE"}
    keyruns = part_keys(p).key_runs(key)
    if live == "cancel_existing":
        assert len(started) == 20 and await redis.zcard(keyruns) == 20
    else:
        assert len(started) == 1 and await redis.zcard(keyruns) == 1
    page, _ = await hot.list_runs("hot", key=key, phase="running", limit=50)
    assert len(page) == 1, "exactly one live run for the key"
    # Every run of the key is in the key's partition.
    assert sum(await sizes(redis)) == await redis.zcard(part_keys(p).runs())


async def test_steps_cancels_and_redeliveries_work_across_partitions(hot: RunStore) -> None:
    run = await hot.start_run("hot", {}, "k1")
    assert (await hot.complete_step(run.run_id, "fetch")).next_step == "load"
    assert await hot.cancel_key("hot", "k1") == 1
    again = await hot.start_run("hot", {}, "k1", markers=[hot.event_marker("hot", "t", "e1")])
    assert again.deduped and again.run_id == run.run_id
    first = await hot.start_run("hot", {}, request_id="req-9")
    retried = await hot.start_run("hot", {}, request_id="req-9")
    assert retried.run_id == first.run_id and not retried.deduped


# ------------------------------------------------------------------ listing and batches


async def test_listing_spans_the_partitions_newest_first_each_run_once(hot: RunStore) -> None:
    started = [(await hot.start_run("hot", {"n": n})).run_id for n in range(45)]
    seen: list[str] = []
    cursor = None
    for _ in range(20):
        page, cursor = await hot.list_runs("hot", limit=7, cursor=cursor)
        seen += [run.id for run in page]
        if cursor is None:
            break
    assert sorted(seen) == sorted(started) and len(seen) == len(set(seen))
    assert seen == list(reversed(started)), "newest first across partitions"


async def test_a_bad_partition_cursor_is_refused(hot: RunStore) -> None:
    for bad in ["1.2", "x.y.z.w", "1.2.3.4.5", "².0.0.0"]:
        with pytest.raises(RealmError) as refused:
            await hot.list_runs("hot", cursor=bad)
        assert refused.value.code == "VALIDATION_PARAMS"


async def test_a_batch_spans_partitions_and_its_retry_starts_nothing_twice(
    hot: RunStore, redis: Redis
) -> None:
    items = [{"params": {"n": n}} for n in range(300)] + [
        {"params": {}, "idempotency_key": f"k{n}"} for n in range(60)
    ]
    first = await hot.start_run_batch("hot", items, batch_id="b-1")
    counts = await sizes(redis)
    assert sum(counts) == 360 and all(c > 0 for c in counts), counts
    again = await hot.start_run_batch("hot", items, batch_id="b-1")
    assert [e.result.run_id for e in again] == [e.result.run_id for e in first]  # type: ignore[union-attr]
    assert sum(await sizes(redis)) == 360


# ------------------------------------------------------------------ the sweep


async def test_the_sweep_trims_every_partition(hot: RunStore, redis: Redis) -> None:
    ids = [(await hot.start_run("hot", {"n": n})).run_id for n in range(40)]
    for run_id in ids:
        await hot.cancel_run(run_id)

    async def expired() -> bool:
        keys = [hot.keys_for_run("hot", r).run(r) for r in ids]
        return await redis.exists(*keys) == 0

    await until(expired)

    async def swept() -> bool:
        await sweep(hot, "hot")
        return sum(await sizes(redis)) == 0

    await until(swept)
    assert [await redis.xlen(part_keys(p).stream()) for p in range(N)] == [0] * N


# ------------------------------------------------------------------ changing N


async def test_changing_partitions_of_a_workflow_with_data_is_refused(
    redis: Redis, hot_config: Config
) -> None:
    store = RunStore(redis, hot_config, timeout=5.0)
    await store.check_layout()
    await store.start_run("hot", {})
    other = parse_config(YAML.replace(f"partitions: {N}", "partitions: 2"), file="hot.yaml",
                         with_triggers=False)  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        await RunStore(redis, other, timeout=5.0).check_layout()
    assert "partitions: 4; changing it to 2 is refused" in str(refused.value)
    assert "workflow 'hot'" in str(refused.value)
    await store.check_layout()  # the recorded layout itself is fine


async def test_partitioning_a_workflow_that_holds_unpartitioned_data_is_refused(
    redis: Redis,
) -> None:
    before = parse_config(YAML.replace(f"    partitions: {N}\n", ""), file="hot.yaml",
                          with_triggers=False)  # fmt: skip
    # Data from before partitions existed: no layout record, runs under {hot}.
    await RunStore(redis, before, timeout=5.0).start_run("hot", {})
    after = parse_config(YAML, file="hot.yaml", with_triggers=False)
    with pytest.raises(ConfigError) as refused:
        await RunStore(redis, after, timeout=5.0).check_layout()
    assert "partitions: 1; changing it to 4 is refused" in str(refused.value)


@pytest.mark.parametrize("value", ["0", "1025", "true", "'2'", "[2]"])
def test_a_bad_partitions_value_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(YAML.replace(f"partitions: {N}", f"partitions: {value}"), file="hot.yaml",
                     with_triggers=False)  # fmt: skip
    assert "field 'partitions'" in str(refused.value)


def test_the_replay_guard_needs_one_partition() -> None:
    text = (
        YAML
        + """
triggers:
  push:
    workflow: hot
    path: /hooks/hot
    verify: {scheme: github, secret_env: S}
    event_id: {header: X-GitHub-Delivery}
"""
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(text, file="hot.yaml", env={"S": "secret"})
    assert "replay_guard" in str(refused.value) and "one partition" in str(refused.value)
    ok = parse_config(text + "    replay_guard: false\n", file="hot.yaml", env={"S": "secret"})
    assert not ok.triggers["push"].replay_guard


def test_the_cli_refuses_a_changed_layout_in_one_line(tmp_path, module_redis, db) -> None:
    """`realm run …` and `realm listen` check the layout before they touch a run."""
    config = tmp_path / "triggers.yaml"

    def realm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", *args, "--config", str(config),
             "--redis-url", module_redis.url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    config.write_text(YAML)
    assert realm("run", "start", "hot").returncode == 0
    config.write_text(YAML.replace(f"partitions: {N}", "partitions: 8"))
    for args in (("run", "list", "--workflow", "hot"), ("listen", "--port", "0")):
        refused = realm(*args)
        assert refused.returncode == 3, refused.stderr
        [line] = refused.stderr.strip().splitlines()[-1:]
        assert "partitions: 4; changing it to 8 is refused" in line


def test_a_listener_spreads_deliveries_and_deduplicates_redeliveries(tmp_path, module_redis, db):
    """A real `realm listen` on a partitioned workflow: 40 events over 4 partitions,
    each redelivery deduplicated onto its run."""
    text = (
        YAML
        + """
triggers:
  tick:
    workflow: hot
    path: /hooks/hot
    verify: {scheme: token, header: X-Token, secret_env: HOT_TOKEN}
    event_id: {header: Idempotency-Key}
"""
    )
    listener = Listener(
        tmp_path, text, redis_url=module_redis.url, env={"HOT_TOKEN": "hot-token-1"}
    ).start()
    try:
        with httpx.Client(base_url=listener.base_url, timeout=10) as client:

            def deliver(event: str) -> dict:
                reply = client.post(
                    "/hooks/hot",
                    content=b"{}",
                    headers={"X-Token": "hot-token-1", "Idempotency-Key": event,
                             "Content-Type": "application/json"},
                )  # fmt: skip
                assert reply.status_code in (200, 202), reply.text
                return reply.json()["results"][0]

            first = {f"evt-{n}": deliver(f"evt-{n}")["run_id"] for n in range(40)}
            again = {event: deliver(event) for event in first}
    finally:
        listener.stop()
    assert all(r["outcome"] == "deduplicated" for r in again.values())
    assert {e: r["run_id"] for e, r in again.items()} == first
    counts = [db.zcard(f"realm:{{hot#{p}}}:runs") for p in range(N)]
    assert sum(counts) == 40 and all(c > 0 for c in counts), counts
    for event, run_id in first.items():
        assert partition_of_run(run_id, N) == partition_of(event, N)
