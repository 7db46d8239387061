"""What each signature scheme is: its name, the values a preset fixes, the header
names and prefixes its sender uses, and how its secrets and header values turn into bytes.

``slack``, ``shopify``, ``gitlab``, ``zoom``, ``meta``, ``linear``, ``square``,
``twitter``, ``paddle`` and ``twilio`` are presets: a fixed configuration under the
sender's name (most of them an ``hmac`` one), so a trigger cannot get one of its
header names, encodings or signed strings wrong.
"""

from __future__ import annotations

import base64
import binascii
from typing import Literal, get_args

__all__ = [
    "ALGORITHMS",
    "DEFAULT_TOLERANCE",
    "ENCODINGS",
    "GITHUB_HEADER",
    "GITHUB_PREFIX",
    "GITHUB_SHA1_HEADER",
    "HMAC_SCHEMES",
    "PLACEHOLDER_SECRET",
    "PRESETS",
    "SCHEMES",
    "STD_ALIASES",
    "STD_ID",
    "STD_SIGNATURE",
    "STD_TIMESTAMP",
    "STRIPE_HEADER",
    "TOLERANCES",
    "URL_SCHEMES",
    "WHSEC",
    "Algorithm",
    "Encoding",
    "Scheme",
    "header_bytes",
    "is_header_name",
    "standard_key",
]

Scheme = Literal[
    "github",
    "stripe",
    "standard",
    "hmac",
    "token",
    "none",
    "slack",
    "shopify",
    "gitlab",
    "zoom",
    "meta",
    "paddle",
    "linear",
    "square",
    "twilio",
    "twitter",
    "discord",  # Ed25519 (gateway/signatures/ed25519.py)
    "sns",  # RSA with a fetched certificate (gateway/signatures/sns.py)
]
Algorithm = Literal["sha256", "sha1", "sha512"]
Encoding = Literal["hex", "base64"]

SCHEMES: tuple[str, ...] = get_args(Scheme)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
ENCODINGS: tuple[str, ...] = get_args(Encoding)

DEFAULT_TOLERANCE = 300

# What every secret holds when a file is checked without its environment (`realm
# triggers check --no-secrets`): a whsec_ secret, so a standard trigger parses; a
# discord trigger's key is left out for it, so nothing it verifies passes.
PLACEHOLDER_SECRET = "whsec_cGxhY2Vob2xkZXI="

# Schemes checked as an HMAC of a signed payload built from the body (and a
# timestamp): `hmac` as configured, the presets as their senders document them.
HMAC_SCHEMES = ("hmac", "slack", "shopify", "zoom", "meta", "linear", "square", "twitter")

# Schemes whose signed string starts with a URL the sender posts to, which the
# request does not carry in a form verify() sees: the trigger's `verify.url`.
URL_SCHEMES = ("square", "twilio")

# A timestamp's tolerance where the sender documents another than DEFAULT_TOLERANCE:
# Linear, "Securing webhooks": "verify the webhookTimestamp is within a minute".
TOLERANCES: dict[str, int] = {"linear": 60}

# What each preset fixes, from the senders' documentation: Slack, "Verifying
# requests from Slack" (HMAC-SHA256 of `v0:<timestamp>:<body>`, hex, `v0=`, five
# minutes); Shopify, "Verify webhook deliveries" (HMAC-SHA256 of the raw body,
# base64); GitLab, "Webhooks" (the secret token itself in X-Gitlab-Token).
PRESETS: dict[str, dict[str, str | None]] = {
    # Discord, "Receiving and responding": Ed25519 of `<X-Signature-Timestamp><body>`,
    # hex, with the application's public key (gateway/signatures/ed25519.py).
    "discord": {"header": "X-Signature-Ed25519", "timestamp_header": "X-Signature-Timestamp"},
    "slack": {
        "header": "X-Slack-Signature",
        "algorithm": "sha256",
        "encoding": "hex",
        "prefix": "v0=",
        "timestamp_header": "X-Slack-Request-Timestamp",
        "signed_payload": "v0:{timestamp}:{body}",
    },
    "shopify": {
        "header": "X-Shopify-Hmac-Sha256",
        "algorithm": "sha256",
        "encoding": "base64",
        "prefix": "",
        "timestamp_header": None,
        "signed_payload": "{body}",
    },
    "gitlab": {"header": "X-Gitlab-Token"},
    # Zoom, "Verify webhook events": Slack's construction under Zoom's names.
    "zoom": {
        "header": "x-zm-signature",
        "algorithm": "sha256",
        "encoding": "hex",
        "prefix": "v0=",
        "timestamp_header": "x-zm-request-timestamp",
        "signed_payload": "v0:{timestamp}:{body}",
    },
    # Meta (Facebook, WhatsApp, Instagram, Messenger), Webhooks "Event notifications":
    # GitHub's header; Meta's GET subscription check uses a separate verify token.
    "meta": {
        "header": "X-Hub-Signature-256",
        "algorithm": "sha256",
        "encoding": "hex",
        "prefix": "sha256=",
        "timestamp_header": None,
        "signed_payload": "{body}",
    },
    # Linear, "Securing webhooks": the body's HMAC, hex, no prefix; the timestamp
    # travels in the signed body (`webhookTimestamp`, ms), checked by verify().
    "linear": {
        "header": "Linear-Signature",
        "algorithm": "sha256",
        "encoding": "hex",
        "prefix": "",
        "timestamp_header": None,
        "signed_payload": "{body}",
    },
    # Square, "Validate notifications": HMAC-SHA256 of the notification URL followed
    # by the body, base64; the URL is the trigger's `verify.url` (see VerifySpec).
    "square": {
        "header": "x-square-hmacsha256-signature",
        "algorithm": "sha256",
        "encoding": "base64",
        "prefix": "",
        "timestamp_header": None,
    },
    # X (Twitter) Account Activity API, "Securing webhooks": the body's HMAC-SHA256
    # keyed with the consumer secret, base64, after `sha256=`.
    "twitter": {
        "header": "x-twitter-webhooks-signature",
        "algorithm": "sha256",
        "encoding": "base64",
        "prefix": "sha256=",
        "timestamp_header": None,
        "signed_payload": "{body}",
    },
    # Paddle Billing, "Verify webhook signatures": `ts=<unix>;h1=<hex>` in one header,
    # HMAC-SHA256 of `<ts>:<body>` (verify.py parses it, as for Stripe).
    "paddle": {"header": "Paddle-Signature"},
    # Twilio, "Webhooks security": base64 HMAC-SHA1 of the URL and the sorted form
    # fields (gateway/signatures/twilio.py builds that string).
    "twilio": {"header": "X-Twilio-Signature", "algorithm": "sha1", "encoding": "base64"},
}

# Header names as the senders spell them (in messages and in what ``sign`` sends;
# ``verify`` looks them up lower-cased).
GITHUB_HEADER = "X-Hub-Signature-256"
GITHUB_SHA1_HEADER = "X-Hub-Signature"
GITHUB_PREFIX = "sha256="
STRIPE_HEADER = "Stripe-Signature"
STD_ID = "webhook-id"
STD_TIMESTAMP = "webhook-timestamp"
STD_SIGNATURE = "webhook-signature"
# Svix sends Standard Webhooks under its own names (the same headers with a
# `svix-` prefix, unless a customer has them renamed to `webhook-`).
STD_ALIASES = (
    (STD_ID, "svix-id"),
    (STD_TIMESTAMP, "svix-timestamp"),
    (STD_SIGNATURE, "svix-signature"),
)
WHSEC = "whsec_"


def standard_key(secret: str) -> bytes | None:
    """Decode a Standard Webhooks secret, or None when it is not one.

    Like the reference libraries, the ``whsec_`` prefix is optional.
    """
    encoded = secret.removeprefix(WHSEC)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None
    return key or None


def header_bytes(value: str) -> bytes:
    """The bytes a header value (or a value signed with one) was sent as."""
    # Starlette decodes header bytes as latin-1, so encoding back as latin-1
    # recovers exactly what the sender signed; other mappings may hold wider text.
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


# RFC 9110 token characters: what a header field name may contain.
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def is_header_name(name: object) -> bool:
    """True for a non-empty string of RFC 9110 token characters (a header field name,
    in a ``verify:`` block or a trigger's ``header:``)."""
    return isinstance(name, str) and bool(name) and all(c in _TCHARS for c in name)
