"""Verifying a delivery: each scheme's check of its headers and body against a
``VerifySpec``, and the short reason when one fails.

Pure code: no I/O, no clock, no logging. The caller passes the current time, so
that tests can pin it. A reason names headers and the rule that failed, never a
secret or a signature value.
"""

from __future__ import annotations

import base64
import hmac
from typing import Protocol

import orjson

from gateway.signatures import twilio
from gateway.signatures.ed25519 import MAX_SIGNATURES, any_valid, from_base64, from_hex
from gateway.signatures.schemes import (
    GITHUB_HEADER,
    GITHUB_PREFIX,
    GITHUB_SHA1_HEADER,
    STD_ALIASES,
    STRIPE_HEADER,
    header_bytes,
)
from gateway.signatures.sns import Certificates, verify_body
from gateway.signatures.spec import VerifySpec, encode_digest

__all__ = ["HeaderLookup", "crc_response", "verify"]

# Header names are looked up lower-cased (Starlette's Headers are case-insensitive,
# but lower-casing once here keeps other mappings working too).
_GITHUB_KEY = GITHUB_HEADER.lower()
_GITHUB_SHA1_KEY = GITHUB_SHA1_HEADER.lower()
_STRIPE_KEY = STRIPE_HEADER.lower()


class HeaderLookup(Protocol):
    """What ``verify`` needs from request headers (``starlette.datastructures.Headers``).

    Values are decoded as latin-1 (one character per byte, as Starlette does), so
    ``header_bytes`` turns them back into exactly the bytes the sender signed.
    """

    def getlist(self, key: str) -> list[str]: ...


class _Reject(Exception):
    """Internal: carries a rejection reason out of nested helpers."""


def _single(headers: HeaderLookup, key: str, label: str) -> str:
    return _only(headers.getlist(key), label)


def _only(values: list[str], label: str) -> str:
    if not values:
        raise _Reject(f"missing header {label}")
    if len(values) > 1:
        # Two signature headers mean a proxy or attacker added one; choosing
        # either would be a guess, so the delivery is refused.
        raise _Reject(f"header {label} repeated")
    # A field value's leading and trailing spaces and tabs are not part of it
    # (RFC 9110 5.5): a sender or proxy that adds them signed the value without.
    value = values[0].strip(" \t")
    if not value.strip():
        raise _Reject(f"empty header {label}")
    return value


# Digits a Unix timestamp in seconds may have: 13 reach past the year 300 000.
# Anything longer is refused before int(), which raises ValueError past 4 300
# digits (CPython's limit against quadratic conversions) and costs CPU before that.
_MAX_TIMESTAMP_DIGITS = 13


def _digits(value: str) -> int | None:
    # int() also accepts " 12", "+12", "1_2" and non-ASCII digits; a signed
    # timestamp is plain ASCII digits and nothing else.
    if len(value) > _MAX_TIMESTAMP_DIGITS or not (value.isascii() and value.isdigit()):
        return None
    return int(value)


def _check_time(timestamp: int, now: float, tolerance: int) -> None:
    # Symmetric window: a timestamp far in the future is as suspect as an old one.
    if abs(now - timestamp) > tolerance:
        raise _Reject(f"timestamp outside tolerance ({tolerance} s)")


def _any_match(candidates: list[bytes], expected: bytes) -> bool:
    # Every candidate is compared in constant time; the loop may stop at a match
    # because which entry matched is not secret (the sender chose the order).
    return any(hmac.compare_digest(c, expected) for c in candidates)


def verify(
    spec: VerifySpec,
    headers: HeaderLookup,
    body: bytes,
    now: float,
    certificates: Certificates | None = None,
) -> str | None:
    """Return None when the delivery is authentic, else a short reason.

    The reason names headers and the rule that failed, never a secret or a
    signature value, so it can be logged and returned to the sender.
    ``certificates``: scheme ``sns`` only (other schemes ignore it), the signing
    certificates gateway/ingest/sns_certs.py fetched for this delivery; a message
    whose certificate it lacks is refused, never fetched from here.
    """
    if spec.scheme == "sns" and spec.sns is not None:
        # The signature is in the JSON body (gateway/signatures/sns.py).
        return verify_body(spec.sns, body, certificates or {}, now)
    try:
        return _VERIFIERS[spec.scheme](spec, headers, body, now)
    except _Reject as reject:
        return str(reject)


def _verify_github(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    values = headers.getlist(_GITHUB_KEY)
    if not values and headers.getlist(_GITHUB_SHA1_KEY):
        # The legacy SHA-1 header alone is refused: SHA-1 is weaker and GitHub
        # always sends the SHA-256 header alongside it.
        raise _Reject(f"missing header {GITHUB_HEADER} ({GITHUB_SHA1_HEADER} is not accepted)")
    value = _only(values, GITHUB_HEADER)
    if not value.startswith(GITHUB_PREFIX):
        raise _Reject(f"header {GITHUB_HEADER} lacks prefix {GITHUB_PREFIX!r}")
    candidate = header_bytes(value[len(GITHUB_PREFIX) :].lower())
    for key in spec.keys:
        if hmac.compare_digest(candidate, hmac.digest(key, body, "sha256").hex().encode()):
            return None
    raise _Reject("signature mismatch")


def _verify_stripe(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    # v0 and unknown schemes are ignored, as Stripe's own libraries do.
    value = _single(headers, _STRIPE_KEY, STRIPE_HEADER)
    _timestamped_hmac(spec, value, STRIPE_HEADER, now, body, items=",", stamp="t",
                      signature="v1", joint=b".")  # fmt: skip


def _timestamped_hmac(
    spec: VerifySpec,
    value: str,
    label: str,
    now: float,
    body: bytes,
    *,
    items: str,
    stamp: str,
    signature: str,
    joint: bytes,
) -> None:
    """Stripe's and Paddle's header: ``<stamp>=<unix>`` and one or more
    ``<signature>=<hex>`` items (one per secret while one rotates), separated by
    ``items``; each an HMAC-SHA256 of the timestamp text, ``joint`` and the body.
    Other names are ignored, as the senders' libraries do: a later scheme may add some."""
    timestamp_text: str | None = None
    candidates: list[bytes] = []
    for item in value.split(items):
        name, sep, part = item.strip().partition("=")
        if not sep:
            raise _Reject(f"malformed header {label}")
        if name == stamp:
            if timestamp_text is not None:
                raise _Reject(f"malformed header {label}")
            timestamp_text = part
        elif name == signature:
            candidates.append(header_bytes(part.lower()))
    if timestamp_text is None or (timestamp := _digits(timestamp_text)) is None:
        raise _Reject(f"malformed header {label}")
    if not candidates:
        raise _Reject(f"no {signature} signature in {label}")
    # The time check is cheap and needs no key, so it runs before any HMAC.
    _check_time(timestamp, now, spec.tolerance)
    # The sender signs the timestamp text exactly as it appears in the header.
    message = timestamp_text.encode("ascii") + joint + body
    for key in spec.keys:
        # Computed per key and stopped at the first match: with rotation the
        # current secret is listed first, so the common case costs one HMAC.
        if _any_match(candidates, hmac.digest(key, message, "sha256").hex().encode()):
            return
    raise _Reject("signature mismatch")


def _standard_headers(headers: HeaderLookup) -> list[tuple[str, str]]:
    """The id, timestamp and signature (each with the name it came under), sent under
    the `webhook-` names or Svix's `svix-` ones.

    Each pair is one header under two names. A value sent under both must be the
    same: otherwise a trigger reading its event id from the name that was not
    verified (an added `webhook-id` beside a signed `svix-id`) would take an id
    nobody signed, and a replay could start new work under it.
    """
    found = [(headers.getlist(std), headers.getlist(svix)) for std, svix in STD_ALIASES]
    # A sender that uses the svix- names alone is told about those in messages.
    svix_only = any(s for _, s in found) and not any(w for w, _ in found)
    found_fields: list[tuple[str, str]] = []
    for (std, svix), (std_values, svix_values) in zip(STD_ALIASES, found, strict=True):
        if std_values and svix_values:
            value = _only(std_values, std)
            if _only(svix_values, svix) != value:
                raise _Reject(f"headers {std} and {svix} differ")
            found_fields.append((value, std))
        elif svix_values:
            found_fields.append((_only(svix_values, svix), svix))
        else:
            label = svix if svix_only else std
            found_fields.append((_only(std_values, label), label))
    return found_fields


def _verify_standard(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    (msg_id, _), (timestamp_text, timestamp_label), (signature, signature_label) = (
        _standard_headers(headers)
    )
    timestamp = _digits(timestamp_text)
    if timestamp is None:
        raise _Reject(f"malformed header {timestamp_label}")
    candidates: list[bytes] = []
    asymmetric: list[bytes] = []
    for entry in signature.split():
        version, sep, sig = entry.partition(",")
        # v1 entries are HMACs, checked with the whsec_ secrets; v1a entries are
        # Ed25519 signatures, checked with the whpk_/whsk_ keys (ed25519.py). An entry
        # no key of the spec can check is skipped, not treated as a failure.
        if sep and version == "v1" and spec.keys:
            candidates.append(header_bytes(sig))
        elif sep and version == "v1a" and spec.public_keys:
            asymmetric.append(header_bytes(sig))
    if not candidates and not asymmetric:
        wanted = [v for v, keys in (("v1", spec.keys), ("v1a", spec.public_keys)) if keys]
        raise _Reject(f"no {' or '.join(wanted)} signature in {signature_label}")
    if len(asymmetric) > MAX_SIGNATURES:
        # Each costs an Ed25519 check: a header of hundreds would be a CPU sink.
        raise _Reject(f"more than {MAX_SIGNATURES} v1a signatures in {signature_label}")
    _check_time(timestamp, now, spec.tolerance)
    message = header_bytes(msg_id) + b"." + header_bytes(timestamp_text) + b"." + body
    for key in spec.keys:
        if _any_match(candidates, base64.b64encode(hmac.digest(key, message, "sha256"))):
            return None
    signed = [raw for raw in map(from_base64, asymmetric) if raw is not None]
    if signed and any_valid(spec.public_keys, signed, message):
        return None
    raise _Reject("signature mismatch")


def _verify_hmac(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`hmac` and its presets (`slack`, `shopify`, `zoom`, `meta`, `linear`, `square`,
    `twitter`): one signature header, maybe a timestamp header."""
    label = spec.header or ""
    value = _single(headers, spec.header_key, label)
    if not value.startswith(spec.prefix):
        raise _Reject(f"header {label} lacks prefix {spec.prefix!r}")
    text = value[len(spec.prefix) :]
    if spec.encoding == "hex":
        # Hex case carries no information; senders differ, so compare lower-case.
        text = text.lower()
    candidate = header_bytes(text)
    timestamp = b""
    if spec.timestamp_header:
        timestamp_text = _single(headers, spec.timestamp_key, spec.timestamp_header)
        seconds = _digits(timestamp_text)
        if seconds is None:
            raise _Reject(f"malformed header {spec.timestamp_header}")
        # Cheap and keyless, so before any HMAC (as for stripe).
        _check_time(seconds, now, spec.tolerance)
        timestamp = timestamp_text.encode("ascii")
    for key in spec.keys:
        if hmac.compare_digest(candidate, encode_digest(spec, key, body, timestamp)):
            return None
    raise _Reject("signature mismatch")


def _verify_linear(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`linear`: the body's HMAC, then the signed body's `webhookTimestamp` (Unix ms)
    within `tolerance` (Linear: "within a minute"). The body is parsed only once its
    signature verified, so a forger's JSON is never parsed."""
    _verify_hmac(spec, headers, body, now)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    stamp = data.get("webhookTimestamp") if isinstance(data, dict) else None
    # Linear sends every event with it; a body without one could be replayed for
    # ever, so it is refused rather than let through unchecked.
    if isinstance(stamp, bool) or not isinstance(stamp, int):
        raise _Reject("no webhookTimestamp (Unix ms) in the body")
    if abs(now * 1000 - stamp) > spec.tolerance * 1000:
        raise _Reject(f"webhookTimestamp outside tolerance ({spec.tolerance} s)")


def _verify_paddle(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`paddle`: `Paddle-Signature: ts=<unix>;h1=<hex>[;h1=<hex>]` (one h1 per secret
    while Paddle rotates one), HMAC-SHA256 of `<ts>:<body>`."""
    label = spec.header or ""
    value = _single(headers, spec.header_key, label)
    _timestamped_hmac(spec, value, label, now, body, items=";", stamp="ts", signature="h1",
                      joint=b":")  # fmt: skip


# Twilio's shared-key signing (Webhook Settings) names its algorithm in this header;
# without it the signature is the Auth Token's HMAC-SHA1.
_TWILIO_SETTINGS = "X-Twilio-Webhooks-Signature-Settings"
_TWILIO_ALGORITHMS = {"HMAC_SHA1": "sha1", "HMAC_SHA256": "sha256"}


def _verify_twilio(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`twilio`: base64 HMAC of the configured URL and the form fields, or of the URL
    with the body's SHA-256 (gateway/signatures/twilio.py)."""
    label = spec.header or ""
    candidate = header_bytes(_single(headers, spec.header_key, label))
    algorithm = "sha1"
    settings = headers.getlist(_TWILIO_SETTINGS.lower())
    if settings:
        named = "HMAC_SHA1"
        for part in _only(settings, _TWILIO_SETTINGS).split(","):
            name, sep, text = part.partition("=")
            if sep and name.strip() == "algorithm" and text.strip():
                named = text.strip().upper()
        if named not in _TWILIO_ALGORITHMS:
            raise _Reject(f"unsupported algorithm in header {_TWILIO_SETTINGS}")
        algorithm = _TWILIO_ALGORITHMS[named]
    types = headers.getlist("content-type")
    if len(types) > 1:
        # The content type decides what was signed: two of them leave that a guess.
        raise _Reject("header Content-Type repeated")
    form = bool(types) and twilio.is_form(types[0])
    try:
        messages = twilio.signed_strings(spec.urls, form, body)
    except ValueError:
        raise _Reject("malformed form body (not UTF-8 form encoding)") from None
    for key in spec.keys:
        expected = [base64.b64encode(hmac.digest(key, m, algorithm)) for m in messages]
        if _any_match(expected, candidate):
            return None
    raise _Reject("signature mismatch")


def crc_response(spec: VerifySpec, crc_token: str) -> str:
    """The `response_token` of X's (Twitter's) CRC check, a GET with `crc_token`:
    `sha256=` and the base64 HMAC-SHA256 of the token, keyed with the consumer secret
    (the first of `secret_env`, the current one while secrets rotate)."""
    if spec.scheme != "twitter":
        raise ValueError(f"scheme {spec.scheme} has no CRC check")
    digest = hmac.digest(spec.keys[0], crc_token.encode("utf-8"), "sha256")
    return "sha256=" + base64.b64encode(digest).decode("ascii")


def _verify_token(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`token` and `gitlab`: the header holds the shared token itself."""
    label = spec.header or ""
    candidate = header_bytes(_single(headers, spec.header_key, label))
    # Compare against every secret, without stopping at a match, so the timing
    # does not reveal which rotation slot (if any) matched.
    matched = False
    for key in spec.keys:
        matched |= hmac.compare_digest(candidate, key)
    if matched:
        return None
    raise _Reject("token mismatch")


def _verify_none(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    return None


def _verify_discord(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`discord`: Ed25519 (hex) of the timestamp header's text followed by the body,
    with the application's public key (gateway/signatures/ed25519.py)."""
    signature = _single(headers, spec.header_key, spec.header or "")
    timestamp_text = _single(headers, spec.timestamp_key, spec.timestamp_header or "")
    timestamp = _digits(timestamp_text)
    if timestamp is None:
        raise _Reject(f"malformed header {spec.timestamp_header}")
    # Cheap and keyless, so before the signature (as for stripe).
    _check_time(timestamp, now, spec.tolerance)
    raw = from_hex(signature)
    if raw is None:
        raise _Reject(f"malformed header {spec.header}")
    if not any_valid(spec.public_keys, [raw], timestamp_text.encode("ascii") + body):
        raise _Reject("signature mismatch")


_VERIFIERS = {
    "github": _verify_github,
    "stripe": _verify_stripe,
    "standard": _verify_standard,
    "hmac": _verify_hmac,
    "token": _verify_token,
    "none": _verify_none,
    "slack": _verify_hmac,
    "shopify": _verify_hmac,
    "gitlab": _verify_token,
    "zoom": _verify_hmac,
    "meta": _verify_hmac,
    "paddle": _verify_paddle,
    "linear": _verify_linear,
    "square": _verify_hmac,
    "twilio": _verify_twilio,
    "twitter": _verify_hmac,
    "discord": _verify_discord,
}
