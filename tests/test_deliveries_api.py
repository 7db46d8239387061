"""The delivery log over HTTP (``/v1/deliveries``) of a real `realm listen` process: what
the listener recorded, the filters, paging while deliveries arrive, and replays,
including the main use: a delivery ignored by a wrong trigger, replayed once fixed.

The listener writes its records every 100 ms: a test polls until what it sent is in
the log (``wait_for`` here, ``sent`` of tests/deliveries_scaffold.py), with a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests import deliveries_scaffold
from tests.deliveries_scaffold import (
    API_TOKEN,
    CONFIG,
    DLV,
    ENV,
    UNKNOWN,
    WRONG_WHEN,
    github,
    plain,
    push_body,
    sent,
    spec_fingerprint,
)
from tests.listener import Listener
from tests.servers import RedisServer

listener = deliveries_scaffold.listener
BEARER = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture
def api(listener: Listener, db: redis.Redis) -> Iterator[httpx.Client]:
    """The admin API of the module's listener, on an empty store."""
    with httpx.Client(base_url=listener.base_url, headers=BEARER, timeout=10) as client:
        yield client


def listed(api: httpx.Client, **query: Any) -> list[dict[str, Any]]:
    reply = api.get("/v1/deliveries", params={"limit": 1000, **query})
    assert reply.status_code == 200, reply.text
    return reply.json()["deliveries"]


def wait_for(api: httpx.Client, count: int, **query: Any) -> list[dict[str, Any]]:
    """The log's deliveries (under ``query``) once it holds ``count`` of them."""
    deadline = time.monotonic() + 10
    while True:
        found = listed(api, **query)
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) == count, found
            return found
        time.sleep(0.02)


def test_a_delivery_that_started_a_run_is_listed_and_shown_without_its_signature(
    api: httpx.Client, listener: Listener
):
    body = push_body()
    before = int(time.time() * 1000)
    reply = github(listener.base_url, body, delivery="d-41", **{"X-Request-Note": "first try"})
    after = int(time.time() * 1000)
    assert reply.status_code == 202
    run_id = reply.json()["results"][0]["run_id"]

    (summary,) = wait_for(api, 1)
    delivery_id = summary["delivery_id"]
    assert re.fullmatch(DLV, delivery_id)
    assert before <= summary["received_ms"] <= after
    assert summary == {
        "delivery_id": delivery_id,
        "received_ms": summary["received_ms"],
        "path": "/hooks/git",
        "status": 202,
        "code": None,
        "outcomes": [{"trigger": "push", "outcome": "started", "run_id": run_id}],
        "replay_of": None,
    }
    assert api.get("/v1/deliveries").json()["cursor"] is None

    record = api.get(f"/v1/deliveries/{delivery_id}")
    assert record.status_code == 200
    # Every header as sent, in order, but the signature.
    expected = [
        [name.decode().lower(), value.decode()]
        for name, value in reply.request.headers.raw
        if name.lower() != b"x-hub-signature-256"
    ]
    version = api.get("/readyz").json()["config_version"]
    assert record.json() == {
        "delivery_id": delivery_id,
        "received_ms": summary["received_ms"],
        "path": "/hooks/git",
        "status": 202,
        "code": None,
        "message": None,
        "ms": record.json()["ms"],
        "config_version": version,
        "replay_of": None,
        "rerun": False,
        "triggers": [
            {
                "trigger": "push",
                "workflow": "deploy",
                "outcome": "started",
                "run_id": run_id,
                "event_id": "d-41",
                "deduped": False,
                "rerun_of": None,
                "phase": "running",
                "code": None,
                "message": f"Run '{run_id}' created for workflow 'deploy'. Ready for the "
                "agent: 'build'.",
                "signature": "ok",
                "matched": True,
                "why_not": None,
                "key": "d-41",
                "params": {"ref": "refs/heads/main"},
                "verified": True,
                "verify_spec": spec_fingerprint("github", "GIT_SECRET"),
            }
        ],
        "headers": expected,
        "body": body.decode(),
        "body_encoding": "utf-8",
        "body_size": len(body),
        "body_truncated": False,
    }
    names = [name for name, _ in record.json()["headers"]]
    assert "x-request-note" in names and "x-github-delivery" in names
    assert not [name for name in names if "signature" in name]
    assert 0 < record.json()["ms"] < 10_000


def test_a_refused_delivery_is_listed_with_its_reason_and_nothing_it_sent(
    api: httpx.Client, listener: Listener, db: redis.Redis
):
    _, delivery_id = sent(db, lambda: plain(listener.base_url, "e-1", token="wrong-token"), 401)
    (summary,) = listed(api)
    assert summary == {
        "delivery_id": delivery_id,
        "received_ms": summary["received_ms"],
        "path": "/hooks/plain",
        "status": 401,
        "code": "AUTH_REQUIRED",
        "outcomes": [{"trigger": "plain", "outcome": "unverified", "run_id": None}],
        "replay_of": None,
    }
    record = api.get(f"/v1/deliveries/{delivery_id}").json()
    assert (record["code"], record["message"]) == (
        "AUTH_REQUIRED",
        "signature did not verify: token mismatch",
    )
    assert record["triggers"] == [
        {
            "trigger": "plain",
            "workflow": "sync",
            "outcome": "unverified",
            "signature": "token mismatch",
            "verified": False,
            "verify_spec": spec_fingerprint("token", "HOOK_TOKEN"),
            **dict.fromkeys(("run_id", "event_id", "deduped", "rerun_of", "phase", "code")),
            **dict.fromkeys(("message", "matched", "why_not", "key", "params")),
        }
    ]
    assert [record[k] for k in ("headers", "body", "body_encoding", "body_size")] == [None] * 4
    replayed = api.post(f"/v1/deliveries/{delivery_id}/replay")
    assert (replayed.status_code, replayed.json()) == (
        409,
        {
            "status": "error",
            "code": "STATE_DELIVERY_NOT_REPLAYABLE",
            "message": f"delivery {delivery_id} was refused (401) before it was verified: the "
            "log keeps neither its headers nor its body",
        },
    )


def test_filters_by_path_status_outcome_and_since(
    api: httpx.Client, listener: Listener, db: redis.Redis
):
    url = listener.base_url
    _, started = sent(db, lambda: github(url, push_body(), delivery="d-1"), 202)
    _, ignored = sent(db, lambda: github(url, push_body(), event="ping", delivery="d-2"), 200)
    _, plain_started = sent(db, lambda: plain(url, "e-1"), 202)
    _, deduplicated = sent(db, lambda: plain(url, "e-1"), 200)
    _, refused = sent(db, lambda: plain(url, "e-2", token="nope"), 401)
    everything = [refused, deduplicated, plain_started, ignored, started]

    def ids(**query: Any) -> list[str]:
        reply = api.get("/v1/deliveries", params=query)
        assert reply.status_code == 200, reply.text
        assert reply.json()["cursor"] is None
        return [d["delivery_id"] for d in reply.json()["deliveries"]]

    assert ids() == everything
    assert ids(path="/hooks/plain") == [refused, deduplicated, plain_started]
    assert ids(path="/hooks/nowhere") == []
    assert ids(status="202") == [plain_started, started]
    assert ids(status="200") == [deduplicated, ignored]
    assert ids(status="2xx") == [deduplicated, plain_started, ignored, started]
    assert ids(status="4xx") == [refused]
    assert ids(outcome="started") == [plain_started, started]
    assert ids(outcome="ignored") == [ignored]
    assert ids(outcome="deduplicated") == [deduplicated]
    assert ids(outcome="refused") == []
    assert ids(outcome="unverified") == [refused]
    assert ids(path="/hooks/plain", status="200") == [deduplicated]
    # since: a time (ISO 8601, the received time of the third), or a duration back.
    third_ms = listed(api)[2]["received_ms"]
    iso = datetime.fromtimestamp(third_ms / 1000, UTC).isoformat(timespec="milliseconds")
    assert ids(since=iso) == [refused, deduplicated, plain_started]
    assert ids(since=iso.replace("+00:00", "Z")) == [refused, deduplicated, plain_started]
    assert ids(since="1h") == everything
    assert ids(since="2099-01-01T00:00:00Z") == []
    # The ignored delivery says why.
    why = api.get(f"/v1/deliveries/{ignored}").json()["triggers"][0]
    assert (why["outcome"], why["run_id"], why["message"]) == (
        "ignored",
        None,
        "not matched: header X-GitHub-Event is 'ping', expected 'push'",
    )


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"status": "20"}, "status must be an HTTP status like 202 or a class like 4xx (got '20')"),
        (
            {"outcome": "lost"},
            "outcome must be one of started, queued, scheduled, deduplicated, refused, stale, "
            "rate_limited, handshake, ignored, unverified, accepted (got 'lost')",
        ),
        ({"path": "hooks/git"}, "path must start with '/' (got 'hooks/git')"),
        (
            {"since": "yesterday"},
            "since must be an ISO 8601 time like 2026-05-01T12:00:00Z (UTC unless it names an "
            "offset) or a duration like 90m, 2h or 3d, meaning that long ago (got 'yesterday')",
        ),
        ({"limit": "0"}, "limit must be a whole number from 1 to 1000 (got '0')"),
        ({"cursor": "12"}, "cursor must be the value a previous page returned (got '12')"),
    ],
)
def test_a_bad_filter_is_422_naming_it(api: httpx.Client, query: dict, message: str):
    reply = api.get("/v1/deliveries", params=query)
    assert (reply.status_code, reply.json()) == (
        422,
        {"status": "error", "code": "VALIDATION_PARAMS", "message": message},
    )


def test_bad_and_unknown_ids_and_no_token(api: httpx.Client, listener: Listener, db: redis.Redis):
    for method, suffix in (("GET", ""), ("POST", "/replay")):
        bad = api.request(method, f"/v1/deliveries/not-an-id{suffix}")
        assert (bad.status_code, bad.json()) == (
            422,
            {
                "status": "error",
                "code": "VALIDATION_PARAMS",
                "message": "delivery id 'not-an-id' is not one (ids look like "
                "dlv-0193a1b2c3d4-5e6f7a8b)",
            },
        )
        unknown = api.request(method, f"/v1/deliveries/{UNKNOWN}{suffix}")
        assert (unknown.status_code, unknown.json()) == (
            404,
            {
                "status": "error",
                "code": "NOT_FOUND_DELIVERY",
                "message": f"delivery {UNKNOWN} is not in the delivery log (it keeps "
                "settings.delivery_retention and at most settings.max_deliveries)",
            },
        )
    _, delivery_id = sent(db, lambda: plain(listener.base_url, "e-5"), 202)
    wrong = api.post(f"/v1/deliveries/{delivery_id}/replay", json={"rerun": "yes"})
    assert (wrong.status_code, wrong.json()["code"]) == (422, "VALIDATION_BODY")
    for method, path in (
        ("GET", "/v1/deliveries"),
        ("GET", f"/v1/deliveries/{delivery_id}"),
        ("POST", f"/v1/deliveries/{delivery_id}/replay"),
    ):
        bare = httpx.request(method, listener.base_url + path, timeout=10)
        assert (bare.status_code, bare.json()["code"]) == (401, "AUTH_REQUIRED")
    # Nothing was replayed by the refused calls.
    assert len(listed(api)) == 1


def test_replay_deduplicates_and_rerun_starts_a_new_run(api: httpx.Client, listener: Listener):
    first = github(listener.base_url, push_body(), delivery="d-7")
    run_id = first.json()["results"][0]["run_id"]
    (original,) = wait_for(api, 1)
    delivery_id = original["delivery_id"]

    again = api.post(f"/v1/deliveries/{delivery_id}/replay")
    assert again.status_code == 200, again.text
    record = again.json()
    replay_id = record["delivery_id"]
    assert re.fullmatch(DLV, replay_id) and replay_id > delivery_id
    assert (record["replay_of"], record["rerun"], record["status"], record["path"]) == (
        delivery_id,
        False,
        200,
        "/hooks/git",
    )
    (result,) = record["triggers"]
    assert (result["outcome"], result["run_id"], result["deduped"], result["event_id"]) == (
        "deduplicated",
        run_id,
        True,
        "d-7",
    )
    # The replay is in the log, newest, as a replay of the first; the same body.
    assert listed(api)[0] == {
        "delivery_id": replay_id,
        "received_ms": record["received_ms"],
        "path": "/hooks/git",
        "status": 200,
        "code": None,
        "outcomes": [{"trigger": "push", "outcome": "deduplicated", "run_id": run_id}],
        "replay_of": delivery_id,
    }
    stored = api.get(f"/v1/deliveries/{replay_id}").json()
    assert stored == record
    assert stored["body"] == api.get(f"/v1/deliveries/{delivery_id}").json()["body"]

    rerun = api.post(f"/v1/deliveries/{delivery_id}/replay", json={"rerun": True}).json()
    (result,) = rerun["triggers"]
    assert (rerun["status"], rerun["rerun"], rerun["replay_of"]) == (202, True, delivery_id)
    assert (result["outcome"], result["rerun_of"], result["deduped"]) == ("started", run_id, False)
    new_run = api.get(f"/v1/runs/{result['run_id']}").json()
    assert (new_run["rerun_of"], new_run["phase"], new_run["params"]) == (
        run_id,
        "running",
        {"ref": "refs/heads/main"},
    )
    # The key's live run was cancelled first (on_live_match: cancel_existing).
    assert api.get(f"/v1/runs/{run_id}").json()["phase"] == "cancelled"
    runs = api.get("/v1/workflows/deploy/runs").json()["runs"]
    assert sorted(r["run_id"] for r in runs) == sorted([run_id, result["run_id"]])


def test_a_truncated_body_is_not_replayable(api: httpx.Client, listener: Listener, db: redis.Redis):
    body = orjson.dumps({"pad": "x" * 300})
    _, delivery_id = sent(db, lambda: plain(listener.base_url, "e-long", body=body), 202)
    record = api.get(f"/v1/deliveries/{delivery_id}").json()
    assert (record["body"], record["body_size"], record["body_truncated"]) == (
        body[:200].decode(),
        len(body),
        True,
    )
    replayed = api.post(f"/v1/deliveries/{delivery_id}/replay")
    assert (replayed.status_code, replayed.json()) == (
        409,
        {
            "status": "error",
            "code": "STATE_DELIVERY_NOT_REPLAYABLE",
            "message": f"delivery {delivery_id} was stored cut at "
            f"settings.max_stored_body_bytes (its body had {len(body)} bytes): the whole "
            "body is not kept",
        },
    )


@pytest.mark.parametrize("apply", ["sighup", "restart"])
def test_a_delivery_ignored_by_a_wrong_trigger_starts_a_run_once_the_trigger_is_fixed(
    module_redis: RedisServer, db: redis.Redis, tmp_path: Path, apply: str
):
    """The main use: a trigger's `when` was wrong, so a push was ignored; after the
    file is fixed and the listener serves it (reloaded on SIGHUP, or restarted), the
    stored delivery is replayed and starts the run. The reload case shows the replay
    takes the configuration served now, not the one the worker started with."""
    listener = Listener(tmp_path, WRONG_WHEN, redis_url=module_redis.url, env=ENV).start()
    try:
        with httpx.Client(base_url=listener.base_url, headers=BEARER, timeout=10) as api:
            reply = github(listener.base_url, push_body("refs/heads/main"), delivery="d-main")
            assert (reply.status_code, reply.json()["results"][0]["outcome"]) == (200, "ignored")
            (ignored,) = wait_for(api, 1)
            delivery_id = ignored["delivery_id"]
            first = api.get(f"/v1/deliveries/{delivery_id}").json()
            assert first["triggers"][0]["message"] == (
                "not matched: jsonpath $.ref is 'refs/heads/main', expected 'refs/heads/master'"
            )
            # Replayed under the wrong trigger: ignored again, and recorded so.
            still = api.post(f"/v1/deliveries/{delivery_id}/replay").json()
            assert (still["status"], still["triggers"][0]["outcome"]) == (200, "ignored")

        listener.config_path.write_text(CONFIG)
        if apply == "restart":
            listener.stop()
            listener.start()
        else:
            assert listener.process is not None
            os.kill(listener.process.pid, signal.SIGHUP)
        with httpx.Client(base_url=listener.base_url, headers=BEARER, timeout=10) as api:
            deadline = time.monotonic() + 20
            while api.get("/readyz").json()["config_version"] == first["config_version"]:
                assert time.monotonic() < deadline, listener.log()[-2000:]
                time.sleep(0.02)
            replayed = api.post(f"/v1/deliveries/{delivery_id}/replay")
            assert replayed.status_code == 200, replayed.text
            record = replayed.json()
            (result,) = record["triggers"]
            assert (record["status"], record["replay_of"], result["outcome"]) == (
                202,
                delivery_id,
                "started",
            )
            assert result["event_id"] == "d-main"
            assert record["config_version"] == api.get("/readyz").json()["config_version"]
            run = api.get(f"/v1/runs/{result['run_id']}").json()
            assert (run["workflow"], run["params"]) == ("deploy", {"ref": "refs/heads/main"})
            # A second replay is deduplicated to that run: the policies apply.
            again = api.post(f"/v1/deliveries/{delivery_id}/replay").json()
            assert (again["triggers"][0]["outcome"], again["triggers"][0]["run_id"]) == (
                "deduplicated",
                result["run_id"],
            )
            assert [d["replay_of"] for d in listed(api)] == [delivery_id] * 3 + [None]
    finally:
        listener.stop()


def test_paging_sees_every_delivery_once_while_deliveries_arrive(
    api: httpx.Client, listener: Listener
):
    for i in range(40):
        assert plain(listener.base_url, f"before-{i}").status_code == 202
    before = {d["delivery_id"] for d in wait_for(api, 40)}

    stop = threading.Event()
    posted: list[int] = []  # each reply's status (a thread's assert would go unseen)

    def keep_posting() -> None:
        while not stop.is_set():
            posted.append(plain(listener.base_url, f"during-{len(posted)}").status_code)

    poster = threading.Thread(target=keep_posting)
    poster.start()
    seen: list[str] = []
    pages = 0
    try:
        cursor = None
        newest = listed(api, limit=1)[0]["delivery_id"]
        while True:
            query = {"limit": 6} if cursor is None else {"limit": 6, "cursor": cursor}
            page = api.get("/v1/deliveries", params=query).json()
            seen += [d["delivery_id"] for d in page["deliveries"]]
            pages += 1
            cursor = page["cursor"]
            if cursor is None:
                break
            # Before the next page, at least one more delivery is in the log.
            deadline = time.monotonic() + 10
            while listed(api, limit=1)[0]["delivery_id"] == newest:
                assert time.monotonic() < deadline, "no delivery was recorded meanwhile"
                time.sleep(0.01)
            newest = listed(api, limit=1)[0]["delivery_id"]
    finally:
        stop.set()
        poster.join()
    assert pages >= 7
    assert set(posted) == {202}
    assert len(seen) == len(set(seen))  # nothing twice
    assert before <= set(seen)  # nothing there when paging began is skipped
    assert seen == sorted(seen, reverse=True)
    # Once the senders are done, a fresh walk finds every one of them exactly once.
    total = 40 + len(posted)
    assert len(posted) >= pages - 1
    wait_for(api, total)
    walked: list[str] = []
    cursor = None
    while True:
        query = {"limit": 7} if cursor is None else {"limit": 7, "cursor": cursor}
        page = api.get("/v1/deliveries", params=query)
        walked += [d["delivery_id"] for d in page.json()["deliveries"]]
        cursor = page.json()["cursor"]
        if cursor is None:
            break
    assert len(walked) == len(set(walked)) == total


def test_the_openapi_document_describes_what_the_routes_answer(
    api: httpx.Client, listener: Listener, db: redis.Redis
):
    """The replies of the three routes validate against /openapi.json's schemas, which
    name every field a reply has."""
    import jsonschema

    document = api.get("/openapi.json").json()
    paths = document["paths"]

    def schema(path: str, method: str) -> dict[str, Any]:
        ok = paths[path][method]["responses"]["200"]
        return ok["content"]["application/json"]["schema"]

    listing = paths["/v1/deliveries"]["get"]
    assert [(p["name"], p["in"]) for p in listing["parameters"]] == [
        (name, "query") for name in ("path", "status", "outcome", "since", "limit", "cursor")
    ]
    replay_body = paths["/v1/deliveries/{delivery_id}/replay"]["post"]["requestBody"]
    rerun = replay_body["content"]["application/json"]["schema"]["properties"]["rerun"]
    assert (rerun["type"], rerun["default"]) == ("boolean", False)

    _, started = sent(db, lambda: github(listener.base_url, push_body(), delivery="d-9"), 202)
    _, refused = sent(db, lambda: plain(listener.base_url, "e-9", token="nope"), 401)
    replayed = api.post(f"/v1/deliveries/{started}/replay", json={"rerun": True}).json()
    page = api.get("/v1/deliveries").json()
    jsonschema.validate(page, schema("/v1/deliveries", "get"))
    summary_schema = schema("/v1/deliveries", "get")["properties"]["deliveries"]["items"]
    assert all(set(d) == set(summary_schema["properties"]) for d in page["deliveries"])
    record_schema = schema("/v1/deliveries/{delivery_id}", "get")
    for delivery_id in (started, refused):
        record = api.get(f"/v1/deliveries/{delivery_id}").json()
        jsonschema.validate(record, record_schema)
        assert set(record) == set(record_schema["properties"])
    jsonschema.validate(replayed, schema("/v1/deliveries/{delivery_id}/replay", "post"))
    trigger_fields = record_schema["properties"]["triggers"]["items"]["properties"]
    assert set(replayed["triggers"][0]) == set(trigger_fields) - {"params_mismatch"}
