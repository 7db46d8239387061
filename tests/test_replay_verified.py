"""A replay is verified per trigger: a stored delivery may start runs only for the
triggers that verified it on arrival, under the verify spec they have now. Real
`realm listen` processes on a real Redis; the replay over HTTP, the CLI and MCP.

The danger: two senders share a path (org A's and org B's secrets), or a path has a
``verify: none`` trigger beside a signed one. A delivery that only org A's secret (or
nobody's) let in is kept in the log with its body; replaying it must not hand it to
org B's trigger, whose signature failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.deliveries_scaffold import sent
from tests.listener import Listener
from tests.mcp_client import mcp_session
from tests.servers import RedisServer
from tests.signing import github_headers

API_TOKEN = "replay-verified-token-4e1a"
SECRETS = {
    "ORG_A_SECRET": "org-a-secret-5b1e9c",
    "ORG_B_SECRET": "org-b-secret-93c07a",
    "ORG_A_NEXT": "org-a-next-7d2f41",
}
ENV = {"REALM_API_TOKEN": API_TOKEN, **SECRETS}
BEARER = {"Authorization": f"Bearer {API_TOKEN}"}
CONFIG = """
version: 1
workflows:
  a-deploy: {steps: [go]}
  b-deploy: {steps: [go]}
  open-ping: {steps: [go]}
triggers:
  org-a:
    workflow: a-deploy
    path: /hooks/shared
    verify: {scheme: github, secret_env: ORG_A_SECRET}
    event_id: {header: X-GitHub-Delivery}
  org-b:
    workflow: b-deploy
    path: /hooks/shared
    verify: {scheme: github, secret_env: ORG_B_SECRET}
    event_id: {header: X-GitHub-Delivery}
  anyone:
    workflow: open-ping
    path: /hooks/open
    verify: {scheme: none}
    event_id: {header: X-Event-Id}
  org-b-open:
    workflow: b-deploy
    path: /hooks/open
    verify: {scheme: github, secret_env: ORG_B_SECRET}
    event_id: {header: X-GitHub-Delivery}
"""
# Org A's secret moved to another variable: the trigger's verify spec changed.
ROTATED = CONFIG.replace("secret_env: ORG_A_SECRET", "secret_env: ORG_A_NEXT")
BODY = orjson.dumps({"ref": "refs/heads/main"})


@pytest.fixture(scope="module")
def listener(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    started = Listener(
        tmp_path_factory.mktemp("replay-verified"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield started
    started.stop()


@pytest.fixture
def api(listener: Listener, db: redis.Redis) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=listener.base_url, headers=BEARER, timeout=10) as client:
        yield client


def signed_by_org_a(base_url: str, delivery: str) -> httpx.Response:
    headers = github_headers(BODY, SECRETS["ORG_A_SECRET"], delivery=delivery)
    return httpx.post(base_url + "/hooks/shared", content=BODY, headers=headers, timeout=10)


def unsigned(base_url: str, event_id: str) -> httpx.Response:
    """What anyone can send to the path with a ``verify: none`` trigger."""
    headers = {
        "Content-Type": "application/json",
        "X-Event-Id": event_id,
        "X-GitHub-Delivery": event_id,
        "X-GitHub-Event": "push",
    }
    return httpx.post(base_url + "/hooks/open", content=BODY, headers=headers, timeout=10)


def replayed(api: httpx.Client, delivery_id: str, *, rerun: bool) -> dict[str, Any]:
    reply = api.post(f"/v1/deliveries/{delivery_id}/replay", json={"rerun": rerun})
    assert reply.status_code == 200, reply.text
    return reply.json()


def by_trigger(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["trigger"]: t for t in record["triggers"]}


def b_runs(db: redis.Redis) -> list[str]:
    """The run hashes of org B's workflow in Redis (the API's list aside)."""
    return db.keys("realm:{b-deploy}:run:*")


def runs_of(api: httpx.Client, workflow: str) -> list[str]:
    reply = api.get(f"/v1/workflows/{workflow}/runs")
    assert reply.status_code == 200, reply.text
    return [r["run_id"] for r in reply.json()["runs"]]


def test_a_replay_starts_no_run_for_the_other_senders_trigger(
    api: httpx.Client, listener: Listener, db: redis.Redis
) -> None:
    reply, delivery_id = sent(db, lambda: signed_by_org_a(listener.base_url, "d-a1"), 202)
    (started,) = reply.json()["results"]  # org-b failed its signature: not the sender's
    assert (started["trigger"], started["outcome"]) == ("org-a", "started")

    for rerun in (False, True):
        record = replayed(api, delivery_id, rerun=rerun)
        triggers = by_trigger(record)
        # Org B's trigger did not verify it on arrival: unverified, saying why, and no
        # run in org B's workflow.
        assert {k: triggers["org-b"][k] for k in ("outcome", "signature", "run_id")} == {
            "outcome": "unverified",
            "signature": "not verified on arrival",
            "run_id": None,
        }
        # Org A's did: the replay goes through its policies.
        assert triggers["org-a"]["outcome"] == ("started" if rerun else "deduplicated")
        assert (triggers["org-a"]["verified"], triggers["org-b"]["verified"]) == (True, False)
        assert (record["status"], record["replay_of"]) == (202 if rerun else 200, delivery_id)
    assert runs_of(api, "b-deploy") == []
    assert len(runs_of(api, "a-deploy")) == 2  # the first run, and the rerun's
    # What the replays went by: the first record says which trigger verified it.
    first = by_trigger(api.get(f"/v1/deliveries/{delivery_id}").json())
    assert (first["org-a"]["verified"], first["org-b"]["verified"]) == (True, False)
    assert first["org-b"]["signature"] == "signature mismatch"


def test_a_delivery_a_verify_none_trigger_let_in_is_never_replayed_to_a_signed_one(
    api: httpx.Client, listener: Listener, db: redis.Redis
) -> None:
    """Anyone can plant such a record: the `none` trigger keeps its headers and body."""
    reply, delivery_id = sent(db, lambda: unsigned(listener.base_url, "e-planted"), 202)
    assert [r["trigger"] for r in reply.json()["results"]] == ["anyone"]

    for rerun in (False, True):
        triggers = by_trigger(replayed(api, delivery_id, rerun=rerun))
        assert triggers["anyone"]["outcome"] == ("started" if rerun else "deduplicated")
        assert (triggers["org-b-open"]["outcome"], triggers["org-b-open"]["signature"]) == (
            "unverified",
            "not verified on arrival",
        )
    assert runs_of(api, "b-deploy") == []
    assert b_runs(db) == []


@pytest.mark.slow
def test_a_trigger_whose_verify_spec_changed_since_does_not_take_the_replay(
    module_redis: RedisServer, db: redis.Redis, tmp_path: Path
) -> None:
    listener = Listener(tmp_path, CONFIG, redis_url=module_redis.url, env=ENV).start()
    try:
        with httpx.Client(base_url=listener.base_url, headers=BEARER, timeout=10) as api:
            _, delivery_id = sent(db, lambda: signed_by_org_a(listener.base_url, "d-a2"), 202)
            (run_id,) = runs_of(api, "a-deploy")
            version = api.get("/readyz").json()["config_version"]

            listener.config_path.write_text(ROTATED)
            assert listener.process is not None
            os.kill(listener.process.pid, signal.SIGHUP)
            deadline = time.monotonic() + 20
            while api.get("/readyz").json()["config_version"] == version:
                assert time.monotonic() < deadline, listener.log()[-2000:]
                time.sleep(0.02)

            record = replayed(api, delivery_id, rerun=True)
            assert by_trigger(record)["org-a"]["signature"] == (
                "its verify spec changed since it arrived"
            )
            assert (record["status"], record["code"], record["message"]) == (
                401,
                "AUTH_REQUIRED",
                "no trigger of the path verified this delivery on arrival (org-a: its "
                "verify spec changed since it arrived; org-b: not verified on arrival)",
            )
            assert [t["outcome"] for t in record["triggers"]] == ["unverified", "unverified"]
            assert runs_of(api, "a-deploy") == [run_id]  # no rerun started
            assert runs_of(api, "b-deploy") == []
            assert api.get(f"/v1/runs/{run_id}").json()["phase"] == "running"  # not cancelled
    finally:
        listener.stop()


def realm_replay(listener: Listener, redis_url: str, delivery_id: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    env.update(SECRETS)
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "deliveries", "replay", delivery_id,
         "--config", str(listener.config_path), "--redis-url", redis_url],
        cwd=listener.config_path.parent, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


UNVERIFIED_LINES = "  org-b → b-deploy: unverified\n    signature: not verified on arrival\n"


def test_realm_deliveries_replay_says_which_trigger_may_not_take_it(
    listener: Listener, module_redis: RedisServer, db: redis.Redis
) -> None:
    _, delivery_id = sent(db, lambda: signed_by_org_a(listener.base_url, "d-a3"), 202)
    text = realm_replay(listener, module_redis.url, delivery_id)
    assert "  org-a → a-deploy: deduplicated\n" in text
    assert text.endswith(UNVERIFIED_LINES)
    assert b_runs(db) == []


async def test_the_mcp_replay_tool_says_which_trigger_may_not_take_it(
    listener: Listener, module_redis: RedisServer, db: redis.Redis
) -> None:
    _, delivery_id = sent(db, lambda: signed_by_org_a(listener.base_url, "d-a4"), 202)
    async with mcp_session(listener.config_path, module_redis.url, SECRETS) as tools:
        text = await tools.ok("replay_delivery", delivery_id=delivery_id, rerun=True)
    assert "  org-a → a-deploy: started\n" in text
    assert text.endswith(UNVERIFIED_LINES.rstrip("\n"))
    assert b_runs(db) == []
