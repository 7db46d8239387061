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

from gateway.signatures.schemes import (
    GITHUB_HEADER,
    GITHUB_PREFIX,
    GITHUB_SHA1_HEADER,
    STD_ALIASES,
    STRIPE_HEADER,
    header_bytes,
)
from gateway.signatures.spec import VerifySpec, encode_digest

__all__ = ["HeaderLookup", "verify"]

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


def verify(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> str | None:
    """Return None when the delivery is authentic, else a short reason.

    The reason names headers and the rule that failed, never a secret or a
    signature value, so it can be logged and returned to the sender.
    """
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
    value = _single(headers, _STRIPE_KEY, STRIPE_HEADER)
    timestamp_text: str | None = None
    candidates: list[bytes] = []
    for item in value.split(","):
        name, sep, part = item.strip().partition("=")
        if not sep:
            raise _Reject(f"malformed header {STRIPE_HEADER}")
        if name == "t":
            if timestamp_text is not None:
                raise _Reject(f"malformed header {STRIPE_HEADER}")
            timestamp_text = part
        elif name == "v1":
            candidates.append(header_bytes(part.lower()))
        # v0 and unknown schemes are ignored, as Stripe's own libraries do.
    if timestamp_text is None or (timestamp := _digits(timestamp_text)) is None:
        raise _Reject(f"malformed header {STRIPE_HEADER}")
    if not candidates:
        raise _Reject(f"no v1 signature in {STRIPE_HEADER}")
    # The time check is cheap and needs no key, so it runs before any HMAC.
    _check_time(timestamp, now, spec.tolerance)
    # Stripe signs the timestamp text exactly as it appears in the header.
    message = timestamp_text.encode("ascii") + b"." + body
    for key in spec.keys:
        # Computed per key and stopped at the first match: with rotation the
        # current secret is listed first, so the common case costs one HMAC.
        if _any_match(candidates, hmac.digest(key, message, "sha256").hex().encode()):
            return None
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
    for entry in signature.split():
        version, sep, sig = entry.partition(",")
        # v1a entries are ed25519 (asymmetric) signatures, which a shared
        # secret cannot check; they are skipped, not treated as failures.
        if sep and version == "v1":
            candidates.append(header_bytes(sig))
    if not candidates:
        raise _Reject(f"no v1 signature in {signature_label}")
    _check_time(timestamp, now, spec.tolerance)
    message = header_bytes(msg_id) + b"." + header_bytes(timestamp_text) + b"." + body
    for key in spec.keys:
        if _any_match(candidates, base64.b64encode(hmac.digest(key, message, "sha256"))):
            return None
    raise _Reject("signature mismatch")


def _verify_hmac(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`hmac`, `slack` and `shopify`: one signature header, maybe a timestamp header."""
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
}
