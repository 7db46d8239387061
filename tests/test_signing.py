"""The tests' own signer (tests/signing.py) against the senders' published values and
the vectors of tests/payloads/vectors.json, so that a delivery a test signs is signed
as the sender would sign it. Pure: no Redis, no network.

Published values copied here: GitHub's "Hello, World!" example (docs.github.com,
"Validating webhook deliveries"), Slack's worked example (api.slack.com, "Verifying
requests from Slack"); the Standard Webhooks reference-library vectors are in
vectors.json with their source. Shopify publishes no secret, body and signature
together: its vector is the one tests/test_verify_senders.py explains.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.signing import (
    github_headers,
    github_signature,
    hmac_hex,
    shopify_headers,
    shopify_signature,
    slack_headers,
    slack_signature,
    standard_headers,
    standard_signature,
    stripe_headers,
    stripe_signature,
)

PAYLOADS = Path(__file__).resolve().parent / "payloads"
ROOT = Path(__file__).resolve().parents[1]
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def _vectors(scheme: str) -> list[Any]:
    vectors = json.loads((PAYLOADS / "vectors.json").read_text())["vectors"]
    return [
        pytest.param(v, id=v["id"])
        for v in vectors
        if v["scheme"] == scheme and v["expected_valid"]
    ]


def _body(vector: dict[str, Any]) -> bytes:
    return (PAYLOADS / vector["body_file"]).read_bytes()


# --------------------------------------------------------------------------- GitHub


def test_github_published_example() -> None:
    assert github_signature("It's a Secret to Everybody", b"Hello, World!") == (
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    )


@pytest.mark.parametrize("vector", _vectors("github"))
def test_github_vectors(vector: dict[str, Any]) -> None:
    secret, body, sent = vector["secret"], _body(vector), vector["headers"]
    assert github_signature(secret, body) == sent["X-Hub-Signature-256"]
    assert github_signature(secret, body, algorithm="sha1") == sent["X-Hub-Signature"]
    # A bytes secret is the same key.
    assert github_signature(secret.encode(), body) == sent["X-Hub-Signature-256"]


def test_github_headers_are_a_whole_delivery_in_order() -> None:
    body = b'{"ref":"refs/heads/main"}'
    signature = github_signature("s", body)
    assert list(github_headers(body, "s", delivery="d-1").items()) == [
        ("Content-Type", "application/json"),
        ("X-GitHub-Event", "push"),
        ("X-GitHub-Delivery", "d-1"),
        ("X-Hub-Signature-256", signature),
    ]
    custom = github_headers(
        body, "s", event="ping", delivery="d-2", content_type=None, **{"X-Pad": "p"}
    )
    assert list(custom.items()) == [
        ("X-GitHub-Event", "ping"),
        ("X-GitHub-Delivery", "d-2"),
        ("X-Hub-Signature-256", signature),
        ("X-Pad", "p"),
    ]
    # No delivery id given: a fresh UUID each time, as GitHub sends.
    first, second = (github_headers(body, "s")["X-GitHub-Delivery"] for _ in range(2))
    assert UUID.match(first) and UUID.match(second) and first != second
    # An extra header named like a built one replaces it (a deliberately bad signature).
    forged = github_headers(body, "s", delivery="d-1", **{"X-Hub-Signature-256": "sha256=00"})
    assert forged["X-Hub-Signature-256"] == "sha256=00"


# --------------------------------------------------------------------------- Stripe


@pytest.mark.parametrize("vector", _vectors("stripe"))
def test_stripe_vectors(vector: dict[str, Any]) -> None:
    secret, body, t = vector["secret"], _body(vector), vector["timestamp"]
    sent = vector["headers"]["Stripe-Signature"]
    assert f"t={t},v1={stripe_signature(secret, body, t)}" == sent
    # A float timestamp is sent, and signed, as whole seconds.
    assert stripe_headers(body, secret, timestamp=t + 0.9) == {
        "Content-Type": "application/json; charset=utf-8",
        "Stripe-Signature": sent,
    }
    assert stripe_headers(body, secret, timestamp=t, content_type=None) == {
        "Stripe-Signature": sent
    }


# --------------------------------------------------------------------------- Standard Webhooks


@pytest.mark.parametrize("vector", _vectors("standard-webhooks"))
def test_standard_webhooks_vectors(vector: dict[str, Any]) -> None:
    secret, body, sent = vector["secret"], _body(vector), vector["headers"]
    msg_id, t = sent["webhook-id"], vector["timestamp"]
    assert standard_signature(secret, body, msg_id, t) == sent["webhook-signature"]
    built = standard_headers(body, secret, msg_id=msg_id, timestamp=t, content_type=None)
    assert list(built.items()) == [
        ("webhook-id", msg_id),
        ("webhook-timestamp", str(t)),
        ("webhook-signature", sent["webhook-signature"]),
    ]


def test_standard_headers_make_a_fresh_message_id() -> None:
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    first, second = (standard_headers(b"{}", secret, timestamp=1) for _ in range(2))
    assert first["Content-Type"] == "application/json"
    assert re.fullmatch(r"msg_[0-9a-f]{24}", first["webhook-id"])
    assert first["webhook-id"] != second["webhook-id"]
    assert first["webhook-signature"] == standard_signature(secret, b"{}", first["webhook-id"], 1)


# --------------------------------------------------------------------------- Slack, Shopify, hmac


def test_slack_published_example() -> None:
    secret = "8f742231b10e8888abcd99yyyzzz85a5"
    body = (
        b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow"
        b"&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner"
        b"&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com"
        b"%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
        b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
    )
    signature = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
    assert slack_signature(secret, body, 1531420618) == signature
    assert slack_headers(body, secret, timestamp=1531420618.5) == {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Signature": signature,
        "X-Slack-Request-Timestamp": "1531420618",
    }


def test_shopify_vector() -> None:
    body = b'{"id":1234567890,"email":"customer@example.com","total_price":"123.45"}'
    digest = "QNyObTlKbMx2qDlPF/ZOZcBqg5OgPg+2oky3zldc0Gw="
    assert shopify_signature("test-webhook-secret", body) == digest
    assert shopify_headers(body, "test-webhook-secret", **{"X-Shopify-Topic": "t"}) == {
        "Content-Type": "application/json",
        "X-Shopify-Hmac-Sha256": digest,
        "X-Shopify-Topic": "t",
    }


def test_hmac_hex_is_the_hex_of_the_digests_above() -> None:
    # GitHub's example once more, through the primitive, and its SHA-1 form.
    secret, body = "It's a Secret to Everybody", b"Hello, World!"
    assert "sha256=" + hmac_hex(secret, body) == github_signature(secret, body)
    assert hmac_hex(secret, body, algorithm="sha1") == "01dc10d0c83e72ed246219cdd91669667fe2ca59"


# --------------------------------------------------------------------------- a leaf module


def test_the_signer_imports_nothing_from_gateway() -> None:
    """The benchmarks import it too, and a verifier test must not sign with gateway code."""
    probe = (
        "import sys, tests.signing; "
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'gateway'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
