"""The admin API of a real `realm listen` process: every route, with and without a token."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.api import API_ROUTES
from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.servers import RedisServer

TOKEN = "test-api-token-7f3a"
CONFIG = (
    WORKFLOWS_YAML
    + """
triggers:
  hook:
    workflow: sync
    path: /hooks/plain
    verify: {scheme: token, header: X-Token, secret_env: HOOK_TOKEN}
    event_id: {header: X-Event-Id}
"""
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("api-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def listener(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Listener]:
    listener = Listener(
        tmp_path_factory.mktemp("api"), CONFIG, redis_url=server.url,
        env={"REALM_API_TOKEN": TOKEN, "HOOK_TOKEN": "hook-secret"},
    ).start()  # fmt: skip
    yield listener
    listener.stop()


@pytest.fixture
def api(listener: Listener, server: RedisServer) -> Iterator[httpx.Client]:
    import redis

    redis.Redis.from_url(server.url).flushall()
    with httpx.Client(
        base_url=listener.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as client:
        yield client


def test_start_repeat_and_refusals(api: httpx.Client):
    first = api.post("/v1/workflows/sync/runs", json={"idempotency_key": "order-4417"})
    assert first.status_code == 202
    body = first.json()
    assert (body["status"], body["deduped"], body["next_step"]) == ("ok", False, "fetch")
    assert body["message"] == (
        f"Run '{body['run_id']}' created for workflow 'sync'. Ready for the agent: 'fetch'."
    )

    again = api.post("/v1/workflows/sync/runs", json={"idempotency_key": "order-4417"})
    assert again.status_code == 200
    assert (again.json()["deduped"], again.json()["run_id"]) == (True, body["run_id"])

    refused = api.post(
        "/v1/workflows/sync/runs", json={"idempotency_key": "order-4417", "on_live_match": "fail"}
    )
    assert refused.status_code == 409
    assert refused.json() == {
        "status": "error",
        "code": "STATE_RUN_ALREADY_ACTIVE",
        "message": f"Idempotency key for workflow 'sync' is owned by an active run "
        f"'{body['run_id']}' (phase 'running').",
    }
    bad = api.post("/v1/workflows/deploy/runs", json={"params": {"repo": "o/r"}})
    assert (bad.status_code, bad.json()["code"]) == (422, "VALIDATION_PARAMS")
    missing = api.post("/v1/workflows/nope/runs", json={})
    assert (missing.status_code, missing.json()["code"]) == (404, "NOT_FOUND_WORKFLOW")
    garbage = api.post("/v1/workflows/sync/runs", content=b"{not json")
    assert (garbage.status_code, garbage.json()["code"]) == (422, "VALIDATION_BODY")


def test_batch_get_list_complete_fail_cancel(api: httpx.Client):
    batch = api.post("/v1/workflows/sync/batch", json={"items": [
        {"params": {}, "idempotency_key": "a"}, {"params": {}, "idempotency_key": "b"},
        {"params": {}, "idempotency_key": "a"}]})  # fmt: skip
    assert batch.status_code == 200
    items = batch.json()["items"]
    assert [i["deduped"] for i in items] == [False, False, True]
    a, b = items[0]["run_id"], items[1]["run_id"]

    got = api.get(f"/v1/runs/{a}")
    assert (got.status_code, got.json()["phase"], got.json()["idempotency_key"]) == (
        200, "running", "a",
    )  # fmt: skip
    step = api.post(f"/v1/runs/{a}/complete", json={"step": "fetch"})
    assert step.json()["next_step"] == "transform"
    wrong = api.post(f"/v1/runs/{a}/complete", json={"step": "load"})
    assert (wrong.status_code, wrong.json()["code"]) == (409, "STATE_STEP_NOT_CURRENT")
    failed = api.post(f"/v1/runs/{a}/fail", json={"error": "boom"})
    assert (failed.json()["phase"], failed.json()["error"]) == ("failed", "boom")
    late = api.post(f"/v1/runs/{a}/complete", json={"step": "transform"})
    assert (late.status_code, late.json()["code"]) == (409, "STATE_RUN_NOT_LIVE")

    assert api.post("/v1/workflows/sync/cancel", json={"idempotency_key": "b"}).json() == {
        "cancelled": 1
    }
    assert api.post(f"/v1/runs/{b}/cancel").json() == {"cancelled": 0}

    page = api.get("/v1/workflows/sync/runs", params={"limit": 1})
    assert len(page.json()["runs"]) == 1 and page.json()["cursor"]
    rest = api.get("/v1/workflows/sync/runs", params={"limit": 10, "cursor": page.json()["cursor"]})
    assert {r["run_id"] for r in page.json()["runs"] + rest.json()["runs"]} == {a, b}
    cancelled = api.get("/v1/workflows/sync/runs", params={"phase": "cancelled"})
    assert [r["run_id"] for r in cancelled.json()["runs"]] == [b]
    by_key = api.get("/v1/workflows/sync/runs", params={"key": "a"})
    assert [r["run_id"] for r in by_key.json()["runs"]] == [a]
    assert api.get(f"/v1/runs/{'0' * 8}-0000-0000-0000-{'0' * 12}").status_code == 404


def test_reconcile_route(api: httpx.Client):
    api.post("/v1/workflows/sync/runs", json={"idempotency_key": "k"})
    report = api.post("/v1/reconcile", json={"dry_run": True})
    assert report.status_code == 200
    assert report.json()["message"].startswith(
        "Would write 0 pointer(s) across 1 key group(s); 1 already current."
    )


def test_every_route_refuses_without_a_valid_token(listener: Listener):
    for path, method, _, _ in API_ROUTES:
        url = listener.base_url + path.format(workflow="sync", run_id="x")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            reply = httpx.request(method, url, headers=headers, json={}, timeout=10)
            assert reply.status_code == 401, (method, path, headers)
            assert reply.json()["code"] == "AUTH_REQUIRED"


def test_without_a_configured_token_the_api_answers_403(server: RedisServer, tmp_path: Path):
    with_no_token = Listener(tmp_path, CONFIG, redis_url=server.url,
                             env={"HOOK_TOKEN": "hook-secret"}).start()  # fmt: skip
    try:
        for path, method, _, _ in API_ROUTES:
            url = with_no_token.base_url + path.format(workflow="sync", run_id="x")
            reply = httpx.request(method, url, headers={"Authorization": "Bearer x"}, timeout=10)
            assert reply.status_code == 403
            assert "set REALM_API_TOKEN" in reply.json()["message"]
    finally:
        with_no_token.stop()


def test_openapi_describes_every_route_the_app_serves(listener: Listener):
    from gateway.app import create_app
    from gateway.config import parse_config

    document = httpx.get(listener.base_url + "/openapi.json", timeout=10).json()
    app = create_app(parse_config(CONFIG, env={"HOOK_TOKEN": "x"}), "redis://unused")
    served = {
        (route.path, method.lower())
        for route in app.app.routes
        for method in (route.methods or ()) - {"HEAD"}
    }
    described = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert served <= described, f"routes missing from /openapi.json: {served - described}"
    assert ("/hooks/plain", "post") in described
    for path, ops in document["paths"].items():
        for op in ops.values():
            assert re.findall(r"{(\w+)}", path) == [
                p["name"] for p in op.get("parameters", []) if p["in"] == "path"
            ]


def test_health_and_readiness(listener: Listener):
    assert httpx.get(listener.base_url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(listener.base_url + "/readyz").status_code == 200


def test_metrics_count_deliveries_across_workers(server: RedisServer, tmp_path: Path):
    import redis

    redis.Redis.from_url(server.url).flushall()
    two = Listener(tmp_path, CONFIG, redis_url=server.url, workers=2,
                   env={"HOOK_TOKEN": "hook-secret"}).start()  # fmt: skip
    try:
        for i in range(20):
            headers = {"X-Token": "hook-secret", "X-Event-Id": f"e{i % 5}"}
            reply = httpx.post(
                two.base_url + "/hooks/plain", content=b"{}", timeout=10, headers=headers
            )
            assert reply.status_code in (200, 202)
        # Each worker adds its counts at least every 0.2 s: poll until both have.
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(two.base_url + "/metrics", timeout=10).text
            if 'status="200"} 15.0' in text or time.monotonic() > deadline:
                break
        assert 'realm_deliveries_total{path="/hooks/plain",status="202"} 5.0' in text
        assert 'realm_deliveries_total{path="/hooks/plain",status="200"} 15.0' in text
        assert (
            'realm_trigger_outcomes_total{outcome="deduplicated",trigger="hook",workflow="sync"} '
            "15.0" in text
        )
    finally:
        two.stop()
    # Each worker process logs its deliveries too: one JSON line each.
    lines = [line for line in two.log().splitlines() if '"event":"delivery"' in line]
    assert len(lines) == 20


def test_an_unreachable_store_is_503_store_unavailable(tmp_path: Path, start_redis):
    own = start_redis()  # stopped by the fixture, however the test ends
    env = {"REALM_API_TOKEN": TOKEN, "HOOK_TOKEN": "hook-secret"}
    listener = Listener(tmp_path, CONFIG, redis_url=own.url, env=env).start()
    try:
        own.stop()
        started = time.monotonic()
        reply = httpx.post(
            listener.base_url + "/v1/workflows/sync/runs",
            json={"idempotency_key": "k"},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert time.monotonic() - started < 5
        assert reply.status_code == 503
        assert reply.json()["code"] == "STORE_UNAVAILABLE"
        assert reply.headers["Retry-After"] == "5"
    finally:
        listener.stop()
