"""The handshakes that need a sender's keys or servers, end to end against a real
`realm listen` and a real Redis: AWS SNS (a local HTTPS server with a test CA stands in
for SNS's signing certificate and its SubscribeURL), Discord's PING (Ed25519) and X's
CRC check. Each is answered as the sender documents it and writes nothing to the run
store; SNS notifications are deliveries.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_sync
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.datastructures import Headers

from gateway.loading import load_config_without_secrets
from gateway.signatures.verify import verify
from tests.listener import Listener, run_state_keys
from tests.test_verify_sns import TOPIC, FakeSns, Pki, message

DISCORD_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
DISCORD_PUBLIC = (
    DISCORD_KEY.public_key()
    .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    .hex()
)
TWITTER_SECRET = "twitter-consumer-secret-9d0e"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("sns-pki"))


@pytest.fixture(scope="module")
def sns(pki: Pki) -> Iterator[FakeSns]:
    server = FakeSns(pki)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def listener(
    tmp_path_factory: pytest.TempPathFactory, module_redis: Any, sns: FakeSns, pki: Pki
) -> Iterator[Listener]:
    config = f"""
version: 1
workflows:
  events:
    steps: [handle]
triggers:
  orders:
    workflow: events
    path: /hooks/sns
    verify:
      scheme: sns
      topic_arn: "{TOPIC}"
      certificate_hosts: ["{sns.host}"]
      ca_file: "{pki.ca_file}"
    event_id: {{jsonpath: $.MessageId}}
    params: {{message: $.Message}}
  interactions:
    workflow: events
    path: /hooks/discord
    verify: {{scheme: discord, secret_env: DISCORD_PUBLIC_KEY}}
    event_id: {{jsonpath: $.id}}
  activity:
    workflow: events
    path: /hooks/x
    verify: {{scheme: twitter, secret_env: TWITTER_CONSUMER_SECRET}}
    event_id: {{jsonpath: $.id}}
"""
    env = {"DISCORD_PUBLIC_KEY": DISCORD_PUBLIC, "TWITTER_CONSUMER_SECRET": TWITTER_SECRET}
    gateway = Listener(
        tmp_path_factory.mktemp("senders"), config, redis_url=module_redis.url, env=env
    ).start()
    yield gateway
    gateway.stop()


def post_json(listener: Listener, path: str, doc: Any, **headers: str) -> httpx.Response:
    # SNS sends its JSON as text/plain.
    return httpx.post(
        listener.base_url + path, content=orjson.dumps(doc),
        headers={"content-type": "text/plain; charset=UTF-8", **headers}, timeout=10,
    )  # fmt: skip


def test_sns_subscription_is_confirmed_and_notifications_start_runs(
    listener: Listener, sns: FakeSns, pki: Pki, db: redis_sync.Redis
) -> None:
    sns.requests.clear()
    confirmation = message(
        pki, sns.url("/cert.pem"), kind="SubscriptionConfirmation",
        subscribe_url=sns.url("/confirm?Action=ConfirmSubscription&Token=abc"),
    )  # fmt: skip
    reply = post_json(listener, "/hooks/sns", confirmation)
    assert reply.status_code == 200, reply.text
    assert sns.requests == ["/cert.pem", "/confirm?Action=ConfirmSubscription&Token=abc"]
    assert run_state_keys(db) == []

    note = message(pki, sns.url("/cert.pem"))
    first = post_json(listener, "/hooks/sns", note)
    assert first.status_code == 202, first.text
    assert first.json()["results"][0]["outcome"] == "started"
    again = post_json(listener, "/hooks/sns", note)
    assert again.status_code == 200
    assert again.json()["results"][0]["run_id"] == first.json()["results"][0]["run_id"]
    # The certificate was fetched once for all three.
    assert sns.requests.count("/cert.pem") == 1


def test_a_tampered_sns_confirmation_visits_nothing(
    listener: Listener, sns: FakeSns, pki: Pki, db: redis_sync.Redis
) -> None:
    sns.requests.clear()
    forged = message(
        pki, sns.url("/cert.pem"), kind="SubscriptionConfirmation",
        subscribe_url=sns.url("/confirm?Token=forged"),
    )  # fmt: skip
    forged["SubscribeURL"] = sns.url("/confirm?Token=other")
    reply = post_json(listener, "/hooks/sns", forged)
    assert reply.status_code == 401
    assert not any(r.startswith("/confirm") for r in sns.requests)


def test_discord_ping_is_answered_with_a_pong(listener: Listener, db: redis_sync.Redis) -> None:
    body = orjson.dumps({"id": "i-1", "type": 1, "application_id": "a"})
    ts = str(int(time.time()))
    signature = DISCORD_KEY.sign(ts.encode() + body).hex()
    headers = {"X-Signature-Ed25519": signature, "X-Signature-Timestamp": ts,
               "content-type": "application/json"}  # fmt: skip
    reply = httpx.post(listener.base_url + "/hooks/discord", content=body, headers=headers)
    assert reply.status_code == 200 and reply.json() == {"type": 1}
    assert run_state_keys(db) == []
    forged = httpx.post(
        listener.base_url + "/hooks/discord", content=body,
        headers={**headers, "X-Signature-Ed25519": "00" * 64},
    )  # fmt: skip
    assert forged.status_code == 401


def test_x_crc_check_is_answered(listener: Listener, db: redis_sync.Redis) -> None:
    reply = httpx.get(listener.base_url + "/hooks/x", params={"crc_token": "challenge-123"})
    assert reply.status_code == 200
    expected = hmac.digest(TWITTER_SECRET.encode(), b"challenge-123", hashlib.sha256)
    assert reply.json() == {"response_token": "sha256=" + base64.b64encode(expected).decode()}
    assert run_state_keys(db) == []


def test_a_discord_trigger_is_checked_without_secrets_and_verifies_nothing(
    tmp_path: Any,
) -> None:
    """`realm triggers check --no-secrets` loads a file whose discord key is not set;
    the placeholder it puts there is no key, so nothing would verify with it."""
    config = tmp_path / "t.yaml"
    config.write_text(
        "version: 1\nworkflows:\n  w: {steps: [a]}\ntriggers:\n  d:\n    workflow: w\n"
        "    path: /hooks/d\n    verify: {scheme: discord, secret_env: DISCORD_KEY}\n"
        "    event_id: {jsonpath: $.id}\n"
    )
    spec = load_config_without_secrets(config).triggers["d"].verify
    body = b'{"id": "i", "type": 1}'
    ts = str(int(time.time()))
    headers = Headers({"X-Signature-Ed25519": DISCORD_KEY.sign(ts.encode() + body).hex(),
                       "X-Signature-Timestamp": ts})  # fmt: skip
    assert verify(spec, headers, body, time.time()) is not None
