"""The admin API of a real `realm listen` process: every route, with and without a token."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.faces.api import API_ROUTES
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
        "Would write 0 pointers across 1 key group; 1 already current."
    )


def test_every_route_refuses_without_a_valid_token(listener: Listener):
    for path, method, _, _ in API_ROUTES:
        url = listener.base_url + path.format(workflow="sync", run_id="x", delivery_id="x")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            reply = httpx.request(method, url, headers=headers, json={}, timeout=10)
            assert reply.status_code == 401, (method, path, headers)
            assert reply.json()["code"] == "AUTH_REQUIRED"


def test_without_a_configured_token_the_api_answers_403(server: RedisServer, tmp_path: Path):
    with_no_token = Listener(tmp_path, CONFIG, redis_url=server.url,
                             env={"HOOK_TOKEN": "hook-secret"}).start()  # fmt: skip
    try:
        for path, method, _, _ in API_ROUTES:
            url = with_no_token.base_url + path.format(workflow="sync", run_id="x", delivery_id="x")
            reply = httpx.request(method, url, headers={"Authorization": "Bearer x"}, timeout=10)
            assert reply.status_code == 403
            assert "set REALM_API_TOKEN" in reply.json()["message"]
    finally:
        with_no_token.stop()


def test_openapi_describes_every_route_the_app_serves(listener: Listener):
    from gateway.loading import parse_config
    from gateway.serving.app import create_app

    document = httpx.get(listener.base_url + "/openapi.json", timeout=10).json()
    app = create_app(parse_config(CONFIG, env={"HOOK_TOKEN": "x"}), "redis://unused")
    served = {
        (route.path, method.lower())
        for route in app.app.routes
        if route.include_in_schema  # /ui: HTML pages, not API (gateway/faces/ui/routes.py)
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
        # A batch whose outcome is unknown names its batch id, for the retry.
        batch = httpx.post(
            listener.base_url + "/v1/workflows/sync/batch",
            json={"items": [{}], "batch_id": "b-9"},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert batch.status_code == 503
        assert (batch.json()["code"], batch.json()["batch_id"]) == ("STORE_UNAVAILABLE", "b-9")
        # /metrics still answers, and says the streams could not be read.
        scraped = httpx.get(listener.base_url + "/metrics", timeout=10)
        assert scraped.status_code == 200
        assert 'realm_queue_read_ok{workflow="sync"} 0.0' in scraped.text
        assert "realm_steps_waiting{" not in scraped.text
    finally:
        listener.stop()


@pytest.mark.slow
async def test_250_concurrent_reads_wait_for_a_connection_instead_of_503(
    listener: Listener, api: httpx.Client
):
    """The API's Redis pool holds 100 connections; a burst beyond that takes turns
    (gateway/faces/admission.py, gateway/link/pool.py) rather than failing fast with 503.
    The heavier burst, and the deadline that must not count the wait, are in
    tests/test_admin_reads.py."""
    import asyncio
    from collections import Counter

    for i in range(5):
        api.post("/v1/workflows/sync/runs", json={"idempotency_key": f"k{i}"})
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(
        base_url=listener.base_url, headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30, limits=limits,
    ) as client:  # fmt: skip

        async def read() -> int:
            reply = await client.get("/v1/workflows/sync/runs", params={"limit": 5})
            return reply.status_code

        started = time.monotonic()
        statuses = Counter(await asyncio.gather(*(read() for _ in range(250))))
        elapsed = time.monotonic() - started
    print(f"FIGURES admin_reads_250: statuses={dict(statuses)} seconds={elapsed:.2f}")
    assert statuses == Counter({200: 250})


@pytest.mark.parametrize(
    ("name", "value"),
    [("limit", "²"), ("limit", "٣"), ("limit", str(2**63)), ("limit", "0"), ("limit", "-1"),
     ("limit", "1001"), ("limit", ""), ("limit", "1e3"),
     ("cursor", "²"), ("cursor", str(2**63)), ("cursor", "9" * 19), ("cursor", "-1"),
     ("cursor", "abc"), ("cursor", "")],
)  # fmt: skip
def test_bad_limit_or_cursor_is_422_validation_params(api: httpx.Client, name: str, value: str):
    reply = api.get("/v1/workflows/sync/runs", params={name: value})
    assert reply.status_code == 422, reply.text
    body = reply.json()
    assert body["code"] == "VALIDATION_PARAMS"
    expected = {"limit": "limit must be a whole number from 1 to 1000 (got ",
                "cursor": "cursor must be the value a previous page returned (got "}  # fmt: skip
    assert body["message"].startswith(expected[name])


def test_a_retried_start_with_its_request_id_returns_the_first_run(api: httpx.Client, server):
    import redis

    first = api.post("/v1/workflows/sync/runs", json={"request_id": "req-4417"})
    assert first.status_code == 202
    again = api.post("/v1/workflows/sync/runs", json={"request_id": "req-4417"})
    # The first call's result: "created", as if its reply had arrived.
    assert (again.status_code, again.json()) == (202, first.json())
    other = api.post("/v1/workflows/sync/runs", json={"request_id": "req-4418"})
    assert other.json()["run_id"] != first.json()["run_id"]
    runs = api.get("/v1/workflows/sync/runs").json()["runs"]
    assert sorted(r["run_id"] for r in runs) == sorted(
        [first.json()["run_id"], other.json()["run_id"]]
    )
    assert redis.Redis.from_url(server.url).xlen("realm:{sync}:stream") == 2
    bad = api.post("/v1/workflows/sync/runs", json={"request_id": 7})
    assert (bad.status_code, bad.json()["code"]) == (422, "VALIDATION_BODY")
    long = api.post("/v1/workflows/sync/runs", json={"request_id": "r" * 201})
    assert (long.status_code, long.json()["code"]) == (422, "VALIDATION_PARAMS")


def test_request_ids_on_batch_complete_fail_and_cancel(api: httpx.Client):
    items = {"items": [{"params": {}}, {"params": {}}]}
    made = api.post("/v1/workflows/sync/batch", json=items).json()
    assert re.fullmatch(r"[0-9a-f-]{36}", made["batch_id"])
    first = api.post("/v1/workflows/sync/batch", json={**items, "batch_id": "b-1"}).json()
    again = api.post("/v1/workflows/sync/batch", json={**items, "batch_id": "b-1"}).json()
    assert first["batch_id"] == again["batch_id"] == "b-1"
    ids = [i["run_id"] for i in first["items"]]
    assert [i["run_id"] for i in again["items"]] == ids
    assert len(api.get("/v1/workflows/sync/runs").json()["runs"]) == 4

    a, b = ids
    done = api.post(f"/v1/runs/{a}/complete", json={"step": "fetch", "request_id": "c-1"})
    resent = api.post(f"/v1/runs/{a}/complete", json={"step": "fetch", "request_id": "c-1"})
    assert resent.status_code == done.status_code == 200
    assert resent.json() == done.json()
    failed = api.post(f"/v1/runs/{a}/fail", json={"error": "boom", "request_id": "f-1"})
    refailed = api.post(f"/v1/runs/{a}/fail", json={"error": "boom", "request_id": "f-1"})
    assert refailed.status_code == failed.status_code == 200
    assert refailed.json()["phase"] == "failed"
    cancel = api.post(f"/v1/runs/{b}/cancel", json={"request_id": "x-1"})
    assert cancel.json() == api.post(f"/v1/runs/{b}/cancel", json={"request_id": "x-1"}).json()
    assert cancel.json() == {"cancelled": 1}
    api.post("/v1/workflows/sync/runs", json={"idempotency_key": "k"})
    by_key = {"idempotency_key": "k", "request_id": "x-2"}
    assert api.post("/v1/workflows/sync/cancel", json=by_key).json() == {"cancelled": 1}
    assert api.post("/v1/workflows/sync/cancel", json=by_key).json() == {"cancelled": 1}


def test_openapi_documents_the_request_ids(listener: Listener):
    document = httpx.get(listener.base_url + "/openapi.json", timeout=10).json()

    def body(path: str) -> dict:
        operation = document["paths"][path]["post"]
        return operation["requestBody"]["content"]["application/json"]["schema"]["properties"]

    for path in ("/v1/workflows/{workflow}/runs", "/v1/runs/{run_id}/complete",
                 "/v1/runs/{run_id}/fail", "/v1/runs/{run_id}/cancel",
                 "/v1/workflows/{workflow}/cancel"):  # fmt: skip
        assert body(path)["request_id"]["type"] == "string", path
    assert "batch_id" in body("/v1/workflows/{workflow}/batch")


def test_a_runner_over_http_claims_completes_and_is_told_of_discards(api: httpx.Client):
    assert api.post("/v1/workflows/sync/steps/claim").json() == {"status": "ok", "steps": []}
    runs = [api.post("/v1/workflows/sync/runs", json={"idempotency_key": k,
                                                       "params": {"n": i}}).json()["run_id"]
            for i, k in enumerate(("r0", "r1", "r2"))]  # fmt: skip
    claim = api.post("/v1/workflows/sync/steps/claim",
                     json={"runner": "http-1", "count": 2, "lease_seconds": 60})  # fmt: skip
    assert claim.status_code == 200
    steps = claim.json()["steps"]
    assert [(s["run_id"], s["step"], s["attempt"], s["output"]) for s in steps] == [
        (runs[0], "fetch", 1, None), (runs[1], "fetch", 1, None)]  # fmt: skip
    assert steps[0]["params"] == {"n": 0} and steps[0]["workflow"] == "sync"
    assert steps[0]["lease_until_ms"] > time.time() * 1000 + 50_000

    # The listener's /metrics reads the stream: one step new, two taken.
    text = httpx.get(api.base_url.join("/metrics"), timeout=10).text
    assert 'realm_steps_waiting{state="new",workflow="sync"} 1.0' in text
    assert 'realm_steps_waiting{state="taken",workflow="sync"} 2.0' in text
    assert 'realm_queue_read_ok{workflow="sync"} 1.0' in text

    first, second = steps
    report = {"step": "fetch", "lease": first["lease"], "output": {"rows": 7}}
    done = api.post(f"/v1/runs/{runs[0]}/complete", json=report)
    assert done.json()["next_step"] == "transform"
    # The cancelled run's late result is discarded; a wrong lease is refused.
    api.post(f"/v1/runs/{runs[1]}/cancel")
    late = api.post(
        f"/v1/runs/{runs[1]}/complete", json={"step": "fetch", "lease": second["lease"]}
    )
    assert (late.status_code, late.json()["code"]) == (409, "STATE_RUN_NOT_LIVE")
    third = api.post("/v1/workflows/sync/steps/claim", json={"count": 5}).json()["steps"]
    assert [(s["run_id"], s["step"]) for s in third] == [(runs[2], "fetch"), (runs[0], "transform")]
    assert third[1]["output"] == {"rows": 7}
    wrong = api.post(f"/v1/runs/{runs[2]}/fail", json={"error": "x", "lease": "nope"})
    assert (wrong.status_code, wrong.json()["code"]) == (409, "STATE_STEP_NOT_CURRENT")

    retry = api.post(f"/v1/runs/{runs[2]}/fail", json={
        "error": "flaky", "retry": True, "step": "fetch", "lease": third[0]["lease"]})  # fmt: skip
    body = retry.json()
    assert (body["status"], body["phase"], body["attempt"]) == ("ok", "running", 1)
    assert body["retry_at_ms"] > 0
    needs = api.post(f"/v1/runs/{runs[2]}/fail", json={"retry": True})
    assert needs.json() == {"status": "error", "code": "VALIDATION_BODY",
                            "message": "'retry' needs the fields 'step' and 'lease'"}  # fmt: skip
    for bad in ({"count": 0}, {"count": True}, {"lease_seconds": 0}, {"runner": ""},
                {"count": "2"}):  # fmt: skip
        refused = api.post("/v1/workflows/sync/steps/claim", json=bad)
        assert (refused.status_code, refused.json()["code"]) == (422, "VALIDATION_BODY"), bad
    unknown = api.post("/v1/workflows/nope/steps/claim")
    assert (unknown.status_code, unknown.json()["code"]) == (404, "NOT_FOUND_WORKFLOW")
