"""What each signature scheme is: its name, the values a preset fixes, the header
names and prefixes its sender uses, and how its secrets and header values turn into bytes.

``slack``, ``shopify`` and ``gitlab`` are presets: a fixed ``hmac`` or ``token``
configuration under the sender's name, so a trigger cannot get one of its
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
    "PRESETS",
    "SCHEMES",
    "STD_ALIASES",
    "STD_ID",
    "STD_SIGNATURE",
    "STD_TIMESTAMP",
    "STRIPE_HEADER",
    "WHSEC",
    "Algorithm",
    "Encoding",
    "Scheme",
    "header_bytes",
    "is_header_name",
    "standard_key",
]

Scheme = Literal[
    "github", "stripe", "standard", "hmac", "token", "none", "slack", "shopify", "gitlab"
]
Algorithm = Literal["sha256", "sha1", "sha512"]
Encoding = Literal["hex", "base64"]

SCHEMES: tuple[str, ...] = get_args(Scheme)
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
ENCODINGS: tuple[str, ...] = get_args(Encoding)

DEFAULT_TOLERANCE = 300

# Schemes checked as an HMAC of a signed payload built from the body (and a
# timestamp): `hmac` as configured, the presets as their senders document them.
HMAC_SCHEMES = ("hmac", "slack", "shopify")

# What each preset fixes, from the senders' documentation: Slack, "Verifying
# requests from Slack" (HMAC-SHA256 of `v0:<timestamp>:<body>`, hex, `v0=`, five
# minutes); Shopify, "Verify webhook deliveries" (HMAC-SHA256 of the raw body,
# base64); GitLab, "Webhooks" (the secret token itself in X-Gitlab-Token).
PRESETS: dict[str, dict[str, str | None]] = {
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
