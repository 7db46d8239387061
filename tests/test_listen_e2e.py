"""`realm listen` end to end: a real listener process, real HTTP, real Redis servers.

Every test talks to a `realm listen` process (tests/listener.py) over HTTP and checks
the outcome in a redis-server it started itself: exact status codes, exact reply
fields, exactly one run (`realm:{wf}:runs`) and one stream entry per started run.
Most tests share one listener and one server (module scope, FLUSHALL before each).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import redis as redis_sync

from gateway.link.connection import redis_client
from gateway.link.embedded import socket_answers, socket_path_for
from gateway.loading import parse_config
from gateway.store.keys import Keys
from gateway.store.runstore import RunStore
from tests import signing
from tests.listener import Listener, run_state_keys, run_state_size, spool_off
from tests.servers import RedisServer

# Payloads kept with the tests (tests/payloads/README.md says where from).
PAYLOADS = Path(__file__).resolve().parent / "payloads"
SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "triggers.yaml"

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

GITHUB_SECRET = "gh-e2e-9f3c1a7b5d2e4f60"
STRIPE_SECRET = "whsec_e2eStripeSecret4c8d1f0a9b7e"
STANDARD_SECRET = "whsec_" + "ZTJlLXN0YW5kYXJkLXdlYmhvb2tzLWtleS0xMjM0NTY="
TRIGGER_TOKEN = "tok-e2e-5b0e9d8c7a6f4321"
ENV = {
    "GITHUB_WEBHOOK_SECRET": GITHUB_SECRET,
    "STRIPE_WEBHOOK_SECRET": STRIPE_SECRET,
    "STANDARD_WEBHOOK_SECRET": STANDARD_SECRET,
    "REALM_TRIGGER_TOKEN": TRIGGER_TOKEN,
}
SECRETS = (GITHUB_SECRET, STRIPE_SECRET, STANDARD_SECRET, TRIGGER_TOKEN)

MAX_BODY = 65536

CONFIG = f"""
version: 1
settings:
  max_body_bytes: {MAX_BODY}
workflows:
  deploy:
    steps: [fetch, build, release]
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        repo: {{type: string}}
        sha: {{type: string, pattern: "^[0-9a-f]{{40}}$"}}
  preview:
    steps: [build, publish]
  billing-sync:
    steps: [fetch, sync]
    params_schema:
      type: object
      required: [event_type, customer]
      properties:
        event_type: {{type: string}}
        customer: {{type: string}}
  notify:
    steps: [send]
  audit:
    steps: [record]
  nightly-sync:
    steps: [fetch, sync]
  rebuild-cache:
    steps: [rebuild]

triggers:
  github-push:
    workflow: deploy
    path: /hooks/github
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    when:
      - {{header: X-GitHub-Event, equals: push}}
      - {{jsonpath: $.ref, equals: refs/heads/main}}
    event_id: {{header: X-GitHub-Delivery}}
    params:
      repo: $.repository.full_name
      sha: $.after

  github-preview:
    workflow: preview
    path: /hooks/github-pr
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    when:
      - {{header: X-GitHub-Event, equals: pull_request}}
      - {{jsonpath: $.action, in: [opened, synchronize]}}
    event_id: {{header: X-GitHub-Delivery}}
    key: "pr-{{$.repository.full_name}}-{{$.pull_request.number}}-{{$.pull_request.head.sha}}"
    params:
      repo: $.repository.full_name
      number: $.pull_request.number
      sha: $.pull_request.head.sha
    on_params_mismatch: reject

  stripe-billing:
    workflow: billing-sync
    path: /hooks/stripe
    verify: {{scheme: stripe, secret_env: STRIPE_WEBHOOK_SECRET}}
    when:
      - {{jsonpath: $.type, matches: '^(invoice\\.paid|customer\\.subscription\\..+)$'}}
    event_id: {{jsonpath: $.id}}
    params:
      event_type: $.type
      customer: $.data.object.customer

  events-notify:
    workflow: notify
    path: /hooks/events
    verify: {{scheme: standard, secret_env: STANDARD_WEBHOOK_SECRET}}
    event_id: {{header: webhook-id}}
    params:
      kind: $.type

  events-audit:
    workflow: audit
    path: /hooks/events
    verify: {{scheme: standard, secret_env: STANDARD_WEBHOOK_SECRET}}
    event_id: {{header: webhook-id}}

  nightly-sync:
    workflow: nightly-sync
    path: /hooks/nightly-sync
    verify: {{scheme: token, header: X-Realm-Token, secret_env: REALM_TRIGGER_TOKEN}}
    event_id: {{header: Idempotency-Key, missing: content_hash}}
    key: nightly-sync
    on_live_match: fail
    on_terminal_match: rerun

  rebuild-cache:
    workflow: rebuild-cache
    path: /hooks/rebuild-cache
    verify: {{scheme: token, header: X-Realm-Token, secret_env: REALM_TRIGGER_TOKEN}}
    event_id: {{header: Idempotency-Key, missing: content_hash}}
    key: rebuild-cache
    on_live_match: cancel_existing
    on_terminal_match: rerun
"""


# What GitHub and Stripe send beside the headers they sign.
GITHUB_SENDS = {"User-Agent": "GitHub-Hookshot/7f3d1c2", "X-GitHub-Hook-ID": "480012345"}
STRIPE_SENDS = {"User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)"}

DEPLOY = Keys("realm", "deploy")


# --------------------------------------------------------------------------- payloads


def sha40(seed: str = "") -> str:
    return hashlib.sha1((seed or uuid.uuid4().hex).encode()).hexdigest()


def push_payload(
    *, ref: str = "refs/heads/main", sha: str | None = None, repo: str = "octo-org/shop-api"
) -> dict[str, Any]:
    """A GitHub push event as GitHub sends it (trimmed to the usual fields)."""
    after = sha or sha40()
    owner, name = repo.split("/")
    commit = {
        "id": after,
        "tree_id": sha40(after + "tree"),
        "distinct": True,
        "message": "Retry the payment capture once on a 502",
        "timestamp": "2025-03-14T09:26:53+01:00",
        "url": f"https://github.com/{repo}/commit/{after}",
        "author": {"name": "Mona Lisa", "email": "mona@example.com", "username": "mona"},
        "committer": {"name": "GitHub", "email": "noreply@github.com", "username": "web-flow"},
        "added": [],
        "removed": [],
        "modified": ["payments/capture.py"],
    }
    return {
        "ref": ref,
        "before": sha40(after + "before"),
        "after": after,
        "created": False,
        "deleted": False,
        "forced": False,
        "base_ref": None,
        "compare": f"https://github.com/{repo}/compare/{after[:12]}",
        "commits": [commit],
        "head_commit": commit,
        "repository": {
            "id": 581234567,
            "name": name,
            "full_name": repo,
            "private": True,
            "owner": {"login": owner, "id": 9919, "type": "Organization"},
            "default_branch": "main",
        },
        "pusher": {"name": "mona", "email": "mona@example.com"},
        "sender": {"login": "mona", "id": 583231, "type": "User"},
    }


def pull_request_payload(action: str, *, number: int, head_sha: str) -> dict[str, Any]:
    return {
        "action": action,
        "number": number,
        "pull_request": {
            "number": number,
            "state": "open",
            "title": "Cache exchange rates for an hour",
            "head": {"ref": "rates-cache", "sha": head_sha},
            "base": {"ref": "main", "sha": sha40("base")},
        },
        "repository": {"id": 581234567, "full_name": "octo-org/shop-api"},
        "sender": {"login": "mona", "id": 583231},
        **({"before": sha40("b"), "after": head_sha} if action == "synchronize" else {}),
    }


def stripe_event(event_type: str = "invoice.paid", *, event_id: str | None = None) -> dict:
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex[:24]}",
        "object": "event",
        "api_version": "2024-06-20",
        "created": 1718000000,
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "type": event_type,
        "data": {
            "object": {
                "id": "in_1PQx8N2eZvKYlo2C0hYQ5f3A",
                "object": "invoice",
                "customer": "cus_Q8wvX3kJ7zQ1Rb",
                "amount_paid": 4900,
                "currency": "eur",
                "status": "paid",
            }
        },
    }


def dumps(doc: object) -> bytes:
    return json.dumps(doc, indent=2).encode()


def github_headers(
    body: bytes, *, event: str = "push", delivery: str | None = None
) -> dict[str, str]:
    """Signed as GitHub signs; a fresh ``X-GitHub-Delivery`` unless ``delivery`` is given."""
    return signing.github_headers(
        body, GITHUB_SECRET, event=event, delivery=delivery, **GITHUB_SENDS
    )


def post_github(
    http: httpx.Client,
    body: bytes,
    *,
    delivery: str | None = None,
    event: str = "push",
    path: str = "/hooks/github",
) -> httpx.Response:
    """POST ``body`` signed as GitHub would, with a fresh ``X-GitHub-Delivery`` unless given."""
    return http.post(
        path, content=body, headers=github_headers(body, event=event, delivery=delivery)
    )


def stripe_headers(body: bytes, now: float) -> dict[str, str]:
    return signing.stripe_headers(body, STRIPE_SECRET, timestamp=now, **STRIPE_SENDS)


def token_headers(token: str = TRIGGER_TOKEN, **extra: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Realm-Token": token, **extra}


def new_delivery() -> str:
    return str(uuid.uuid4())


def load_fixture(relative: str) -> dict[str, Any]:
    return json.loads((PAYLOADS / relative).read_bytes())


# --------------------------------------------------------------------------- reply and state


def started(reply: httpx.Response, trigger: str, workflow: str, step: str) -> str:
    """Assert a 202 whose only result started a run; return the run id."""
    assert reply.status_code == 202, reply.text
    body = reply.json()
    [result] = body["results"]
    run_id = result["run_id"]
    assert UUID.match(run_id), run_id
    assert body == {
        "status": "ok",
        "results": [
            {
                "trigger": trigger,
                "workflow": workflow,
                "outcome": "started",
                "run_id": run_id,
                "deduped": False,
                "rerun_of": None,
                "phase": "running",
                "next_step": step,
                "code": None,
                "message": f"Run '{run_id}' created for workflow '{workflow}'. "
                f"Ready for the agent: '{step}'.",
            }
        ],
    }
    return run_id


def deduplicated(reply: httpx.Response, trigger: str, workflow: str, run_id: str, step: str):
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "status": "ok",
        "results": [
            {
                "trigger": trigger,
                "workflow": workflow,
                "outcome": "deduplicated",
                "run_id": run_id,
                "deduped": True,
                "rerun_of": None,
                "phase": "running",
                "next_step": step,
                "code": None,
                "message": f"Matched existing run '{run_id}' (idempotent) in phase 'running'; "
                f"no new run created. Ready for the agent: '{step}'.",
            }
        ],
    }


def error_body(reply: httpx.Response) -> tuple[str, str]:
    body = reply.json()
    assert body["status"] == "error", body
    assert set(body) == {"status", "code", "message"}, body
    return body["code"], body["message"]


def runs_of(db: redis_sync.Redis, workflow: str) -> list[str]:
    return db.zrange(Keys("realm", workflow).runs(), 0, -1)


def stream_of(db: redis_sync.Redis, workflow: str) -> list[dict[str, str]]:
    return [fields for _, fields in db.xrange(Keys("realm", workflow).stream())]


def run_hash(db: redis_sync.Redis, workflow: str, run_id: str) -> dict[str, str]:
    return db.hgetall(Keys("realm", workflow).run(run_id))


def delivery_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{") and '"event":"delivery"' in line:
            lines.append(json.loads(line))
    return lines


def wait_for(condition, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def realm_cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer):
    listener = Listener(
        tmp_path_factory.mktemp("e2e-listen"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield listener
    listener.stop()


# --------------------------------------------------------------------------- redeliveries


def test_github_redelivery_with_same_delivery_id_is_deduplicated_to_one_run(http, db):
    sha = sha40()
    body = dumps(push_payload(sha=sha))
    delivery = new_delivery()

    first = post_github(http, body, delivery=delivery)
    run_id = started(first, "github-push", "deploy", "fetch")
    again = post_github(http, body, delivery=delivery)
    deduplicated(again, "github-push", "deploy", run_id, "fetch")

    assert runs_of(db, "deploy") == [run_id]
    assert stream_of(db, "deploy") == [
        {
            "run_id": run_id,
            "workflow": "deploy",
            "step": "fetch",
            "params": json.dumps({"repo": "octo-org/shop-api", "sha": sha}, separators=(",", ":")),
        }
    ]
    run = run_hash(db, "deploy", run_id)
    assert run["phase"] == "running"
    assert run["step"] == "fetch"
    assert json.loads(run["params"]) == {"repo": "octo-org/shop-api", "sha": sha}


def test_stripe_retry_with_new_timestamp_and_signature_is_one_run(http, db):
    event = load_fixture("stripe/invoice.paid.json")
    event["id"] = f"evt_{uuid.uuid4().hex[:24]}"
    body = dumps(event)
    now = time.time()
    first_headers = stripe_headers(body, now - 90)
    retry_headers = stripe_headers(body, now)
    assert first_headers["Stripe-Signature"] != retry_headers["Stripe-Signature"]

    first = http.post("/hooks/stripe", content=body, headers=first_headers)
    run_id = started(first, "stripe-billing", "billing-sync", "fetch")
    retry = http.post("/hooks/stripe", content=body, headers=retry_headers)
    deduplicated(retry, "stripe-billing", "billing-sync", run_id, "fetch")

    assert runs_of(db, "billing-sync") == [run_id]
    assert db.xlen(Keys("realm", "billing-sync").stream()) == 1
    assert json.loads(run_hash(db, "billing-sync", run_id)["params"]) == {
        "event_type": "invoice.paid",
        "customer": event["data"]["object"]["customer"],
    }
    assert db.exists(Keys("realm", "billing-sync").pointer(event["id"])) == 1


# --------------------------------------------------------------------------- authentication


def test_tampered_body_is_401_and_writes_nothing(http, db):
    body = dumps(push_payload())
    headers = github_headers(body, delivery=new_delivery())
    tampered = body.replace(b"octo-org/shop-api", b"evil-org/shop-api")

    reply = http.post("/hooks/github", content=tampered, headers=headers)

    assert reply.status_code == 401
    assert error_body(reply) == ("AUTH_REQUIRED", "signature did not verify: signature mismatch")
    assert run_state_size(db) == 0


def test_missing_or_wrong_secret_signature_is_401(http, db):
    body = dumps(push_payload())
    unsigned = {
        "Content-Type": "application/json",
        "X-GitHub-Event": "push",
        "X-GitHub-Delivery": new_delivery(),
    }
    reply = http.post("/hooks/github", content=body, headers=unsigned)
    assert reply.status_code == 401
    assert error_body(reply) == (
        "AUTH_REQUIRED",
        "signature did not verify: missing header X-Hub-Signature-256",
    )

    wrong = signing.github_signature("not-the-secret", body)
    reply = http.post(
        "/hooks/github", content=body, headers={**unsigned, "X-Hub-Signature-256": wrong}
    )
    assert reply.status_code == 401
    assert run_state_size(db) == 0


def test_stale_stripe_timestamp_is_401(http, db):
    body = dumps(stripe_event())
    reply = http.post(
        "/hooks/stripe", content=body, headers=stripe_headers(body, time.time() - 301)
    )

    assert reply.status_code == 401
    assert error_body(reply) == (
        "AUTH_REQUIRED",
        "signature did not verify: timestamp outside tolerance (300 s)",
    )
    assert run_state_size(db) == 0


def test_wrong_token_is_401(http, db):
    reply = http.post("/hooks/nightly-sync", content=b"{}", headers=token_headers("tok-guess"))
    assert reply.status_code == 401
    assert error_body(reply) == ("AUTH_REQUIRED", "signature did not verify: token mismatch")
    assert run_state_size(db) == 0


# --------------------------------------------------------------------------- bodies and matching


def test_form_encoded_github_delivery_starts_a_run(http, db):
    sha = sha40()
    form = urlencode({"payload": json.dumps(push_payload(sha=sha))}).encode()
    headers = signing.github_headers(
        form, GITHUB_SECRET, content_type="application/x-www-form-urlencoded"
    )

    reply = http.post("/hooks/github", content=form, headers=headers)

    run_id = started(reply, "github-push", "deploy", "fetch")
    assert runs_of(db, "deploy") == [run_id]
    assert json.loads(run_hash(db, "deploy", run_id)["params"]) == {
        "repo": "octo-org/shop-api",
        "sha": sha,
    }


def test_fan_out_one_path_two_triggers_two_workflows(http, db):
    body = dumps({"type": "invoice.created", "data": {"invoice": "inv_2087", "total": 4900}})
    headers = signing.standard_headers(body, STANDARD_SECRET)
    msg_id = headers["webhook-id"]

    reply = http.post("/hooks/events", content=body, headers=headers)

    assert reply.status_code == 202, reply.text
    results = reply.json()["results"]
    assert [(r["trigger"], r["workflow"], r["outcome"], r["deduped"]) for r in results] == [
        ("events-notify", "notify", "started", False),
        ("events-audit", "audit", "started", False),
    ]
    notify_run, audit_run = (r["run_id"] for r in results)
    assert notify_run != audit_run
    assert runs_of(db, "notify") == [notify_run]
    assert runs_of(db, "audit") == [audit_run]
    assert json.loads(run_hash(db, "notify", notify_run)["params"]) == {"kind": "invoice.created"}

    # The sender's retry (same webhook-id, new timestamp): both deduplicated.
    retry = http.post(
        "/hooks/events",
        content=body,
        headers=signing.standard_headers(
            body, STANDARD_SECRET, msg_id=msg_id, timestamp=time.time() + 1
        ),
    )
    assert retry.status_code == 200, retry.text
    assert [(r["outcome"], r["run_id"]) for r in retry.json()["results"]] == [
        ("deduplicated", notify_run),
        ("deduplicated", audit_run),
    ]
    assert db.xlen(Keys("realm", "notify").stream()) == 1
    assert db.xlen(Keys("realm", "audit").stream()) == 1


@pytest.mark.parametrize(
    ("event", "ref", "reason"),
    [
        ("ping", "refs/heads/main", "header X-GitHub-Event"),
        ("push", "refs/heads/feature/rates-cache", "jsonpath $.ref"),
    ],
    ids=["ping-event", "push-to-other-branch"],
)
def test_filtered_event_is_200_ignored_and_writes_nothing(http, db, event, ref, reason):
    body = dumps(push_payload(ref=ref))
    reply = post_github(http, body, event=event, delivery=new_delivery())

    assert reply.status_code == 200, reply.text
    body_json = reply.json()
    [result] = body_json["results"]
    assert body_json["status"] == "ok"
    assert {k: v for k, v in result.items() if k != "message"} == {
        "trigger": "github-push",
        "workflow": "deploy",
        "outcome": "ignored",
        "run_id": None,
        "deduped": None,
        "rerun_of": None,
        "phase": None,
        "next_step": None,
        "code": None,
    }
    assert result["message"].startswith(f"not matched: {reason}")
    assert run_state_size(db) == 0


def test_unknown_path_is_404_and_get_is_405(http, db):
    reply = http.post("/hooks/gitlab", content=b"{}", headers={"Content-Type": "application/json"})
    assert reply.status_code == 404
    assert error_body(reply) == ("NOT_FOUND_ROUTE", "no route /hooks/gitlab")

    reply = http.get("/hooks/github")
    assert reply.status_code == 405
    assert error_body(reply) == ("METHOD_NOT_ALLOWED", "this webhook path takes POST only")
    assert "POST" in reply.headers["allow"]
    assert run_state_size(db) == 0


def _padded_push(size: int) -> tuple[bytes, str]:
    """A valid push body of exactly ``size`` bytes, and its sha."""
    sha = sha40()
    doc = push_payload(sha=sha)
    doc["padding"] = ""
    base = len(dumps(doc))
    doc["padding"] = "x" * (size - base)
    body = dumps(doc)
    assert len(body) == size
    return body, sha


def test_body_over_max_body_bytes_is_413_and_at_the_limit_is_accepted(http, db):
    over, _ = _padded_push(MAX_BODY + 1)
    reply = post_github(http, over, delivery=new_delivery())
    assert reply.status_code == 413
    assert error_body(reply) == (
        "VALIDATION_BODY_TOO_LARGE",
        f"body is larger than {MAX_BODY} bytes",
    )

    # Without a Content-Length (chunked), the limit holds while reading.
    def chunks() -> Iterator[bytes]:
        for i in range(0, len(over), 8192):
            yield over[i : i + 8192]

    headers = github_headers(over, delivery=new_delivery())
    reply = http.post("/hooks/github", content=chunks(), headers=headers)
    assert reply.status_code == 413
    assert run_state_size(db) == 0

    at_limit, _ = _padded_push(MAX_BODY)
    reply = post_github(http, at_limit, delivery=new_delivery())
    started(reply, "github-push", "deploy", "fetch")


def test_params_failing_params_schema_is_422_and_writes_nothing(http, db):
    doc = push_payload()
    doc["after"] = "HEAD~1"
    body = dumps(doc)

    reply = post_github(http, body, delivery=new_delivery())

    assert reply.status_code == 422, reply.text
    [result] = reply.json()["results"]
    assert reply.json()["status"] == "error"
    assert result["outcome"] == "refused"
    assert result["code"] == "VALIDATION_PARAMS"
    assert result["run_id"] is None
    assert "sha" in result["message"]
    assert run_state_size(db) == 0


def test_missing_event_id_is_422_and_writes_nothing(http, db):
    body = dumps(push_payload())
    headers = github_headers(body)
    del headers["X-GitHub-Delivery"]
    reply = http.post("/hooks/github", content=body, headers=headers)

    assert reply.status_code == 422, reply.text
    [result] = reply.json()["results"]
    assert (result["outcome"], result["code"]) == ("refused", "VALIDATION_EVENT_ID")
    assert result["message"] == (
        "event id is missing: header X-GitHub-Delivery has no string or integer value"
    )
    assert run_state_size(db) == 0


def test_signed_unparseable_json_is_400(http, db):
    body = b'{"ref": "refs/heads/main", "after": '
    reply = post_github(http, body, delivery=new_delivery())

    assert reply.status_code == 400
    code, message = error_body(reply)
    assert code == "VALIDATION_BODY"
    assert message.startswith("body is not parseable: body is not valid JSON")
    assert run_state_size(db) == 0


# --------------------------------------------------------------------------- singletons


async def test_singleton_fail_refuses_while_live_and_reruns_once_ended(http, db, module_redis):
    first = http.post(
        "/hooks/nightly-sync", content=b'{"night": "2025-03-14"}', headers=token_headers()
    )
    run_id = started(first, "nightly-sync", "nightly-sync", "fetch")

    second = http.post(
        "/hooks/nightly-sync", content=b'{"night": "2025-03-15"}', headers=token_headers()
    )
    assert second.status_code == 200, second.text
    assert second.json() == {
        "status": "ok",
        "results": [
            {
                "trigger": "nightly-sync",
                "workflow": "nightly-sync",
                "outcome": "refused",
                "run_id": None,
                "deduped": None,
                "rerun_of": None,
                "phase": None,
                "next_step": None,
                "code": "STATE_RUN_ALREADY_ACTIVE",
                "message": "Idempotency key for workflow 'nightly-sync' is owned by an active "
                f"run '{run_id}' (phase 'running').",
            }
        ],
    }
    assert runs_of(db, "nightly-sync") == [run_id]

    # Once the run ended, the next trigger starts afresh (on_terminal_match: rerun).
    client = redis_client(module_redis.url, 5.0)
    try:
        store = RunStore(client, parse_config(CONFIG, file="e2e.yaml", with_triggers=False))
        assert await store.cancel_run(run_id) == 1
    finally:
        await client.aclose()
    third = http.post(
        "/hooks/nightly-sync", content=b'{"night": "2025-03-15"}', headers=token_headers()
    )
    assert third.status_code == 202, third.text
    [result] = third.json()["results"]
    assert result["outcome"] == "started"
    assert result["run_id"] != run_id
    assert set(runs_of(db, "nightly-sync")) == {run_id, result["run_id"]}
    assert run_hash(db, "nightly-sync", result["run_id"])["rerun_of"] == run_id


def test_singleton_cancel_existing_replaces_the_live_run(http, db):
    first = http.post(
        "/hooks/rebuild-cache", content=b'{"reason": "deploy"}', headers=token_headers()
    )
    old = started(first, "rebuild-cache", "rebuild-cache", "rebuild")

    second = http.post(
        "/hooks/rebuild-cache", content=b'{"reason": "config change"}', headers=token_headers()
    )
    assert second.status_code == 202, second.text
    [result] = second.json()["results"]
    new = result["run_id"]
    assert (result["outcome"], result["deduped"], result["code"]) == ("started", False, None)
    assert new != old
    assert result["message"] == (
        f"Run '{new}' created for workflow 'rebuild-cache'; it supersedes run '{old}' under "
        "the same idempotency key (on_live_match). Ready for the agent: 'rebuild'."
    )

    assert run_hash(db, "rebuild-cache", old)["phase"] == "cancelled"
    new_run = run_hash(db, "rebuild-cache", new)
    assert (new_run["phase"], new_run["rerun_of"]) == ("running", old)
    assert set(runs_of(db, "rebuild-cache")) == {old, new}
    assert db.hget(Keys("realm", "rebuild-cache").pointer("rebuild-cache"), "run") == new


def test_cancel_existing_reply_names_the_superseded_run(http, db):
    old = started(
        http.post("/hooks/rebuild-cache", content=b'{"n": 1}', headers=token_headers()),
        "rebuild-cache",
        "rebuild-cache",
        "rebuild",
    )
    second = http.post("/hooks/rebuild-cache", content=b'{"n": 2}', headers=token_headers())
    [result] = second.json()["results"]
    assert result.get("rerun_of") == old
    assert result.get("phase") == "running"
    assert result.get("next_step") == "rebuild"


def test_pull_request_opened_then_synchronize_same_head_share_one_run(http, db):
    head = sha40()
    opened = dumps(pull_request_payload("opened", number=88, head_sha=head))
    sync = dumps(pull_request_payload("synchronize", number=88, head_sha=head))

    first = post_github(
        http, opened, event="pull_request", delivery=new_delivery(), path="/hooks/github-pr"
    )
    run_id = started(first, "github-preview", "preview", "build")
    second = post_github(
        http, sync, event="pull_request", delivery=new_delivery(), path="/hooks/github-pr"
    )

    assert runs_of(db, "preview") == [run_id]
    deduplicated(second, "github-preview", "preview", run_id, "build")


# --------------------------------------------------------------------------- concurrency


@pytest.fixture
def two_workers(tmp_path: Path, module_redis: RedisServer, db) -> Iterator[Listener]:
    listener = Listener(tmp_path, CONFIG, redis_url=module_redis.url, env=ENV, workers=2).start()
    yield listener
    listener.stop()


async def test_100_concurrent_redeliveries_to_2_workers_make_exactly_one_run(two_workers, db):
    sha = sha40()
    body = dumps(push_payload(sha=sha))
    headers = github_headers(body, delivery=new_delivery())
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=two_workers.base_url, limits=limits, timeout=30) as c:
        replies = await asyncio.gather(
            *(c.post("/hooks/github", content=body, headers=headers) for _ in range(100))
        )

    assert Counter(r.status_code for r in replies) == {202: 1, 200: 99}
    run_ids = {r.json()["results"][0]["run_id"] for r in replies}
    assert len(run_ids) == 1
    [run_id] = run_ids
    outcomes = Counter(r.json()["results"][0]["outcome"] for r in replies)
    assert outcomes == {"started": 1, "deduplicated": 99}
    assert runs_of(db, "deploy") == [run_id]
    assert db.xlen(DEPLOY.stream()) == 1


# --------------------------------------------------------------------------- Redis down


@pytest.mark.faults
def test_redis_stopped_is_503_fast_and_recovers_without_restarting_the_listener(
    tmp_path: Path, start_redis
):
    server = start_redis()
    listener = Listener(
        _mkdir(tmp_path / "listen"), spool_off(CONFIG), redis_url=server.url, env=ENV
    ).start()
    try:
        pid = listener.process.pid
        with httpx.Client(base_url=listener.base_url, timeout=10) as http:
            warm = dumps(push_payload())
            started(
                post_github(http, warm, delivery=new_delivery()),
                "github-push",
                "deploy",
                "fetch",
            )

            server.stop()
            body = dumps(push_payload())
            delivery = new_delivery()
            t0 = time.monotonic()
            reply = post_github(http, body, delivery=delivery)
            elapsed = time.monotonic() - t0
            assert reply.status_code == 503, reply.text
            assert elapsed < 3.0
            assert int(reply.headers["retry-after"]) > 0
            code, message = error_body(reply)
            assert code == "STORE_UNAVAILABLE"
            assert message.startswith("Redis is unreachable")
            assert http.get("/readyz").status_code == 503
            assert http.get("/healthz").status_code == 200

            server.start()  # the same port
            assert server.process is not None

            def retried() -> httpx.Response | None:
                r = post_github(http, body, delivery=delivery)
                return r if r.status_code != 503 else None

            reply = wait_for(retried, 15, "a 2xx once Redis is back")
            run_id = started(reply, "github-push", "deploy", "fetch")
            assert listener.process.pid == pid and listener.process.poll() is None
            assert http.get("/readyz").status_code == 200

        db = redis_sync.Redis.from_url(server.url, decode_responses=True)
        try:
            assert runs_of(db, "deploy") == [run_id]  # the server started empty
            assert db.xlen(DEPLOY.stream()) == 1
        finally:
            db.close()
    finally:
        listener.stop()


@pytest.mark.slow
@pytest.mark.faults
def test_redis_paused_is_503_within_the_timeout_and_the_retry_finds_one_run(
    tmp_path: Path, start_redis
):
    server = start_redis()
    listener = Listener(
        _mkdir(tmp_path / "listen"), spool_off(CONFIG), redis_url=server.url, env=ENV
    ).start()
    try:
        body = dumps(push_payload())
        delivery = new_delivery()
        with httpx.Client(base_url=listener.base_url, timeout=10) as http:
            assert http.get("/readyz").status_code == 200
            server.pause()
            try:
                t0 = time.monotonic()
                reply = post_github(http, body, delivery=delivery)
                elapsed = time.monotonic() - t0
            finally:
                server.resume()
            assert reply.status_code == 503, reply.text
            assert 1.5 < elapsed < 3.5
            assert reply.headers["retry-after"] == "5"
            assert error_body(reply) == (
                "STORE_UNAVAILABLE",
                "Redis did not answer within 2 s; the outcome is unknown, retry",
            )
            # The claim may have run once Redis resumed; the sender's retry finds it.
            retry = post_github(http, body, delivery=delivery)
            assert retry.status_code in (200, 202), retry.text
            run_id = retry.json()["results"][0]["run_id"]
        db = redis_sync.Redis.from_url(server.url, decode_responses=True)
        try:
            assert runs_of(db, "deploy") == [run_id]
            assert db.xlen(DEPLOY.stream()) == 1
        finally:
            db.close()
    finally:
        listener.stop()


# --------------------------------------------------------------------------- the log


def test_one_json_log_line_per_delivery_and_no_secret_signature_or_body(http, db, gateway):
    offset = len(gateway.log())
    marker = f"body-marker-{uuid.uuid4().hex}"
    doc = push_payload()
    doc["head_commit"]["message"] = marker
    body = dumps(doc)
    delivery = new_delivery()
    headers = github_headers(body, delivery=delivery)
    signature = headers["X-Hub-Signature-256"]

    run_id = started(
        http.post("/hooks/github", content=body, headers=headers), "github-push", "deploy", "fetch"
    )
    http.post("/hooks/github", content=body, headers=headers)  # deduplicated
    ping = dumps({"zen": marker, "hook_id": 480012345})
    ping_headers = github_headers(ping, event="ping", delivery=new_delivery())
    http.post("/hooks/github", content=ping, headers=ping_headers)  # ignored
    http.post("/hooks/github", content=body + b" ", headers=headers)  # 401
    stripe_body = dumps(stripe_event())
    stripe_sig = stripe_headers(stripe_body, time.time())
    http.post("/hooks/stripe", content=stripe_body, headers=stripe_sig)
    http.post("/hooks/nightly-sync", content=dumps({"note": marker}), headers=token_headers())

    lines = wait_for(
        lambda: (found := delivery_lines(gateway.log()[offset:])) and len(found) >= 6 and found,
        5,
        "six delivery log lines",
    )
    assert len(lines) == 6
    for line in lines:
        assert line["event"] == "delivery"
        assert isinstance(line["ms"], int | float) and line["ms"] >= 0
    assert [(line["path"], line["status"]) for line in lines] == [
        ("/hooks/github", 202),
        ("/hooks/github", 200),
        ("/hooks/github", 200),
        ("/hooks/github", 401),
        ("/hooks/stripe", 202),
        ("/hooks/nightly-sync", 202),
    ]
    assert lines[0]["results"] == [
        {
            "trigger": "github-push",
            "workflow": "deploy",
            "event_id": delivery,
            "outcome": "started",
            "run_id": run_id,
        }
    ]
    assert lines[1]["results"] == [
        {
            "trigger": "github-push",
            "workflow": "deploy",
            "event_id": delivery,
            "outcome": "deduplicated",
            "run_id": run_id,
        }
    ]
    assert [(r["outcome"], r["run_id"]) for r in lines[2]["results"]] == [("ignored", None)]
    assert lines[3] == {
        "event": "delivery",
        "ts": lines[3]["ts"],
        "level": "info",
        "path": "/hooks/github",
        "status": 401,
        "ms": lines[3]["ms"],
        "code": "AUTH_REQUIRED",
    }

    log = gateway.log()
    for secret in SECRETS:
        assert secret not in log
    for value in (
        signature,
        signature.removeprefix("sha256="),
        stripe_sig["Stripe-Signature"],
        ping_headers["X-Hub-Signature-256"],
    ):
        assert value not in log
    assert marker not in log
    assert "Retry the payment capture" not in log


# --------------------------------------------------------------------------- realm triggers


def test_triggers_check_prints_the_table(tmp_path: Path):
    result = realm_cli("triggers", "check", "--config", str(SHIPPED_CONFIG), cwd=tmp_path, env=ENV)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "TRIGGER",
        "PATH",
        "WORKFLOW",
        "VERIFY",
        "EVENT",
        "ID",
        "ON",
        "LIVE",
        "ON",
        "TERMINAL",
    ]
    rows = [re.split(r"\s{2,}", line) for line in lines[1:-1]]
    assert rows == [
        [
            "github-push",
            "/hooks/github",
            "deploy",
            "github",
            "header X-GitHub-Delivery",
            "use_existing",
            "reuse",
        ],
        [
            "github-preview",
            "/hooks/github",
            "preview",
            "github",
            "header X-GitHub-Delivery",
            "use_existing",
            "reuse",
        ],
        [
            "stripe-billing",
            "/hooks/stripe",
            "billing-sync",
            "stripe",
            "jsonpath $.id",
            "use_existing",
            "reuse",
        ],
        [
            "nightly-sync",
            "/hooks/nightly-sync",
            "nightly-sync",
            "token X-Realm-Token",
            "header Idempotency-Key (else content hash)",
            "fail",
            "rerun",
        ],
        [
            "rebuild-cache",
            "/hooks/rebuild-cache",
            "rebuild-cache",
            "token X-Realm-Token",
            "header Idempotency-Key (else content hash)",
            "cancel_existing",
            "rerun",
        ],
    ]
    assert lines[-1] == f"{SHIPPED_CONFIG}: ok: 5 workflows, 5 triggers"
    for secret in SECRETS:
        assert secret not in result.stdout + result.stderr


def test_triggers_check_without_a_secret_env_fails_with_exit_3(tmp_path: Path):
    env = {k: v for k, v in ENV.items() if k != "STRIPE_WEBHOOK_SECRET"}
    result = realm_cli("triggers", "check", "--config", str(SHIPPED_CONFIG), cwd=tmp_path, env=env)

    assert result.returncode == 3
    assert result.stdout == ""
    assert "stripe-billing" in result.stderr
    assert "environment variable STRIPE_WEBHOOK_SECRET is not set" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_triggers_test_dry_run_writes_nothing_and_sees_the_run_after_a_delivery(
    http, db, gateway, module_redis, tmp_path: Path
):
    sha = sha40()
    body = dumps(push_payload(sha=sha))
    body_file = tmp_path / "push.json"
    body_file.write_bytes(body)
    delivery = f"abc-{uuid.uuid4().hex[:8]}"

    def dry_run(delivery: str = delivery) -> subprocess.CompletedProcess[str]:
        return realm_cli(
            "triggers",
            "test",
            "--config",
            str(gateway.config_path),
            "--path",
            "/hooks/github",
            "--body",
            str(body_file),
            "--header",
            "X-GitHub-Event: push",
            "--header",
            f"X-GitHub-Delivery: {delivery}",
            "--sign",
            "--redis-url",
            module_redis.url,
            cwd=tmp_path,
            env=ENV,
        )

    assert run_state_size(db) == 0
    result = dry_run()
    assert result.returncode == 0, result.stderr
    params = json.dumps({"repo": "octo-org/shop-api", "sha": sha}, separators=(",", ":"))
    assert result.stdout.splitlines() == [
        "POST /hooks/github (dry run: nothing is written)",
        "trigger github-push → deploy",
        "  signature: ok",
        "  when: all hold",
        f"  event id: {delivery}",
        f"  key: {delivery}",
        f"  params: {params}",
        "  result: a claim now would start a new run",
    ]
    assert run_state_size(db) == 0

    run_id = started(
        post_github(http, body, delivery=delivery),
        "github-push",
        "deploy",
        "fetch",
    )
    size = run_state_size(db)
    snapshot = {key: db.type(key) for key in run_state_keys(db)}

    result = dry_run()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"  result: a claim now would return run {run_id} (deduplicated, phase 'running')"
    )
    assert run_state_size(db) == size
    assert {key: db.type(key) for key in run_state_keys(db)} == snapshot
    assert runs_of(db, "deploy") == [run_id]
    assert db.xlen(DEPLOY.stream()) == 1
    for secret in SECRETS:
        assert secret not in result.stdout + result.stderr

    # The same body under another delivery id: the dry run predicts what the
    # replay guard makes the live claim do.
    result = dry_run(f"replayed-{uuid.uuid4().hex[:8]}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"  result: a claim now would return run {run_id} (deduplicated, phase 'running')"
    )
    assert run_state_size(db) == size


# --------------------------------------------------------------------------- shipped config


@pytest.fixture
def shipped(tmp_path: Path, module_redis: RedisServer, db) -> Iterator[Listener]:
    listener = Listener(
        tmp_path,
        SHIPPED_CONFIG.read_text(),
        redis_url=module_redis.url,
        env={
            k: ENV[k]
            for k in ("GITHUB_WEBHOOK_SECRET", "STRIPE_WEBHOOK_SECRET", "REALM_TRIGGER_TOKEN")
        },
    ).start()
    yield listener
    listener.stop()


def test_shipped_triggers_yaml_deploys_a_push_to_main(shipped, db):
    doc = load_fixture("github/push.json")
    sha = sha40()
    doc["ref"] = "refs/heads/main"
    doc["after"] = sha
    body = dumps(doc)
    delivery = new_delivery()

    with httpx.Client(base_url=shipped.base_url, timeout=10) as http:
        reply = post_github(http, body, delivery=delivery)
        assert reply.status_code == 202, reply.text
        results = reply.json()["results"]
        assert [(r["trigger"], r["workflow"], r["outcome"]) for r in results] == [
            ("github-push", "deploy", "started"),
            ("github-preview", "preview", "ignored"),
        ]
        run_id = results[0]["run_id"]
        again = post_github(http, body, delivery=delivery)
        assert again.status_code == 200
        assert [(r["outcome"], r["run_id"]) for r in again.json()["results"]] == [
            ("deduplicated", run_id),
            ("ignored", None),
        ]

    assert runs_of(db, "deploy") == [run_id]
    assert json.loads(run_hash(db, "deploy", run_id)["params"]) == {
        "repo": doc["repository"]["full_name"],
        "sha": sha,
    }
    assert [entry["step"] for entry in stream_of(db, "deploy")] == ["fetch"]
    assert runs_of(db, "preview") == []


# --------------------------------------------------------------------------- SIGTERM


async def test_sigterm_with_deliveries_in_flight_answers_them_and_each_2xx_has_its_run(
    tmp_path: Path, module_redis: RedisServer, db
):
    listener = Listener(tmp_path, CONFIG, redis_url=module_redis.url, env=ENV).start()
    try:
        release = asyncio.Event()
        n = 8
        sent = [asyncio.Event() for _ in range(n)]
        bodies = [dumps(push_payload()) for _ in range(n)]

        async def slow_body(i: int) -> AsyncIterator[bytes]:
            half = len(bodies[i]) // 2
            yield bodies[i][:half]
            sent[i].set()  # resumed only after the first half went out
            await release.wait()
            yield bodies[i][half:]

        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=listener.base_url, limits=limits, timeout=40) as c:
            slow = [
                asyncio.create_task(
                    c.post(
                        "/hooks/github",
                        content=slow_body(i),
                        headers=github_headers(bodies[i], delivery=new_delivery()),
                    )
                )
                for i in range(n)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in sent)), 10)
            # A request on a fresh connection answered: the listener has read the
            # slow requests' headers, so they are in flight.
            async with httpx.AsyncClient(base_url=listener.base_url, timeout=5) as probe:
                assert (await probe.get("/healthz")).status_code == 200

            listener.terminate()

            async def late(i: int) -> httpx.Response | Exception:
                body = dumps(push_payload())
                try:
                    return await c.post(
                        "/hooks/github",
                        content=body,
                        headers=github_headers(body, delivery=new_delivery()),
                    )
                except httpx.HTTPError as exc:
                    return exc

            late_replies = await asyncio.gather(*(late(i) for i in range(16)))
            release.set()
            slow_replies = await asyncio.gather(*slow)

        # It exits once they are answered (no hang); the code is test_sigterm_exits_0's.
        await asyncio.to_thread(listener.wait, 40)

        slow_ids = [started(r, "github-push", "deploy", "fetch") for r in slow_replies]
        ok = [r for r in late_replies if isinstance(r, httpx.Response) and r.status_code < 300]
        ok_ids = [r.json()["results"][0]["run_id"] for r in ok] + slow_ids
        for r in late_replies:
            assert isinstance(r, httpx.HTTPError) or r.status_code in (202, 503), r
        stored = set(runs_of(db, "deploy"))
        assert set(ok_ids) <= stored
        for run_id in ok_ids:
            assert run_hash(db, "deploy", run_id)["phase"] == "running"
        assert db.xlen(DEPLOY.stream()) == len(stored)
    finally:
        listener.stop()


@pytest.mark.parametrize(
    "workers",
    [
        1,
        2,
    ],
)
def test_sigterm_exits_0(tmp_path: Path, module_redis: RedisServer, db, workers: int):
    listener = Listener(
        tmp_path, CONFIG, redis_url=module_redis.url, env=ENV, workers=workers
    ).start()
    try:
        body = dumps(push_payload())
        reply = httpx.post(
            f"{listener.base_url}/hooks/github",
            content=body,
            headers=github_headers(body, delivery=new_delivery()),
        )
        started(reply, "github-push", "deploy", "fetch")
        listener.terminate()
        assert listener.wait(40) == 0
    finally:
        listener.stop()


def test_sigterm_stops_the_embedded_server(tmp_path: Path):
    data_dir = tmp_path / "data"
    listener = Listener(
        _mkdir(tmp_path / "listen"),
        CONFIG,
        redis_url=None,
        env=ENV,
        args=("--data-dir", str(data_dir)),
    ).start()
    sock = socket_path_for(data_dir)
    try:
        assert socket_answers(sock)
        body = dumps(push_payload())
        reply = httpx.post(
            f"{listener.base_url}/hooks/github",
            content=body,
            headers=github_headers(body, delivery=new_delivery()),
        )
        started(reply, "github-push", "deploy", "fetch")
        listener.terminate()
        listener.wait(40)
        assert not socket_answers(sock), "the embedded server outlived `realm listen`"
    finally:
        listener.stop()
        _stop_orphaned_embedded_server(sock)


def _stop_orphaned_embedded_server(sock: Path) -> None:
    """The embedded server this test's listener started, if it survived: stop it by pid."""
    if not socket_answers(sock):
        return
    client = redis_sync.Redis(unix_socket_path=str(sock), socket_timeout=5)
    try:
        pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not socket_answers(sock, timeout=0.2), 10, "the embedded server to stop")
