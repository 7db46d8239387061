"""Signed webhook deliveries as their senders build them, for the tests and benchmarks.

Each builder follows the sender's own documentation and uses the standard library
only. It never calls ``gateway.signatures.sign.sign``: a test of the verifier must not sign
with the code under test (tests/test_verify.py checks that signer on its own). The
module imports nothing from ``gateway`` so that the benchmarks can import it too.
tests/test_signing.py checks it against the senders' published vectors.

``*_signature`` functions return one header value; ``*_headers`` functions return
the headers of a whole delivery: ``Content-Type`` first (``content_type=None``
leaves it out), the sender's own headers, then ``extra`` (whose names usually hold
a ``-``, so pass them as ``**{"User-Agent": ...}``; one spelled like a built header
replaces it). Secrets are ``str`` (UTF-8 encoded) or ``bytes``; timestamps are Unix
seconds, taken from the clock when left out.
"""

from __future__ import annotations

import base64
import hmac
import secrets
import time
import uuid

__all__ = [
    "github_headers",
    "github_signature",
    "hmac_hex",
    "shopify_headers",
    "shopify_signature",
    "slack_headers",
    "slack_signature",
    "standard_headers",
    "standard_signature",
    "stripe_headers",
    "stripe_signature",
]

Secret = str | bytes

JSON = "application/json"


def _key(secret: Secret) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def _digest(secret: Secret, message: bytes, algorithm: str = "sha256") -> bytes:
    return hmac.new(_key(secret), message, algorithm).digest()


def _seconds(timestamp: float | None) -> str:
    # Senders send whole seconds; the text is what they sign.
    return str(int(time.time() if timestamp is None else timestamp))


def _headers(
    content_type: str | None, own: dict[str, str], extra: dict[str, str]
) -> dict[str, str]:
    return {**({"Content-Type": content_type} if content_type else {}), **own, **extra}


def hmac_hex(secret: Secret, message: bytes, *, algorithm: str = "sha256") -> str:
    """The hex HMAC of ``message``: for a scheme configured as ``hmac`` in a test."""
    return _digest(secret, message, algorithm).hex()


# --------------------------------------------------------------------------- GitHub


def github_signature(secret: Secret, body: bytes, *, algorithm: str = "sha256") -> str:
    """``X-Hub-Signature-256``'s value, ``sha256=<hex HMAC of the body>``; with
    ``algorithm="sha1"``, the legacy ``X-Hub-Signature``'s (docs.github.com,
    "Validating webhook deliveries")."""
    return f"{algorithm}={hmac_hex(secret, body, algorithm=algorithm)}"


def github_headers(
    body: bytes,
    secret: Secret,
    *,
    event: str = "push",
    delivery: str | None = None,
    content_type: str | None = JSON,
    **extra: str,
) -> dict[str, str]:
    """A GitHub delivery's headers; ``delivery`` (``X-GitHub-Delivery``) is a fresh
    UUID when left out, as every GitHub delivery has one."""
    own = {
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": str(uuid.uuid4()) if delivery is None else delivery,
        "X-Hub-Signature-256": github_signature(secret, body),
    }
    return _headers(content_type, own, extra)


# --------------------------------------------------------------------------- Stripe


def stripe_signature(secret: Secret, body: bytes, timestamp: int | str) -> str:
    """The ``v1`` of ``Stripe-Signature``: the hex HMAC-SHA256 of ``<timestamp>.<body>``,
    the timestamp's text exactly as the header carries it (Stripe, "Verify webhook
    signatures manually"). The secret is used as it is, ``whsec_`` and all."""
    return hmac_hex(secret, f"{timestamp}.".encode() + body)


def stripe_headers(
    body: bytes,
    secret: Secret,
    *,
    timestamp: float | None = None,
    content_type: str | None = "application/json; charset=utf-8",
    **extra: str,
) -> dict[str, str]:
    """A Stripe delivery's headers: ``Stripe-Signature: t=<timestamp>,v1=<signature>``."""
    t = _seconds(timestamp)
    own = {"Stripe-Signature": f"t={t},v1={stripe_signature(secret, body, t)}"}
    return _headers(content_type, own, extra)


# --------------------------------------------------------------------------- Standard Webhooks


def standard_signature(secret: str, body: bytes, msg_id: str, timestamp: int | str) -> str:
    """``webhook-signature``'s value, ``v1,<base64 HMAC-SHA256 of <id>.<timestamp>.<body>>``,
    keyed with the base64 after ``whsec_`` (standardwebhooks.com, the specification)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    message = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(_digest(key, message)).decode()


def standard_headers(
    body: bytes,
    secret: str,
    *,
    msg_id: str | None = None,
    timestamp: float | None = None,
    content_type: str | None = JSON,
    **extra: str,
) -> dict[str, str]:
    """A Standard Webhooks delivery's ``webhook-id``, ``-timestamp`` and ``-signature``;
    ``msg_id`` is a fresh ``msg_<24 hex>`` when left out."""
    msg_id = f"msg_{secrets.token_hex(12)}" if msg_id is None else msg_id
    t = _seconds(timestamp)
    own = {
        "webhook-id": msg_id,
        "webhook-timestamp": t,
        "webhook-signature": standard_signature(secret, body, msg_id, t),
    }
    return _headers(content_type, own, extra)


# --------------------------------------------------------------------------- Slack, Shopify


def slack_signature(secret: Secret, body: bytes, timestamp: int | str) -> str:
    """``X-Slack-Signature``'s value, ``v0=<hex HMAC-SHA256 of v0:<timestamp>:<body>>``
    (api.slack.com, "Verifying requests from Slack")."""
    return "v0=" + hmac_hex(secret, f"v0:{timestamp}:".encode() + body)


def slack_headers(
    body: bytes,
    secret: Secret,
    *,
    timestamp: float | None = None,
    content_type: str | None = "application/x-www-form-urlencoded",
    **extra: str,
) -> dict[str, str]:
    """A Slack request's signature and ``X-Slack-Request-Timestamp``; the content type
    defaults to a slash command's."""
    t = _seconds(timestamp)
    own = {"X-Slack-Signature": slack_signature(secret, body, t), "X-Slack-Request-Timestamp": t}
    return _headers(content_type, own, extra)


def shopify_signature(secret: Secret, body: bytes) -> str:
    """``X-Shopify-Hmac-Sha256``'s value: the base64 HMAC-SHA256 of the body (Shopify,
    "Verify webhook deliveries")."""
    return base64.b64encode(_digest(secret, body)).decode()


def shopify_headers(
    body: bytes, secret: Secret, *, content_type: str | None = JSON, **extra: str
) -> dict[str, str]:
    """A Shopify delivery's ``X-Shopify-Hmac-Sha256`` (its topic and ids go in ``extra``)."""
    own = {"X-Shopify-Hmac-Sha256": shopify_signature(secret, body)}
    return _headers(content_type, own, extra)
