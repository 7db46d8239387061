"""The new senders end to end: a real `realm listen` (tests/listener.py) with one trigger
per new scheme (`slack`, `shopify`, `gitlab`, `hmac` with a timestamp) and a `standard`
trigger fed Svix's header names, real HTTP, a real redis-server.

Deliveries are signed as each sender documents it, by tests/signing.py (not by
gateway.signatures.sign.sign, the signer of the code under test); each must start exactly one
run (202), and each forged one must be answered 401 with the exact reason, writing
nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlencode

import httpx
import pytest
import redis as redis_sync

from gateway.store.keys import Keys
from tests.listener import Listener
from tests.servers import RedisServer
from tests.signing import hmac_hex, shopify_headers, slack_headers, standard_headers

SLACK_SECRET = "slack-e2e-8f742231b10e8888abcd"
SHOPIFY_SECRET = "shpss_e2e_4c1d9a7b2e6f0385"
GITLAB_TOKEN = "glpat-e2e-hook-token-71c3a9"
ACME_SECRET = "acme-e2e-secret-0b5d2f4e"
SVIX_SECRET = "whsec_" + "c3ZpeC1lMmUtd2ViaG9vay1rZXktMDEyMzQ1Njc4OQ=="
ENV = {
    "SLACK_SIGNING_SECRET": SLACK_SECRET,
    "SHOPIFY_CLIENT_SECRET": SHOPIFY_SECRET,
    "GITLAB_WEBHOOK_TOKEN": GITLAB_TOKEN,
    "ACME_WEBHOOK_SECRET": ACME_SECRET,
    "SVIX_WEBHOOK_SECRET": SVIX_SECRET,
}

CONFIG = """
version: 1
workflows:
  slack-command: {steps: [reply]}
  shopify-order: {steps: [fulfil]}
  gitlab-push: {steps: [deploy]}
  acme-event: {steps: [sync]}
  svix-event: {steps: [record]}

triggers:
  slack-command:
    workflow: slack-command
    path: /hooks/slack
    verify: {scheme: slack, secret_env: SLACK_SIGNING_SECRET}
    event_id: {jsonpath: $.trigger_id}
    params: {command: $.command}

  shopify-order:
    workflow: shopify-order
    path: /hooks/shopify
    verify: {scheme: shopify, secret_env: SHOPIFY_CLIENT_SECRET}
    when: [{header: X-Shopify-Topic, equals: orders/create}]
    event_id: {header: X-Shopify-Webhook-Id}
    params: {order: $.id}

  gitlab-push:
    workflow: gitlab-push
    path: /hooks/gitlab
    verify: {scheme: gitlab, secret_env: GITLAB_WEBHOOK_TOKEN}
    when: [{header: X-Gitlab-Event, equals: Push Hook}]
    event_id: {header: Idempotency-Key}
    params: {sha: $.after}

  acme-event:
    workflow: acme-event
    path: /hooks/acme
    verify:
      scheme: hmac
      secret_env: ACME_WEBHOOK_SECRET
      header: X-Acme-Signature
      prefix: "v1="
      timestamp_header: X-Acme-Timestamp
      signed_payload: "{timestamp}.{body}"
    event_id: {jsonpath: $.id}

  svix-event:
    workflow: svix-event
    path: /hooks/svix
    verify: {scheme: standard, secret_env: SVIX_WEBHOOK_SECRET}
    event_id: {header: svix-id}
"""


Request = tuple[str, bytes, dict[str, str]]
Signer = Callable[[bytes, float], dict[str, str]]  # (body, now) -> signature headers


def slack_signed(body: bytes, now: float) -> dict[str, str]:
    return slack_headers(body, SLACK_SECRET, timestamp=now, content_type=None)


def acme_signed(body: bytes, now: float) -> dict[str, str]:
    """As the acme-event trigger is configured: hex HMAC-SHA256 of `{timestamp}.{body}`."""
    t = str(int(now))
    signature = hmac_hex(ACME_SECRET, f"{t}.".encode() + body)
    return {"X-Acme-Signature": f"v1={signature}", "X-Acme-Timestamp": t}


def slack_command() -> Request:
    """A slash command as Slack posts it (the fields of Slack's documented example)."""
    body = urlencode(
        {
            "token": "xyzz0WbapA4vBCDEFasx0q6G",
            "team_id": "T1DC2JH3J",
            "team_domain": "testteamnow",
            "channel_id": "G8PSS9T3V",
            "channel_name": "foobar",
            "user_id": "U2CERLKJA",
            "user_name": "roadrunner",
            "command": "/webhook-collect",
            "text": "",
            "response_url": "https://hooks.slack.com/commands/T1DC2JH3J/397700885554/x",
            "trigger_id": f"398738663015.47445629121.{uuid.uuid4().hex}",
        }
    ).encode()
    headers = slack_headers(
        body, SLACK_SECRET, **{"User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)"}
    )
    return "/hooks/slack", body, headers


def shopify_order() -> Request:
    order = {
        "id": int(time.time() * 1000) % 10**12,
        "email": "jon@example.com",
        "financial_status": "paid",
        "total_price": "49.00",
        "currency": "EUR",
        "line_items": [{"id": 866550311766439020, "quantity": 1, "price": "49.00"}],
    }
    body = json.dumps(order, separators=(",", ":")).encode()
    headers = shopify_headers(
        body,
        SHOPIFY_SECRET,
        **{
            "X-Shopify-Topic": "orders/create",
            "X-Shopify-Shop-Domain": "example.myshopify.com",
            "X-Shopify-API-Version": "2026-01",
            "X-Shopify-Webhook-Id": str(uuid.uuid4()),
        },
    )
    return "/hooks/shopify", body, headers


def gitlab_push() -> Request:
    after = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    body = json.dumps(
        {"object_kind": "push", "ref": "refs/heads/main", "after": after, "total_commits_count": 1}
    ).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Gitlab-Event": "Push Hook",
        "Idempotency-Key": str(uuid.uuid4()),
        "X-Gitlab-Token": GITLAB_TOKEN,  # GitLab sends the token itself
    }
    return "/hooks/gitlab", body, headers


def acme_event() -> Request:
    body = json.dumps({"id": f"evt_{uuid.uuid4().hex[:16]}", "type": "account.synced"}).encode()
    headers = {"Content-Type": "application/json", **acme_signed(body, time.time())}
    return "/hooks/acme", body, headers


def svix_event() -> Request:
    """Standard Webhooks under Svix's header names, as Svix sends them."""
    body = json.dumps({"type": "email.sent", "data": {"id": uuid.uuid4().hex}}).encode()
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    signed = standard_headers(body, SVIX_SECRET, msg_id=msg_id, content_type=None)
    headers = {name.replace("webhook-", "svix-"): value for name, value in signed.items()}
    assert set(headers) == {"svix-id", "svix-timestamp", "svix-signature"}
    return "/hooks/svix", body, {"Content-Type": "application/json", **headers}


SENDERS: dict[str, tuple[Callable[[], Request], str]] = {
    "slack-command": (slack_command, "reply"),
    "shopify-order": (shopify_order, "fulfil"),
    "gitlab-push": (gitlab_push, "deploy"),
    "acme-event": (acme_event, "sync"),
    "svix-event": (svix_event, "record"),
}


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Listener]:
    listener = Listener(
        tmp_path_factory.mktemp("e2e-senders"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield listener
    listener.stop()


def runs_of(db: redis_sync.Redis, workflow: str) -> list[str]:
    return db.zrange(Keys("realm", workflow).runs(), 0, -1)


def workflow_keys(db: redis_sync.Redis) -> list[str]:
    """Every key of this module's workflows (runs, streams, pointers, markers). Not
    dbsize(): the gateway may keep records of its own, such as a log of deliveries."""
    return sorted(k for wf in SENDERS for k in db.scan_iter(match=f"realm:{{{wf}}}:*"))


def refused(reply: httpx.Response, reason: str) -> None:
    assert reply.status_code == 401, reply.text
    assert reply.json() == {
        "status": "error",
        "code": "AUTH_REQUIRED",
        "message": f"signature did not verify: {reason}",
    }


# --------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("trigger", list(SENDERS))
def test_a_signed_delivery_starts_one_run(
    trigger: str, http: httpx.Client, db: redis_sync.Redis
) -> None:
    build, step = SENDERS[trigger]
    path, body, headers = build()
    reply = http.post(path, content=body, headers=headers)

    assert reply.status_code == 202, reply.text
    [result] = reply.json()["results"]
    run_id = result["run_id"]
    assert reply.json() == {
        "status": "ok",
        "results": [
            {
                "trigger": trigger,
                "workflow": trigger,
                "outcome": "started",
                "run_id": run_id,
                "deduped": False,
                "rerun_of": None,
                "phase": "running",
                "next_step": step,
                "code": None,
                "message": f"Run '{run_id}' created for workflow '{trigger}'. "
                f"Ready for the agent: '{step}'.",
            }
        ],
    }
    assert runs_of(db, trigger) == [run_id]
    assert db.xlen(Keys("realm", trigger).stream()) == 1
    # What the refusal tests below find empty is where a start writes.
    assert Keys("realm", trigger).runs() in workflow_keys(db)


def test_a_slack_request_signed_again_is_one_run(http: httpx.Client, db: redis_sync.Redis) -> None:
    path, body, headers = slack_command()
    first = http.post(path, content=body, headers=headers)
    assert first.status_code == 202, first.text
    # Signed again a minute later (a new timestamp and signature), the same trigger_id.
    later = {**headers, **slack_signed(body, time.time() + 60)}
    assert later["X-Slack-Signature"] != headers["X-Slack-Signature"]
    again = http.post(path, content=body, headers=later)
    assert again.status_code == 200, again.text
    [result] = again.json()["results"]
    assert (result["outcome"], result["run_id"]) == (
        "deduplicated",
        first.json()["results"][0]["run_id"],
    )
    assert len(runs_of(db, "slack-command")) == 1


def test_shopify_body_replayed_under_a_new_webhook_id_is_one_run(
    http: httpx.Client, db: redis_sync.Redis
) -> None:
    """The replay guard is on by default for shopify: Shopify does not sign
    X-Shopify-Webhook-Id, so a captured delivery could otherwise start new work."""
    path, body, headers = shopify_order()
    first = http.post(path, content=body, headers=headers)
    assert first.status_code == 202, first.text
    run_id = first.json()["results"][0]["run_id"]
    replay = {**headers, "X-Shopify-Webhook-Id": str(uuid.uuid4())}
    again = http.post(path, content=body, headers=replay)
    assert again.status_code == 200, again.text
    [result] = again.json()["results"]
    assert (result["outcome"], result["run_id"]) == ("deduplicated", run_id)
    assert runs_of(db, "shopify-order") == [run_id]


# --------------------------------------------------------------------------- refused


def tampered(request: Request) -> Request:
    path, body, headers = request
    return path, body.replace(b"e", b"E", 1), headers


def changed(request: Request, headers: dict[str, str | None]) -> Request:
    """``request`` with ``headers`` set (None: removed)."""
    path, body, sent = request
    merged = {**sent, **headers}
    return path, body, {name: value for name, value in merged.items() if value is not None}


def signed_at(request: Request, signed: Signer, now: float) -> Request:
    path, body, sent = request
    return path, body, {**sent, **signed(body, now)}


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        pytest.param(lambda: tampered(slack_command()), "signature mismatch", id="slack-body"),
        pytest.param(lambda: tampered(shopify_order()), "signature mismatch", id="shopify-body"),
        pytest.param(lambda: tampered(acme_event()), "signature mismatch", id="acme-body"),
        pytest.param(lambda: tampered(svix_event()), "signature mismatch", id="svix-body"),
        pytest.param(
            lambda: changed(gitlab_push(), {"X-Gitlab-Token": "glpat-guess"}),
            "token mismatch",
            id="gitlab-token",
        ),
        pytest.param(
            lambda: changed(slack_command(), {"X-Slack-Signature": None}),
            "missing header X-Slack-Signature",
            id="slack-unsigned",
        ),
        pytest.param(
            lambda: signed_at(slack_command(), slack_signed, time.time() - 301),
            "timestamp outside tolerance (300 s)",
            id="slack-stale",
        ),
        pytest.param(
            lambda: signed_at(acme_event(), acme_signed, time.time() + 600),
            "timestamp outside tolerance (300 s)",
            id="acme-future",
        ),
        pytest.param(
            lambda: changed(acme_event(), {"X-Acme-Timestamp": str(int(time.time()) + 1)}),
            "signature mismatch",
            id="acme-timestamp-moved",
        ),
        pytest.param(
            # An unsigned webhook-id beside the signed svix-id.
            lambda: changed(svix_event(), {"webhook-id": "msg_forged"}),
            "headers webhook-id and svix-id differ",
            id="svix-extra-id",
        ),
    ],
)
def test_a_forged_delivery_is_401_and_writes_nothing(
    build: Callable[[], Request], reason: str, http: httpx.Client, db: redis_sync.Redis
) -> None:
    path, body, headers = build()
    refused(http.post(path, content=body, headers=headers), reason)
    assert workflow_keys(db) == []
