"""A trigger's rate limit: at most `limit` runs started per `period` for one value of
its key; a delivery past it starts nothing (200, ``outcome: rate_limited``,
``STATE_RATE_LIMITED``) and is not recorded, so its redelivery may start once the
window has room. Decided in the claim: exact across gateway processes. Against real
Redis servers and real `realm listen` processes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync

from gateway.loading import parse_config
from gateway.model.errors import ConfigError, RealmError
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.trigger_yaml import BASE, refusal

WF = "single"  # one step, `only` (tests/conftest.py)


async def start(
    store: RunStore, event: str, *, key: str | None = None, limit: int = 3, period_ms: int = 60_000
):
    return await store.start_run(
        WF,
        {"event": event},
        key or event,
        "cancel_existing",
        "rerun",
        markers=[store.rate_marker("t", "acme/api", limit, period_ms)],
    )


async def test_starts_past_the_limit_start_nothing(store: RunStore) -> None:
    started = [await start(store, f"evt-{n}") for n in range(3)]
    with pytest.raises(RealmError) as limited:
        await start(store, "evt-3")
    assert limited.value.code == "STATE_RATE_LIMITED"
    message = limited.value.message
    assert message.startswith(
        "Rate limit for workflow 'single': 3 runs per 1m already started for this key; "
        "the next may start in "
    )
    assert message.endswith(" s. Nothing was started.")
    wait = float(message.split("start in ")[1].split(" s.")[0])
    assert 0 < wait <= 60
    assert int(await store.redis.zcard(store.keys(WF).runs())) == 3
    # A redelivery of a started event is deduplicated: it neither counts nor is refused.
    again = await store.start_run(WF, {"event": "evt-0"}, "evt-0", "use_existing", "reuse")
    assert again.deduped and again.run_id == started[0].run_id


async def test_a_limited_start_cancels_nothing(store: RunStore) -> None:
    """cancel_existing ends the live run only when the new one may start."""
    first = await start(store, "evt-a", key="singleton", limit=1)
    with pytest.raises(RealmError):
        await start(store, "evt-b", key="singleton", limit=1)
    assert (await store.get_run(first.run_id)).phase == "running"


async def test_the_window_slides(store: RunStore) -> None:
    """One run per second: the next start passes once the first is a second old."""
    first = await start(store, "evt-1", limit=1, period_ms=1000)
    began = time.monotonic()
    while True:
        try:
            second = await start(store, "evt-2", limit=1, period_ms=1000)
            break
        except RealmError as exc:
            assert exc.code == "STATE_RATE_LIMITED"
            assert time.monotonic() - began < 5, "the window never had room again"
            await asyncio.sleep(0.05)
    waited = time.monotonic() - began
    assert 0.5 < waited < 5 and second.run_id != first.run_id


async def test_the_preview_says_rate_limited(store: RunStore) -> None:
    await start(store, "evt-1", limit=1)
    marker = [store.rate_marker("t", "acme/api", 1, 60_000)]
    with pytest.raises(RealmError) as limited:
        await store.preview_start(WF, "evt-2", "use_existing", "reuse", "flag", "fp", marker)
    assert limited.value.code == "STATE_RATE_LIMITED"
    other = [store.rate_marker("t", "acme/web", 1, 60_000)]
    decision, _ = await store.preview_start(
        WF, "evt-2", "use_existing", "reuse", "flag", "fp", other
    )
    assert decision == "start"


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ("10", "rate_limit", "must be a mapping"),
        ("{limit: 0, period: 1m}", "rate_limit.limit", "1 or more"),
        ("{limit: 1.5, period: 1m}", "rate_limit.limit", "whole number"),
        ("{limit: 10}", "rate_limit.period", "is required"),
        ("{limit: 10, period: soon}", "rate_limit.period", "must be a duration"),
        ("{limit: 10, period: 1m, burst: 5}", "rate_limit.burst", "unknown field"),
    ],
)
def test_a_wrong_rate_limit_is_refused_naming_its_field(spec: str, field: str, reason: str) -> None:
    message = refusal(f"rate_limit: {spec}")
    assert f"field '{field}'" in message and reason in message


def test_a_window_apart_from_the_key_needs_one_partition() -> None:
    text = (
        "version: 1\nworkflows:\n  deploy: {steps: [a], partitions: 4}\ntriggers:"
        + BASE.replace("\n", "\n  ")
        + "  rate_limit: {limit: 5, period: 1m, key: '{$.repo}'}\n"
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(text, file="t.yaml", env={})
    assert "rate_limit.key must be the trigger's key" in str(refused.value)


# ------------------------------------------------------------------ three gateways

LIMITED = """
version: 1
workflows:
  build:
    steps: [run]
triggers:
  push:
    workflow: build
    path: /hooks/push
    verify: {scheme: none}
    event_id: {jsonpath: $.id}
    rate_limit: {limit: 10, period: 1m, key: "{$.repo}"}
"""


def test_three_gateways_start_exactly_the_limit(
    tmp_path: Path, module_redis: Any, db: redis_sync.Redis
) -> None:
    """100 deliveries of one repository, spread over 3 `realm listen` processes at
    once, and 5 of another: exactly 10 runs for the first, 5 for the second; the rest
    rate_limited, with their redeliveries decided afresh (still limited)."""
    listeners = []
    for n in range(3):
        (workdir := tmp_path / f"g{n}").mkdir()
        listeners.append(Listener(workdir, LIMITED, redis_url=module_redis.url).start())
    try:
        sends = [{"id": f"evt-{n}", "repo": "acme/api"} for n in range(100)]
        sends += [{"id": f"other-{n}", "repo": "acme/web"} for n in range(5)]
        replies = asyncio.run(_send_all([g.base_url for g in listeners], sends))
        again = asyncio.run(_send_all([listeners[0].base_url], sends[50:52]))
    finally:
        for g in listeners:
            g.stop()
    outcomes = Counter((body["repo"], outcome) for body, outcome in replies)
    assert outcomes == {
        ("acme/api", "started"): 10,
        ("acme/api", "rate_limited"): 90,
        ("acme/web", "started"): 5,
    }
    assert int(db.zcard("realm:{build}:runs")) == 15
    started = {body["id"] for body, outcome in replies if outcome == "started"}
    assert [o for _, o in again] == [
        "deduplicated" if body["id"] in started else "rate_limited" for body in sends[50:52]
    ]


async def _send_all(urls: list[str], sends: list[dict[str, Any]]) -> list[tuple[dict, str]]:
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(n: int, body: dict[str, Any]) -> tuple[dict, str]:
            reply = await client.post(
                urls[n % len(urls)] + "/hooks/push", content=orjson.dumps(body),
                headers={"content-type": "application/json"},
            )  # fmt: skip
            assert reply.status_code in (200, 202), reply.text
            return body, reply.json()["results"][0]["outcome"]

        return list(await asyncio.gather(*(one(n, b) for n, b in enumerate(sends))))
