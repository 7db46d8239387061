"""Senders' handshakes, end to end against a real `realm listen` and a real Redis: each
is answered as the sender documents it, only once the request is verified (or its
verify token checked), writes nothing to the run store, and is recorded in the
delivery log as ``outcome: handshake``. Also: the methods a path takes, and a Stripe
trigger's mode and API version.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync

from tests.listener import Listener, run_state_keys
from tests.signing import slack_headers
from tests.trigger_yaml import BASE, refusal

SLACK_SECRET = "slack-signing-secret-7f3a"
META_APP_SECRET = "meta-app-secret-19bd"
META_VERIFY_TOKEN = "meta-verify-token-44c1"
ZOOM_SECRET = "zoom-secret-token-5e2a"
STRIPE_SECRET = "whsec_handshake_test"
TOKEN = "handshake-api-token-a81c"

CONFIG = """
version: 1
workflows:
  events:
    steps: [handle]
triggers:
  slack-events:
    workflow: events
    path: /hooks/slack
    verify: {scheme: slack, secret_env: SLACK_SIGNING_SECRET}
    event_id: {jsonpath: $.event_id}
  meta:
    workflow: events
    path: /hooks/meta
    verify: {scheme: meta, secret_env: META_APP_SECRET, verify_token_env: META_VERIFY_TOKEN}
    event_id: {jsonpath: "$.entry[0].id"}
  zoom:
    workflow: events
    path: /hooks/zoom
    verify: {scheme: zoom, secret_env: ZOOM_SECRET_TOKEN}
    event_id: {jsonpath: $.payload.object.uuid}
  graph:
    workflow: events
    path: /hooks/graph
    verify: {scheme: none}
    event_id: {jsonpath: "$.value[0].subscriptionId"}
    respond:
      when: [{query: validationToken, exists: true}]
      body: "{query:validationToken}"
  generic:
    workflow: events
    path: /hooks/generic
    verify: {scheme: none}
    methods: [GET, POST]
    event_id: {jsonpath: $.id}
    respond:
      when: [{jsonpath: $.type, equals: challenge}]
      body: {answer: "{$.challenge}"}
  generic-get:
    workflow: events
    path: /hooks/generic
    verify: {scheme: none}
    methods: [GET]
    event_id: {jsonpath: $.id}
    respond:
      when: [{query: check, exists: true}]
      body: "ok {query:check}"
  stripe-live:
    workflow: events
    path: /hooks/stripe
    verify: {scheme: stripe, secret_env: STRIPE_WEBHOOK_SECRET}
    event_id: {jsonpath: $.id}
    stripe: {livemode: true, api_version: "2024-06-20"}
"""

ENV = {
    "SLACK_SIGNING_SECRET": SLACK_SECRET,
    "META_APP_SECRET": META_APP_SECRET,
    "META_VERIFY_TOKEN": META_VERIFY_TOKEN,
    "ZOOM_SECRET_TOKEN": ZOOM_SECRET,
    "STRIPE_WEBHOOK_SECRET": STRIPE_SECRET,
    "REALM_API_TOKEN": TOKEN,
}


@pytest.fixture(scope="module")
def listener(tmp_path_factory: pytest.TempPathFactory, module_redis: Any) -> Iterator[Listener]:
    workdir = tmp_path_factory.mktemp("handshakes")
    gateway = Listener(workdir, CONFIG, redis_url=module_redis.url, env=ENV).start()
    yield gateway
    gateway.stop()


def handshakes_logged(listener: Listener) -> list[dict[str, Any]]:
    """The delivery log's handshakes, newest first (the log is written every 100 ms:
    polled until the one just answered is in, bounded)."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    give_up = time.monotonic() + 5
    while True:
        reply = httpx.get(
            f"{listener.base_url}/v1/deliveries", params={"outcome": "handshake"},
            headers=headers, timeout=10,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        found = reply.json()["deliveries"]
        if found or time.monotonic() > give_up:
            return found
        time.sleep(0.05)


def test_slack_url_verification_echoes_the_challenge_and_writes_no_run(
    listener: Listener, db: redis_sync.Redis
) -> None:
    # Slack's documented example ("URL verification handshake").
    challenge = "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"
    body = orjson.dumps({"token": "x", "challenge": challenge, "type": "url_verification"})
    headers = slack_headers(body, SLACK_SECRET, content_type="application/json")
    reply = httpx.post(f"{listener.base_url}/hooks/slack", content=body, headers=headers)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {"challenge": challenge}
    assert run_state_keys(db) == []
    [logged] = handshakes_logged(listener)[:1]
    assert logged["path"] == "/hooks/slack" and logged["status"] == 200


def test_an_unsigned_slack_challenge_is_refused(listener: Listener, db: redis_sync.Redis) -> None:
    body = orjson.dumps({"challenge": "x", "type": "url_verification"})
    reply = httpx.post(
        f"{listener.base_url}/hooks/slack", content=body,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert reply.status_code == 401 and reply.json()["code"] == "AUTH_REQUIRED"
    assert "challenge" not in reply.text


def test_meta_get_subscription_check(listener: Listener, db: redis_sync.Redis) -> None:
    query = {"hub.mode": "subscribe", "hub.verify_token": META_VERIFY_TOKEN,
             "hub.challenge": "1158201444"}  # fmt: skip
    reply = httpx.get(f"{listener.base_url}/hooks/meta", params=query)
    assert reply.status_code == 200
    assert reply.text == "1158201444"
    assert reply.headers["content-type"].startswith("text/plain")
    wrong = httpx.get(
        f"{listener.base_url}/hooks/meta", params={**query, "hub.verify_token": "guess"}
    )
    assert wrong.status_code == 403 and "1158201444" not in wrong.text
    assert wrong.json()["code"] == "AUTH_REQUIRED"
    assert run_state_keys(db) == []


def test_meta_deliveries_are_signed_like_githubs(listener: Listener, db: redis_sync.Redis) -> None:
    body = orjson.dumps({"object": "page", "entry": [{"id": "m-1", "time": 1}]})
    sig = hmac.new(META_APP_SECRET.encode(), body, hashlib.sha256).hexdigest()
    headers = {"X-Hub-Signature-256": f"sha256={sig}", "content-type": "application/json"}
    reply = httpx.post(f"{listener.base_url}/hooks/meta", content=body, headers=headers)
    assert reply.status_code == 202, reply.text
    assert reply.json()["results"][0]["outcome"] == "started"


def test_zoom_url_validation_answers_the_encrypted_token(
    listener: Listener, db: redis_sync.Redis
) -> None:
    """Zoom's documented answer: the plain token and its HMAC-SHA256 with the secret
    token, hex (computed here with hashlib, independently of the gateway)."""
    body = orjson.dumps({"payload": {"plainToken": "qgg8vlvZRS6UYooatFL8Aw"},
                         "event_ts": 1654503849680,
                         "event": "endpoint.url_validation"})  # fmt: skip
    ts = str(int(time.time()))
    sig = hmac.new(ZOOM_SECRET.encode(), f"v0:{ts}:".encode() + body, hashlib.sha256).hexdigest()
    headers = {"x-zm-signature": f"v0={sig}", "x-zm-request-timestamp": ts,
               "content-type": "application/json"}  # fmt: skip
    reply = httpx.post(f"{listener.base_url}/hooks/zoom", content=body, headers=headers)
    assert reply.status_code == 200, reply.text
    expected = hmac.new(ZOOM_SECRET.encode(), b"qgg8vlvZRS6UYooatFL8Aw", hashlib.sha256)
    assert reply.json() == {
        "plainToken": "qgg8vlvZRS6UYooatFL8Aw",
        "encryptedToken": expected.hexdigest(),
    }
    assert run_state_keys(db) == []


def test_microsoft_graph_validation_token_is_echoed_as_text(
    listener: Listener, db: redis_sync.Redis
) -> None:
    """Graph's subscription validation: a POST with ?validationToken= and no body,
    answered with the token, text/plain, within 10 seconds."""
    token = "Validation: Testing client application reachability for subscription Request-Id: 1"
    reply = httpx.post(
        f"{listener.base_url}/hooks/graph", params={"validationToken": token},
        headers={"content-type": "text/plain; charset=utf-8"},
    )  # fmt: skip
    assert reply.status_code == 200
    assert reply.text == token and reply.headers["content-type"].startswith("text/plain")
    assert run_state_keys(db) == []
    # A notification on the same path is a delivery.
    note = orjson.dumps({"value": [{"subscriptionId": "sub-1", "changeType": "created"}]})
    started = httpx.post(
        f"{listener.base_url}/hooks/graph", content=note,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert started.status_code == 202 and started.json()["results"][0]["outcome"] == "started"


def test_a_respond_rule_answers_a_body_challenge_and_a_get(listener: Listener) -> None:
    body = orjson.dumps({"type": "challenge", "challenge": "abc", "id": "x"})
    reply = httpx.post(
        f"{listener.base_url}/hooks/generic", content=body,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert reply.status_code == 200 and reply.json() == {"answer": "abc"}
    got = httpx.get(f"{listener.base_url}/hooks/generic", params={"check": "42"})
    assert (got.status_code, got.text) == (200, "ok 42")
    none = httpx.get(f"{listener.base_url}/hooks/generic")
    assert none.status_code == 400 and none.json()["code"] == "VALIDATION_HANDSHAKE"


def test_a_path_takes_only_the_methods_its_triggers_declare(listener: Listener) -> None:
    slack = httpx.get(f"{listener.base_url}/hooks/slack")
    assert slack.status_code == 405 and slack.headers["allow"] == "POST"
    meta = httpx.put(f"{listener.base_url}/hooks/meta", content=b"{}")
    assert meta.status_code == 405 and meta.headers["allow"] == "GET, POST"


def test_a_stripe_trigger_refuses_the_other_mode_and_another_api_version(
    listener: Listener, db: redis_sync.Redis
) -> None:
    def send(event: dict[str, Any]) -> dict[str, Any]:
        body = orjson.dumps(event)
        ts = str(int(time.time()))
        sig = hmac.new(STRIPE_SECRET.encode(), f"{ts}.".encode() + body, hashlib.sha256)
        reply = httpx.post(
            f"{listener.base_url}/hooks/stripe", content=body,
            headers={"Stripe-Signature": f"t={ts},v1={sig.hexdigest()}",
                     "content-type": "application/json"},
        )  # fmt: skip
        assert reply.status_code == 200 or reply.status_code == 202, reply.text
        return reply.json()["results"][0]

    test_mode = send({"id": "evt_t", "livemode": False, "api_version": "2024-06-20"})
    assert (test_mode["outcome"], test_mode["code"]) == ("refused", "STATE_STRIPE_LIVEMODE")
    assert test_mode["message"] == (
        "this trigger takes live-mode events; this one is test-mode: nothing was started"
    )
    old = send({"id": "evt_o", "livemode": True, "api_version": "2020-08-27"})
    assert (old["outcome"], old["code"]) == ("refused", "STATE_STRIPE_API_VERSION")
    assert old["message"] == (
        "this trigger takes events of API version 2024-06-20; this one has '2020-08-27': "
        "nothing was started"
    )
    odd = send({"id": "evt_x", "livemode": [True], "api_version": "2024-06-20"})
    assert (odd["outcome"], odd["code"]) == ("refused", "STATE_STRIPE_LIVEMODE")
    assert "this one is of no mode" in odd["message"]
    assert run_state_keys(db) == []
    live = send({"id": "evt_l", "livemode": True, "api_version": "2024-06-20"})
    assert live["outcome"] == "started"


@pytest.mark.parametrize(
    ("extra", "field", "reason"),
    [
        ("methods: GET", "methods", "must be a list"),
        ("methods: [PUT]", "methods[0]", "must be one of GET, POST"),
        ("respond: yes", "respond", "must be a mapping"),
        ("respond: {body: x}", "respond.when", "is required"),
        ("respond: {when: [{query: a, exists: true}]}", "respond.body", "is required"),
        ("respond: {when: [{query: a, exists: true}], body: '{nope}'}", "respond.body",
         "unknown placeholder {nope}"),
        ("respond: {when: [{query: a, exists: true}], body: x, status: 302}", "respond.status",
         "must be a 2xx status"),
        ("respond: {when: [{header: X-A, frob: 1}], body: x}", "respond.when[0].frob",
         "unknown field"),
        ("stripe: {livemode: true}", "stripe", "is for triggers whose verify scheme is stripe"),
    ],
)  # fmt: skip
def test_a_wrong_handshake_field_is_refused_naming_it(extra: str, field: str, reason: str) -> None:
    message = refusal(extra)
    assert f"field '{field}'" in message and reason in message


def test_a_wrong_stripe_rule_is_refused_naming_it(tmp_path: Path) -> None:
    stripe = BASE.replace("{scheme: none}", "{scheme: stripe, secret_env: S}")
    message = refusal("stripe: {api_version: 2024-06-20}", {"S": "whsec_x"}, stripe)
    assert "field 'stripe.api_version'" in message
