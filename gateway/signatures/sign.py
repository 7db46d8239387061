"""Signing a body as each scheme's sender would: the headers it adds, with the
spec's first secret, for tests, the benchmark, dry runs and the runners' requests.

The caller passes the current time, so that tests can pin it.
"""

from __future__ import annotations

import base64
import hmac
from secrets import token_hex

from gateway.signatures import twilio
from gateway.signatures.ed25519 import is_asymmetric, sign_v1a
from gateway.signatures.schemes import (
    GITHUB_HEADER,
    GITHUB_PREFIX,
    HMAC_SCHEMES,
    STD_ID,
    STD_SIGNATURE,
    STD_TIMESTAMP,
    STRIPE_HEADER,
    header_bytes,
)
from gateway.signatures.spec import VerifySpec, encode_digest

__all__ = ["sign"]


def sign(
    spec: VerifySpec, body: bytes, now: float, *, event_id: str | None = None
) -> dict[str, str]:
    """Headers a real sender would add to ``body``, signed with the first secret.

    Used by tests, the benchmark and ``realm triggers test --sign``.
    ``event_id`` sets ``webhook-id`` for the standard scheme (else a random
    ``msg_<hex>``); other schemes carry no signed event id.
    """
    if spec.scheme in ("none", "discord", "sns"):
        # discord and sns triggers hold public keys only (the application's key, AWS's
        # certificate): nothing to sign with. Tests sign with the private keys
        # (ed25519.discord_headers, sns.sign_message).
        return {}
    if spec.scheme == "standard" and is_asymmetric(spec.secrets[0]):
        # v1a: Ed25519 with a whsk_ key; a whpk_ one is public and cannot sign.
        msg_id = event_id if event_id is not None else f"msg_{token_hex(12)}"
        t = str(int(now))
        entry = sign_v1a(spec.secrets[0], header_bytes(msg_id) + b"." + t.encode() + b"." + body)
        return {} if entry is None else {STD_ID: msg_id, STD_TIMESTAMP: t, STD_SIGNATURE: entry}
    key = spec.keys[0]
    if spec.scheme == "github":
        return {GITHUB_HEADER: GITHUB_PREFIX + hmac.digest(key, body, "sha256").hex()}
    if spec.scheme == "stripe":
        t = str(int(now))
        sig = hmac.digest(key, t.encode() + b"." + body, "sha256").hex()
        return {STRIPE_HEADER: f"t={t},v1={sig}"}
    if spec.scheme == "standard":
        msg_id = event_id if event_id is not None else f"msg_{token_hex(12)}"
        t = str(int(now))
        message = header_bytes(msg_id) + b"." + t.encode() + b"." + body
        sig = base64.b64encode(hmac.digest(key, message, "sha256")).decode()
        return {STD_ID: msg_id, STD_TIMESTAMP: t, STD_SIGNATURE: f"v1,{sig}"}
    if spec.scheme == "paddle":
        t = str(int(now))
        sig = hmac.digest(key, t.encode() + b":" + body, "sha256").hex()
        return {spec.header or "": f"ts={t};h1={sig}"}
    if spec.scheme == "twilio":
        # Twilio posts most webhooks as a form and JSON ones with a bodySHA256 in the
        # URL; the body's first character tells which this is (a body that is not
        # UTF-8 form encoding goes the JSON way), and the Content-Type sent with it
        # is what verify() goes by.
        form = body.lstrip()[:1] not in (b"{", b"[")
        try:
            message = twilio.signed_strings(spec.urls[:1], form, body)[0]
        except ValueError:
            form = False
            message = twilio.signed_strings(spec.urls[:1], form, body)[0]
        return {
            "Content-Type": twilio.FORM if form else "application/json",
            spec.header or "": base64.b64encode(hmac.digest(key, message, "sha1")).decode(),
        }
    if spec.scheme in HMAC_SCHEMES:
        # linear too: its timestamp is the body's own webhookTimestamp, which the
        # caller's body must carry for the delivery to verify.
        t = str(int(now))
        encoded = encode_digest(spec, key, body, t.encode()).decode()
        headers = {spec.header or "": spec.prefix + encoded}
        if spec.timestamp_header:
            headers[spec.timestamp_header] = t
        return headers
    # token and gitlab: the sender puts the shared token itself in the header.
    return {spec.header or "": spec.secrets[0]}
