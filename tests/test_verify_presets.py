"""The `zoom`, `meta`, `paddle`, `linear`, `square`, `twilio` and `twitter` presets
(gateway/signatures/) against their senders' examples: genuine deliveries verify,
tampered ones do not, and no reason shows a secret or a signature. Pure: no Redis.

Where the vectors come from (the tests read nothing outside the repository):

- Paddle: PaddleHQ/paddle-python-sdk, tests/Unit/Notification/test_Verifier.py
  (a header with a dummy `h1` before the real one, the three secrets, the body).
- Square: square/square-python-sdk, tests/integration/test_webhooks_helper.py (both
  valid vectors, and its refusals: another URL, another key, another body).
- Twilio: twilio/twilio-python, tests/unit/test_request_validator.py (the Auth Token,
  URL and parameters of Twilio's "Webhooks security" example, its signature, the
  with-port signatures and the JSON `bodySHA256` vector); and Twilio's own
  ``RequestValidator`` signs further deliveries at test time.
- Zoom, Meta, Linear and X publish no secret, body and signature together. Their
  vectors were computed from the documentation's description (Zoom "Verify webhook
  events", Meta "Webhooks", Linear "Webhooks", X "Securing webhooks") with Python's
  ``hmac``, not with gateway code, and each test computes them again with ``hmac``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml
from multidict import MultiDict  # twilio's dependency (through aiohttp); its SDK reads it
from starlette.datastructures import Headers
from twilio.request_validator import RequestValidator

from gateway.ingest.triggers import parse_triggers
from gateway.model.errors import ConfigError
from gateway.signatures.parse import parse_verify
from gateway.signatures.sign import sign
from gateway.signatures.spec import VerifySpec, describe
from gateway.signatures.verify import crc_response, verify

FILE = "triggers.yaml"
TRIGGERS_DOC = Path(__file__).resolve().parents[1] / "docs" / "triggers.md"
FORM = "application/x-www-form-urlencoded"


def spec_of(raw: dict[str, Any], *secrets: str, env: dict[str, str] | None = None) -> VerifySpec:
    """Parse ``raw`` with its secrets in variables S0, S1, ... (listed in that order)."""
    names = {f"S{i}": s for i, s in enumerate(secrets)}
    return parse_verify(
        {**raw, "secret_env": list(names)}, file=FILE, trigger="x", env={**names, **(env or {})}
    )


def check(
    spec: VerifySpec, headers: dict[str, str] | Headers, body: bytes, now: float
) -> str | None:
    return verify(spec, headers if isinstance(headers, Headers) else Headers(headers), body, now)


def hex_hmac(key: str, message: bytes, algorithm: str = "sha256") -> str:
    return hmac.new(key.encode(), message, algorithm).hexdigest()


def b64_hmac(key: str, message: bytes, algorithm: str = "sha256") -> str:
    return base64.b64encode(hmac.new(key.encode(), message, algorithm).digest()).decode()


# --- Zoom: computed from "Verify webhook events" (v0=<hex HMAC-SHA256 of v0:<ts>:<body>>).
ZOOM_SECRET = "zoom-secret-token"
ZOOM_TS = 1735689600
ZOOM_BODY = (
    b'{"event":"meeting.started","payload":{"account_id":"D8cJuqWVQ623CI4Q8yQK0Q",'
    b'"object":{"uuid":"4444AAAiAAAAAiAiAiiAii==","id":"6962400003","host_id":"z8yAAAAA8bbbQ"}},'
    b'"event_ts":1735689600123}'
)
ZOOM_SIG = "v0=a13fa182331edefa8fcc51087da82ef00fbacf20539c68ac0b7eb7fdb38288a5"
ZOOM_HEADERS = {"x-zm-request-timestamp": str(ZOOM_TS), "x-zm-signature": ZOOM_SIG}

# --- Meta: computed from "Webhooks" (sha256=<hex HMAC-SHA256(app secret, body)>); a
# WhatsApp Cloud API message notification's shape.
META_SECRET = "meta-app-secret"
META_BODY = (
    b'{"object":"whatsapp_business_account","entry":[{"id":"102290129340398","changes":'
    b'[{"value":{"messaging_product":"whatsapp","messages":[{"from":"16315551181",'
    b'"id":"wamid.ABGGFlA5Fpa","timestamp":"1735689600","type":"text",'
    b'"text":{"body":"this is a text message"}}]},"field":"messages"}]}]}'
)
META_SIG = "sha256=23b4d30d31c2c128340afa6b749bb60701cb67c7cb170645352439eb0c6a5c7e"

# --- Paddle: published (paddle-python-sdk's verifier test).
PADDLE_SECRETS = (
    "pdl_ntf_01hbpjmytsa32fhr36nqgc3kgb_TjIG2BXbm83HPXqNfziwe506sBEdqL/4",  # fails
    "pdl_ntf_01hbpjmytsa32fhr36nqgc3kgb_vB/yIOnTOCWIvpBadM5jzBZPHc7OmdSo",  # fails
    "pdl_ntf_01hbpjmytsa32fhr36nqgc3kgb_WvRO0eL4Bj9rgYYIBZY6wZhG4EHy9jzh",  # signed it
)
PADDLE_SECRET = PADDLE_SECRETS[2]
PADDLE_TS = 1696195954
PADDLE_BODY = b"hello-world"
PADDLE_H1 = "d96299976a6eb066f484d7fde011ac56fc32b38fc9940bc419d6e537fdc6ef02"
PADDLE_SIG = f"ts={PADDLE_TS};h1=dummy;h1={PADDLE_H1}"

# --- Linear: computed from "Webhooks" (hex HMAC-SHA256 of the body); the body is the
# documentation's example payload's shape, with its webhookTimestamp.
LINEAR_SECRET = "lin_wh_secret"
LINEAR_MS = 1676056940508
LINEAR_NOW = LINEAR_MS / 1000
LINEAR_BODY = (
    b'{"action":"create","type":"Issue","data":{"id":"2174add1-f7c8-44e3-bbf3-2d60b5ea8bc9",'
    b'"title":"Webhook test"},"url":"https://linear.app/issue/LIN-1778/foo-bar",'
    b'"createdAt":"2023-02-10T19:22:20.508Z","webhookTimestamp":1676056940508,'
    b'"webhookId":"000042e3-d123-4980-b49f-8e140eef9329"}'
)
LINEAR_SIG = "87d818b6034257a1a25941c97a0adfff187b3c1c87ba880aac78d74caa3485ba"

# --- Square: published (square-python-sdk's webhooks helper tests).
SQUARE_KEY = "Ibxx_5AKakO-3qeNVR61Dw"
SQUARE_URL = "https://webhook.site/679a4f3a-dcfa-49ee-bac5-9d0edad886b9"
SQUARE_BODY = (
    b'{"merchant_id":"MLEFBHHSJGVHD","type":"webhooks.test_notification",'
    b'"event_id":"ac3ac95b-f97d-458c-a6e6-18981597e05f",'
    b'"created_at":"2022-07-13T20:30:59.037339943Z",'
    b'"data":{"type":"webhooks","id":"bc368e64-01aa-407e-b46e-3231809b1129"}}'
)
SQUARE_SIG = "GF4YkrJgGBDZ9NIYbNXBnMzqb2HoL4RW/S6vkZ9/2N4="

# --- Twilio: published (twilio-python's request validator tests).
TWILIO_TOKEN = "12345"
TWILIO_URL = "https://mycompany.com/myapp.php?foo=1&bar=2"
TWILIO_PARAMS = {
    "CallSid": "CA1234567890ABCDE",
    "Digits": "1234",
    "From": "+14158675309",
    "To": "+18005551212",
    "Caller": "+14158675309",
}
TWILIO_BODY = urlencode(TWILIO_PARAMS).encode()
TWILIO_SIG = "RSOYDt4T1cUTdK1PDd93/VVr8B8="
TWILIO_HEADERS = {"Content-Type": FORM, "X-Twilio-Signature": TWILIO_SIG}
TWILIO_JSON = b'{"property": "value", "boolean": true}'
TWILIO_JSON_SIG = "a9nBmqA0ju/hNViExpshrM61xv4="

# --- X: computed from "Securing webhooks" (sha256=<base64 HMAC-SHA256(consumer secret,
# body)>; the CRC token likewise).
X_SECRET = "x-consumer-secret"
X_BODY = (
    b'{"for_user_id":"2244994945","tweet_create_events":'
    b'[{"id_str":"1877771234567890123","text":"hello"}]}'
)
X_SIG = "sha256=15w3Q4Tku+L9GSSDOmAilAUeAkj+eUjK07/xtoUZR80="
X_CRC_TOKEN = "challenge_token_abc"
X_CRC = "sha256=uo1kBCevlQSk5EICJEC9oyyaxoN2OUHV3RChC72jTbw="


# One genuine delivery per scheme: (verify block, secret, headers, body, now,
# the signature header's name as reasons spell it).
GENUINE: dict[str, tuple[dict[str, Any], str, dict[str, str], bytes, float, str]] = {
    "zoom": ({"scheme": "zoom"}, ZOOM_SECRET, ZOOM_HEADERS, ZOOM_BODY, ZOOM_TS, "x-zm-signature"),
    "meta": (
        {"scheme": "meta"},
        META_SECRET,
        {"X-Hub-Signature-256": META_SIG},
        META_BODY,
        ZOOM_TS,
        "X-Hub-Signature-256",
    ),
    "paddle": (
        {"scheme": "paddle"},
        PADDLE_SECRET,
        {"Paddle-Signature": PADDLE_SIG},
        PADDLE_BODY,
        PADDLE_TS,
        "Paddle-Signature",
    ),
    "linear": (
        {"scheme": "linear"},
        LINEAR_SECRET,
        {"Linear-Signature": LINEAR_SIG},
        LINEAR_BODY,
        LINEAR_NOW,
        "Linear-Signature",
    ),
    "square": (
        {"scheme": "square", "url": SQUARE_URL},
        SQUARE_KEY,
        {"x-square-hmacsha256-signature": SQUARE_SIG},
        SQUARE_BODY,
        ZOOM_TS,
        "x-square-hmacsha256-signature",
    ),
    "twilio": (
        {"scheme": "twilio", "url": TWILIO_URL},
        TWILIO_TOKEN,
        TWILIO_HEADERS,
        TWILIO_BODY,
        ZOOM_TS,
        "X-Twilio-Signature",
    ),
    "twitter": (
        {"scheme": "twitter"},
        X_SECRET,
        {"x-twitter-webhooks-signature": X_SIG},
        X_BODY,
        ZOOM_TS,
        "x-twitter-webhooks-signature",
    ),
}
SCHEMES = list(GENUINE)


def genuine(name: str) -> tuple[VerifySpec, dict[str, str], bytes, float, str]:
    raw, secret, headers, body, now, label = GENUINE[name]
    return spec_of(raw, secret), headers, body, now, label


# --------------------------------------------------------------------------- vectors


def test_computed_vectors_match_the_standard_library() -> None:
    """The vectors computed from the documentation, computed again here: the gateway is
    checked against hashlib and hmac, never against itself."""
    assert "v0=" + hex_hmac(ZOOM_SECRET, f"v0:{ZOOM_TS}:".encode() + ZOOM_BODY) == ZOOM_SIG
    assert "sha256=" + hex_hmac(META_SECRET, META_BODY) == META_SIG
    assert hex_hmac(LINEAR_SECRET, LINEAR_BODY) == LINEAR_SIG
    assert "sha256=" + b64_hmac(X_SECRET, X_BODY) == X_SIG
    assert "sha256=" + b64_hmac(X_SECRET, X_CRC_TOKEN.encode()) == X_CRC
    # The published ones agree with the standard library too.
    assert hex_hmac(PADDLE_SECRET, f"{PADDLE_TS}:".encode() + PADDLE_BODY) == PADDLE_H1
    assert b64_hmac(SQUARE_KEY, SQUARE_URL.encode() + SQUARE_BODY) == SQUARE_SIG
    twilio_string = TWILIO_URL + "".join(k + TWILIO_PARAMS[k] for k in sorted(TWILIO_PARAMS))
    assert b64_hmac(TWILIO_TOKEN, twilio_string.encode(), "sha1") == TWILIO_SIG


@pytest.mark.parametrize("name", SCHEMES)
def test_genuine_delivery_verifies(name: str) -> None:
    spec, headers, body, now, _ = genuine(name)
    assert check(spec, headers, body, now) is None
    # Header names are case-insensitive on the wire.
    assert check(spec, {k.upper(): v for k, v in headers.items()}, body, now) is None


@pytest.mark.parametrize("name", SCHEMES)
def test_sign_produces_headers_that_verify(name: str) -> None:
    spec, _, body, now, label = genuine(name)
    signed = sign(spec, body, now)
    assert label in signed
    assert check(spec, signed, body, now) is None


@pytest.mark.parametrize("name", ["zoom", "meta", "linear", "square", "twitter"])
def test_sign_reproduces_the_vector(name: str) -> None:
    spec, headers, body, now, _ = genuine(name)
    assert sign(spec, body, now) == headers


def test_sign_paddle_and_twilio_reproduce_the_published_signatures() -> None:
    paddle = spec_of({"scheme": "paddle"}, PADDLE_SECRET)
    assert sign(paddle, PADDLE_BODY, PADDLE_TS + 0.9) == {
        "Paddle-Signature": f"ts={PADDLE_TS};h1={PADDLE_H1}"
    }
    twilio = spec_of({"scheme": "twilio", "url": TWILIO_URL}, TWILIO_TOKEN)
    assert sign(twilio, TWILIO_BODY, 0.0) == TWILIO_HEADERS
    assert sign(twilio, TWILIO_JSON, 0.0) == {
        "Content-Type": "application/json",
        "X-Twilio-Signature": TWILIO_JSON_SIG,
    }


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", SCHEMES)
def test_tampered_body_is_refused(name: str) -> None:
    spec, headers, body, now, _ = genuine(name)
    assert check(spec, headers, body + b" ", now) == "signature mismatch"
    flipped = body[:-1] + bytes([body[-1] ^ 1])
    assert check(spec, headers, flipped, now) == "signature mismatch"


@pytest.mark.parametrize("name", SCHEMES)
def test_wrong_secret_is_refused(name: str) -> None:
    raw, _, headers, body, now, _ = GENUINE[name]
    assert check(spec_of(raw, "not-the-secret"), headers, body, now) == "signature mismatch"
    # Rotation: the signing secret anywhere in the list verifies.
    rotating = spec_of(raw, "new-secret", GENUINE[name][1])
    assert check(rotating, headers, body, now) is None


@pytest.mark.parametrize("name", SCHEMES)
def test_missing_repeated_and_empty_signature_header(name: str) -> None:
    spec, headers, body, now, label = genuine(name)
    others = {k: v for k, v in headers.items() if k.lower() != label.lower()}
    assert check(spec, others, body, now) == f"missing header {label}"
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    twice = Headers(raw=[*raw, (label.lower().encode(), headers[label].encode())])
    assert check(spec, twice, body, now) == f"header {label} repeated"
    assert check(spec, {**others, label: " "}, body, now) == f"empty header {label}"


@pytest.mark.parametrize("name", SCHEMES)
def test_reasons_never_show_the_secret_or_signature(name: str) -> None:
    spec, headers, body, now, label = genuine(name)
    secret = GENUINE[name][1]
    signature = headers[label]
    reasons = [
        check(spec, headers, body + b"x", now),
        check(spec_of(GENUINE[name][0], "other"), headers, body, now),
        check(spec, {**headers, label: signature[:-2] + "zz"}, body, now),
        check(spec, {**headers, label: signature + "0"}, body, now),
    ]
    for reason in reasons:
        assert reason is not None
        assert secret not in reason and signature not in reason
        assert "zz" not in reason
    assert secret not in repr(spec) and secret not in describe(spec)


# --------------------------------------------------------------------------- zoom


def test_zoom_timestamp() -> None:
    zoom = spec_of({"scheme": "zoom"}, ZOOM_SECRET)
    assert check(zoom, ZOOM_HEADERS, ZOOM_BODY, ZOOM_TS + 300) is None
    assert check(zoom, ZOOM_HEADERS, ZOOM_BODY, ZOOM_TS - 300) is None
    stale = "timestamp outside tolerance (300 s)"
    assert check(zoom, ZOOM_HEADERS, ZOOM_BODY, ZOOM_TS + 301) == stale
    assert check(zoom, ZOOM_HEADERS, ZOOM_BODY, ZOOM_TS - 301) == stale
    # The timestamp is signed: a fresh one on a captured delivery does not verify.
    moved = {**ZOOM_HEADERS, "x-zm-request-timestamp": str(ZOOM_TS + 60)}
    assert check(zoom, moved, ZOOM_BODY, ZOOM_TS + 60) == "signature mismatch"
    assert check(zoom, {"x-zm-signature": ZOOM_SIG}, ZOOM_BODY, ZOOM_TS) == (
        "missing header x-zm-request-timestamp"
    )
    millis = {**ZOOM_HEADERS, "x-zm-request-timestamp": str(ZOOM_TS * 1000)}
    assert check(zoom, millis, ZOOM_BODY, ZOOM_TS) == stale
    assert check(zoom, {**ZOOM_HEADERS, "x-zm-request-timestamp": "soon"}, ZOOM_BODY, 0) == (
        "malformed header x-zm-request-timestamp"
    )
    assert check(zoom, {**ZOOM_HEADERS, "x-zm-signature": ZOOM_SIG[3:]}, ZOOM_BODY, ZOOM_TS) == (
        "header x-zm-signature lacks prefix 'v0='"
    )
    upper = {**ZOOM_HEADERS, "x-zm-signature": "v0=" + ZOOM_SIG[3:].upper()}
    assert check(zoom, upper, ZOOM_BODY, ZOOM_TS) is None
    wide = spec_of({"scheme": "zoom", "tolerance": 900}, ZOOM_SECRET)
    assert check(wide, ZOOM_HEADERS, ZOOM_BODY, ZOOM_TS + 900) is None


# --------------------------------------------------------------------------- meta


def test_meta_header_and_verify_tokens() -> None:
    meta = spec_of(
        {"scheme": "meta", "verify_token_env": ["VT_NEW", "VT_OLD"]},
        META_SECRET,
        env={"VT_NEW": "meatyhamhock", "VT_OLD": "older-token"},
    )
    assert meta.verify_token_env == ("VT_NEW", "VT_OLD")
    assert meta.verify_tokens == ("meatyhamhock", "older-token")
    # Secrets like the app secret: not in the repr, the label or any reason.
    for shown in (repr(meta), describe(meta)):
        assert "meatyhamhock" not in shown and "older-token" not in shown
    # The verify token plays no part in verifying a POST.
    assert check(meta, {"X-Hub-Signature-256": META_SIG}, META_BODY, 0.0) is None
    # Meta sends the legacy SHA-1 header as well; it alone is not accepted.
    sha1 = "sha1=" + hex_hmac(META_SECRET, META_BODY, "sha1")
    assert check(meta, {"X-Hub-Signature": sha1}, META_BODY, 0.0) == (
        "missing header X-Hub-Signature-256"
    )
    assert check(meta, {"X-Hub-Signature-256": META_SIG[7:]}, META_BODY, 0.0) == (
        "header X-Hub-Signature-256 lacks prefix 'sha256='"
    )
    without = spec_of({"scheme": "meta"}, META_SECRET)
    assert without.verify_tokens == () and without.verify_token_env == ()


# --------------------------------------------------------------------------- paddle


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (f"ts={PADDLE_TS};h1={PADDLE_H1}", None),
        (f"h1={PADDLE_H1};ts={PADDLE_TS}", None),
        (f"ts={PADDLE_TS}; h1={PADDLE_H1}", None),
        (f"ts={PADDLE_TS};h1={PADDLE_H1.upper()}", None),
        # Names Paddle may add later are skipped, as its SDKs skip them.
        (f"ts={PADDLE_TS};h2=abc;h1={PADDLE_H1}", None),
        (f"ts={PADDLE_TS};h1=dummy", "signature mismatch"),
        (f"ts={PADDLE_TS + 1};h1={PADDLE_H1}", "signature mismatch"),
        (f"h1={PADDLE_H1}", "malformed header Paddle-Signature"),
        (f"ts={PADDLE_TS};ts={PADDLE_TS};h1={PADDLE_H1}", "malformed header Paddle-Signature"),
        (f"ts=soon;h1={PADDLE_H1}", "malformed header Paddle-Signature"),
        (f"ts={PADDLE_TS};{PADDLE_H1}", "malformed header Paddle-Signature"),
        (f"ts={PADDLE_TS}", "no h1 signature in Paddle-Signature"),
        # Stripe's separator is not Paddle's.
        (f"ts={PADDLE_TS},h1={PADDLE_H1}", "malformed header Paddle-Signature"),
    ],
)
def test_paddle_header(value: str, reason: str | None) -> None:
    paddle = spec_of({"scheme": "paddle"}, PADDLE_SECRET)
    assert check(paddle, {"Paddle-Signature": value}, PADDLE_BODY, PADDLE_TS) == reason


def test_paddle_secrets_and_timestamp() -> None:
    # The SDK test's list: the first two secrets fail, the third signed the delivery.
    listed = spec_of({"scheme": "paddle"}, *PADDLE_SECRETS)
    headers = {"Paddle-Signature": PADDLE_SIG}
    assert check(listed, headers, PADDLE_BODY, PADDLE_TS) is None
    wrong = spec_of({"scheme": "paddle"}, *PADDLE_SECRETS[:2])
    assert check(wrong, headers, PADDLE_BODY, PADDLE_TS) == "signature mismatch"
    assert check(listed, headers, PADDLE_BODY, PADDLE_TS + 300) is None
    assert check(listed, headers, PADDLE_BODY, PADDLE_TS + 301) == (
        "timestamp outside tolerance (300 s)"
    )
    strict = spec_of({"scheme": "paddle", "tolerance": 5}, PADDLE_SECRET)
    assert check(strict, headers, PADDLE_BODY, PADDLE_TS + 6) == (
        "timestamp outside tolerance (5 s)"
    )


# --------------------------------------------------------------------------- linear


def linear_headers(body: bytes) -> dict[str, str]:
    return {"Linear-Signature": hex_hmac(LINEAR_SECRET, body)}


def test_linear_webhook_timestamp_within_a_minute() -> None:
    linear = spec_of({"scheme": "linear"}, LINEAR_SECRET)
    assert linear.tolerance == 60
    headers = {"Linear-Signature": LINEAR_SIG}
    # Compared in milliseconds, as Linear compares them.
    assert check(linear, headers, LINEAR_BODY, LINEAR_NOW + 59.99) is None
    assert check(linear, headers, LINEAR_BODY, LINEAR_NOW - 59.99) is None
    stale = "webhookTimestamp outside tolerance (60 s)"
    assert check(linear, headers, LINEAR_BODY, LINEAR_NOW + 60.01) == stale
    assert check(linear, headers, LINEAR_BODY, LINEAR_NOW - 60.01) == stale
    wide = spec_of({"scheme": "linear", "tolerance": 300}, LINEAR_SECRET)
    assert check(wide, headers, LINEAR_BODY, LINEAR_NOW + 299.99) is None
    # The signature is checked first: a tampered body is a mismatch whatever its age.
    assert check(linear, headers, LINEAR_BODY + b" ", LINEAR_NOW + 3600) == "signature mismatch"


@pytest.mark.parametrize(
    "body",
    [
        b'{"action":"create","type":"Issue"}',
        b'{"action":"create","webhookTimestamp":"1676056940508"}',
        b'{"action":"create","webhookTimestamp":1676056940508.5}',
        b'{"action":"create","webhookTimestamp":true}',
        b'[{"webhookTimestamp":1676056940508}]',
        b"not json",
    ],
)
def test_linear_without_an_integer_webhook_timestamp_is_refused(body: bytes) -> None:
    # Signed correctly, but with no timestamp to check it could be replayed for ever.
    linear = spec_of({"scheme": "linear"}, LINEAR_SECRET)
    assert check(linear, linear_headers(body), body, LINEAR_NOW) == (
        "no webhookTimestamp (Unix ms) in the body"
    )


# --------------------------------------------------------------------------- square


def test_square_published_vectors_and_refusals() -> None:
    square = spec_of({"scheme": "square", "url": SQUARE_URL}, SQUARE_KEY)
    headers = {"x-square-hmacsha256-signature": SQUARE_SIG}
    assert check(square, headers, SQUARE_BODY, 0.0) is None
    # The SDK's second vector: a body with characters an HTML escaper would change.
    escaped = spec_of({"scheme": "square", "url": "https://webhook.site/webhooks"}, "signature-key")
    sig = "Cxt7+aTi4rKgcA0bC4g9EHdVtLSDWdqccmL5MvihU4U="
    body = b'{"data":{"type":"webhooks","id":">id<"}}'
    assert check(escaped, {"x-square-hmacsha256-signature": sig}, body, 0.0) is None
    # The SDK's refusals: another URL, another key, another signature, a reformatted body.
    other_url = spec_of(
        {"scheme": "square", "url": "https://webhook.site/79a4f3a-dcfa-49ee-bac5-9d0edad886b9"},
        SQUARE_KEY,
    )
    assert check(other_url, headers, SQUARE_BODY, 0.0) == "signature mismatch"
    other_key = spec_of({"scheme": "square", "url": SQUARE_URL}, "MCmhFRxGX82xMwg5FsaoQA")
    assert check(other_key, headers, SQUARE_BODY, 0.0) == "signature mismatch"
    wrong = {"x-square-hmacsha256-signature": "1z2n3DEJJiUPKcPzQo1ftvbxGdw="}
    assert check(square, wrong, SQUARE_BODY, 0.0) == "signature mismatch"
    assert check(square, headers, SQUARE_BODY.replace(b",", b", "), 0.0) == "signature mismatch"


def test_square_url_is_literal_text() -> None:
    # Braces in the URL are not placeholders: the URL is signed as written.
    url = "https://hooks.example.com/hooks/square?tag={body}"
    square = spec_of({"scheme": "square", "url": url}, "k")
    sig = b64_hmac("k", url.encode() + b'{"a":1}')
    assert sign(square, b'{"a":1}', 0.0) == {"x-square-hmacsha256-signature": sig}
    assert check(square, {"x-square-hmacsha256-signature": sig}, b'{"a":1}', 0.0) is None


# --------------------------------------------------------------------------- twilio


def twilio_spec(url: str = TWILIO_URL, *tokens: str) -> VerifySpec:
    return spec_of({"scheme": "twilio", "url": url}, *(tokens or (TWILIO_TOKEN,)))


@pytest.mark.parametrize(
    "params",
    [
        TWILIO_PARAMS,
        {"Body": "Hello, wörld & friends = 100%", "From": "+14155550100", "NumMedia": "0"},
        {"Body": "", "To": "+1 (415) 555-0100", "z": "last", "A": "upper first"},
        {"MessageSid": "SM" + "0" * 32, "Body": "emoji \N{GRINNING FACE}"},
    ],
)
def test_twilio_form_signed_by_twilio_sdk(params: dict[str, str]) -> None:
    """Twilio's own RequestValidator signs the delivery at test time."""
    url = "https://hooks.example.com/hooks/twilio?team=ops"
    signature = RequestValidator("auth-token").compute_signature(url, params)
    body = urlencode(params).encode()
    spec = twilio_spec(url, "auth-token")
    headers = {"Content-Type": FORM, "X-Twilio-Signature": signature}
    assert check(spec, headers, body, 0.0) is None
    # Field order and a charset parameter do not matter; Twilio signs sorted fields.
    reordered = urlencode(list(reversed(params.items()))).encode()
    charset = {**headers, "Content-Type": FORM + "; charset=utf-8"}
    assert check(spec, charset, reordered, 0.0) is None
    assert sign(spec, body, 0.0)["X-Twilio-Signature"] == signature
    # The URL is signed: another query string or path is another signature.
    assert check(twilio_spec(url.split("?")[0], "auth-token"), headers, body, 0.0) == (
        "signature mismatch"
    )
    changed = body.replace(b"%2B", b"%2B1", 1) if b"%2B" in body else body + b"&extra=1"
    assert check(spec, headers, changed, 0.0) == "signature mismatch"


def test_twilio_repeated_form_fields_as_the_sdk_signs_them() -> None:
    params = MultiDict([("Sid", "CA123"), ("SidAccount", "AC123"), ("Digits", "5678"),
                        ("Digits", "1234")])  # fmt: skip
    # twilio-python's published value for these fields (test_compute_signature_duplicate_*).
    assert RequestValidator(TWILIO_TOKEN).compute_signature(TWILIO_URL, params) == (
        "IK+Dwps556ElfBT0I3Rgjkr1wJU="
    )
    body = urlencode(list(params.items())).encode()
    headers = {"Content-Type": FORM, "X-Twilio-Signature": "IK+Dwps556ElfBT0I3Rgjkr1wJU="}
    assert check(twilio_spec(), headers, body, 0.0) is None


def test_twilio_json_body_with_body_sha256() -> None:
    spec = twilio_spec()
    headers = {"Content-Type": "application/json", "X-Twilio-Signature": TWILIO_JSON_SIG}
    # The published vector: the URL with &bodySHA256=<hex> appended, no parameters.
    body_hash = hashlib.sha256(TWILIO_JSON).hexdigest()
    assert body_hash == "0a1ff7634d9ab3b95db5c9a2dfe9416e41502b283a80c7cf19632632f96e6620"
    validator = RequestValidator(TWILIO_TOKEN)
    signed_url = f"{TWILIO_URL}&bodySHA256={body_hash}"
    assert validator.validate(signed_url, TWILIO_JSON.decode(), TWILIO_JSON_SIG)
    assert check(spec, headers, TWILIO_JSON, 0.0) is None
    assert check(spec, headers, TWILIO_JSON.replace(b"true", b"false"), 0.0) == (
        "signature mismatch"
    )
    # Sent as a form, the same body and signature are another signed string.
    assert check(spec, {**headers, "Content-Type": FORM}, TWILIO_JSON, 0.0) == (
        "signature mismatch"
    )
    # A URL without a query gets `?bodySHA256=`, signed by the SDK at test time.
    url = "https://hooks.example.com/hooks/twilio"
    body = b'{"event":"com.twilio.messaging.inbound-message.received"}'
    signed_url = f"{url}?bodySHA256={hashlib.sha256(body).hexdigest()}"
    signature = RequestValidator("t").compute_signature(signed_url, {})
    json_headers = {"Content-Type": "application/json", "X-Twilio-Signature": signature}
    assert check(twilio_spec(url, "t"), json_headers, body, 0.0) is None


def test_twilio_url_with_or_without_port() -> None:
    """Twilio's helper libraries accept the URL's signature with its port removed or
    the default port added (twilio-python's published values)."""
    headers = {"Content-Type": FORM}
    with_443 = {**headers, "X-Twilio-Signature": "kvajT1Ptam85bY51eRf/AJRuM3w="}
    assert check(twilio_spec(), with_443, TWILIO_BODY, 0.0) is None
    http = TWILIO_URL.replace("https", "http")
    with_80 = {**headers, "X-Twilio-Signature": "0ZXoZLH/DfblKGATFgpif+LLRf4="}
    assert check(twilio_spec(http), with_80, TWILIO_BODY, 0.0) is None
    # Configured with a port, the URL without it verifies too.
    on_1234 = TWILIO_URL.replace(".com", ".com:1234")
    assert check(twilio_spec(on_1234), TWILIO_HEADERS, TWILIO_BODY, 0.0) is None
    http_1234 = {**headers, "X-Twilio-Signature": "Zmvh+3yNM1Phv2jhDCwEM3q5ebU="}
    assert (
        check(twilio_spec(http.replace(".com", ".com:1234")), http_1234, TWILIO_BODY, 0.0) is None
    )
    # Another port is another URL.
    assert check(twilio_spec(on_1234), with_443, TWILIO_BODY, 0.0) == "signature mismatch"


def test_twilio_shared_key_algorithms() -> None:
    """Signed with a SharedKey, Twilio names the algorithm in a second header; the
    secret is then the key's (listed in secret_env beside the Auth Token)."""
    spec = twilio_spec(TWILIO_URL, TWILIO_TOKEN, "shared-key-secret")
    string = TWILIO_URL + "".join(k + TWILIO_PARAMS[k] for k in sorted(TWILIO_PARAMS))
    settings = "X-Twilio-Webhooks-Signature-Settings"
    sha256 = b64_hmac("shared-key-secret", string.encode(), "sha256")
    headers = {"Content-Type": FORM, "X-Twilio-Signature": sha256}
    key = "key=webhooks_sharedkey_01abc"
    assert (
        check(spec, {**headers, settings: f"{key},algorithm=HMAC_SHA256"}, TWILIO_BODY, 0) is None
    )
    # Without the header (or naming SHA-1) the signature is an HMAC-SHA1.
    assert check(spec, headers, TWILIO_BODY, 0) == "signature mismatch"
    sha1 = {**TWILIO_HEADERS, settings: f"{key},algorithm=HMAC_SHA1"}
    assert check(spec, sha1, TWILIO_BODY, 0) is None
    assert check(spec, {**TWILIO_HEADERS, settings: key}, TWILIO_BODY, 0) is None
    assert check(spec, {**headers, settings: f"{key},algorithm=HMAC_MD5"}, TWILIO_BODY, 0) == (
        f"unsupported algorithm in header {settings}"
    )


def test_twilio_refusals() -> None:
    spec = twilio_spec()
    not_utf8 = b"Body=%FF%FE&From=%2B14158675309"
    assert check(spec, TWILIO_HEADERS, not_utf8, 0.0) == (
        "malformed form body (not UTF-8 form encoding)"
    )
    assert check(spec, TWILIO_HEADERS, b"Body=\xff", 0.0) == (
        "malformed form body (not UTF-8 form encoding)"
    )
    raw = [(b"content-type", FORM.encode()), (b"content-type", b"application/json"),
           (b"x-twilio-signature", TWILIO_SIG.encode())]  # fmt: skip
    assert check(spec, Headers(raw=raw), TWILIO_BODY, 0.0) == "header Content-Type repeated"
    # sign() sends such a body the JSON way (bodySHA256), which verifies.
    signed = sign(spec, b"Body=\xff", 0.0)
    assert signed["Content-Type"] == "application/json"
    assert check(spec, signed, b"Body=\xff", 0.0) is None
    # Without a Content-Type the body is not taken for a form.
    assert check(spec, {"X-Twilio-Signature": TWILIO_SIG}, TWILIO_BODY, 0.0) == (
        "signature mismatch"
    )


# --------------------------------------------------------------------------- X


def test_twitter_signature_and_crc() -> None:
    x = spec_of({"scheme": "twitter"}, X_SECRET)
    assert check(x, {"x-twitter-webhooks-signature": X_SIG}, X_BODY, 0.0) is None
    assert check(x, {"x-twitter-webhooks-signature": X_SIG[7:]}, X_BODY, 0.0) == (
        "header x-twitter-webhooks-signature lacks prefix 'sha256='"
    )
    # Base64 is case-sensitive: a lower-cased signature is another value.
    lowered = {"x-twitter-webhooks-signature": X_SIG.lower()}
    assert check(x, lowered, X_BODY, 0.0) == "signature mismatch"
    assert crc_response(x, X_CRC_TOKEN) == X_CRC
    # While secrets rotate, the CRC answer is the current (first) secret's.
    rotating = spec_of({"scheme": "twitter"}, X_SECRET, "old-consumer-secret")
    assert crc_response(rotating, X_CRC_TOKEN) == X_CRC
    with pytest.raises(ValueError, match="scheme meta has no CRC check"):
        crc_response(spec_of({"scheme": "meta"}, X_SECRET), X_CRC_TOKEN)


# --------------------------------------------------------------------------- config


ENV = {"GOOD": "s3cr3t-VALUE-never-shown"}


@pytest.mark.parametrize(
    ("raw", "fld", "message"),
    [
        (
            {"scheme": "square"},
            "verify.url",
            "is required for scheme square: the notification URL of the subscription, as "
            "configured in Square (e.g. https://hooks.example.com/hooks/square)",
        ),
        (
            {"scheme": "twilio"},
            "verify.url",
            "is required for scheme twilio: the full URL Twilio requests, query string "
            "included, as configured in Twilio (e.g. https://hooks.example.com/hooks/twilio)",
        ),
        (
            {"scheme": "square", "url": 5},
            "verify.url",
            "must be a URL such as https://hooks.example.com/, got 5",
        ),
        (
            {"scheme": "square", "url": "/hooks/square"},
            "verify.url",
            "must be an absolute http or https URL, got '/hooks/square'",
        ),
        (
            {"scheme": "twilio", "url": "ftp://hooks.example.com/x"},
            "verify.url",
            "must be an absolute http or https URL, got 'ftp://hooks.example.com/x'",
        ),
        (
            {"scheme": "twilio", "url": "https://hooks.example.com:http/x"},
            "verify.url",
            "is not a valid URL",
        ),
        (
            {"scheme": "twilio", "url": "https://user:pa55word@hooks.example.com/x"},
            "verify.url",
            "must not contain credentials (user:password@)",
        ),
        (
            {"scheme": "square", "url": "https://hooks.example.com/x#top"},
            "verify.url",
            "must not have a #fragment (no sender signs one), "
            "got 'https://hooks.example.com/x#top'",
        ),
        (
            {"scheme": "square", "url": "https://hooks.example.com/a b"},
            "verify.url",
            "must not contain spaces or control characters, got 'https://hooks.example.com/a b'",
        ),
        (
            {"scheme": "zoom", "url": "https://hooks.example.com/x"},
            "verify.url",
            "is not a setting of scheme zoom; allowed: scheme, secret_env, tolerance",
        ),
        (
            {"scheme": "twitter", "verify_token_env": "GOOD"},
            "verify.verify_token_env",
            "is not a setting of scheme twitter; allowed: scheme, secret_env",
        ),
        (
            {"scheme": "meta", "tolerance": 60},
            "verify.tolerance",
            "is not a setting of scheme meta; allowed: scheme, secret_env, verify_token_env",
        ),
        (
            {"scheme": "square", "url": "https://h.example.com/", "header": "X-Sig"},
            "verify.header",
            "is not a setting of scheme square; allowed: scheme, secret_env, url",
        ),
        (
            {"scheme": "linear", "tolerance": 0},
            "verify.tolerance",
            "must be a positive whole number of seconds, got 0",
        ),
        (
            {"scheme": "meta", "verify_token_env": "UNSET_VT"},
            "verify.verify_token_env",
            "environment variable UNSET_VT is not set",
        ),
        (
            {"scheme": "meta", "verify_token_env": "EMPTY_VT"},
            "verify.verify_token_env",
            "environment variable EMPTY_VT is empty",
        ),
        (
            {"scheme": "meta", "verify_token_env": ["GOOD", "GOOD"]},
            "verify.verify_token_env",
            "GOOD is listed twice",
        ),
        (
            {"scheme": "meta", "verify_token_env": "not a name!"},
            "verify.verify_token_env",
            "entries must be environment variable names (letters, digits and _, not "
            "starting with a digit); the secret itself goes in that variable",
        ),
        (
            {"scheme": "meta", "verify_token_env": []},
            "verify.verify_token_env",
            "must be a variable name or a non-empty list of variable names",
        ),
    ],
)
def test_parse_errors(raw: dict[str, Any], fld: str, message: str) -> None:
    env = {**ENV, "EMPTY_VT": ""}
    with pytest.raises(ConfigError) as info:
        parse_verify({**raw, "secret_env": "GOOD"}, file=FILE, trigger="x", env=env)
    assert str(info.value) == f"{FILE}: trigger 'x': field '{fld}': {message}"
    assert (info.value.section, info.value.name, info.value.field) == ("trigger", "x", fld)
    assert ENV["GOOD"] not in repr(info.value) and "pa55word" not in str(info.value)


def test_presets_fill_their_fields() -> None:
    fields = ("header", "algorithm", "encoding", "prefix", "timestamp_header")
    expected = {
        "zoom": ("x-zm-signature", "sha256", "hex", "v0=", "x-zm-request-timestamp"),
        "meta": ("X-Hub-Signature-256", "sha256", "hex", "sha256=", None),
        "paddle": ("Paddle-Signature", "sha256", "hex", "", None),
        "linear": ("Linear-Signature", "sha256", "hex", "", None),
        "square": ("x-square-hmacsha256-signature", "sha256", "base64", "", None),
        "twilio": ("X-Twilio-Signature", "sha1", "base64", "", None),
        "twitter": ("x-twitter-webhooks-signature", "sha256", "base64", "sha256=", None),
    }
    for name in SCHEMES:
        spec = genuine(name)[0]
        # The header is set, so the delivery log and the spool drop it (received.py).
        assert tuple(getattr(spec, f) for f in fields) == expected[name], name
    assert genuine("zoom")[0].signed_payload == "v0:{timestamp}:{body}"
    assert genuine("square")[0].url == SQUARE_URL
    assert genuine("twilio")[0].urls == (TWILIO_URL, TWILIO_URL.replace(".com", ".com:443"))


def test_direct_construction_checks_url_and_verify_tokens() -> None:
    with pytest.raises(ValueError, match="scheme square needs a url"):
        VerifySpec(scheme="square", secret_env=("S",), secrets=("k",))
    with pytest.raises(ValueError, match="scheme twilio needs a url"):
        VerifySpec(scheme="twilio", secret_env=("S",), secrets=("k",))
    with pytest.raises(ValueError, match="scheme zoom signs no url"):
        VerifySpec(scheme="zoom", secret_env=("S",), secrets=("k",), url="https://h/")
    with pytest.raises(ValueError, match="only scheme meta has verify tokens"):
        VerifySpec(scheme="twitter", secret_env=("S",), secrets=("k",), verify_tokens=("t",))
    with pytest.raises(ValueError, match="scheme zoom fixes prefix itself"):
        VerifySpec(scheme="zoom", secret_env=("S",), secrets=("k",), prefix="v1=")
    direct = VerifySpec(scheme="square", secret_env=("S",), secrets=(SQUARE_KEY,), url=SQUARE_URL)
    assert check(direct, {"x-square-hmacsha256-signature": SQUARE_SIG}, SQUARE_BODY, 0) is None


def test_describe() -> None:
    assert [describe(genuine(name)[0]) for name in SCHEMES] == SCHEMES
    assert describe(spec_of({"scheme": "zoom", "tolerance": 120}, "s")) == "zoom ±120 s"
    assert describe(spec_of({"scheme": "paddle", "tolerance": 5}, "s")) == "paddle ±5 s"
    # Linear's default is its minute; another tolerance is shown.
    assert describe(spec_of({"scheme": "linear", "tolerance": 60}, "s")) == "linear"
    assert describe(spec_of({"scheme": "linear", "tolerance": 300}, "s")) == "linear ±300 s"


# --------------------------------------------------------------------------- docs


def test_the_docs_preset_examples_parse() -> None:
    text = TRIGGERS_DOC.read_text()
    part = text[text.index("### Zoom, Meta, Paddle, Linear, Square, Twilio and X") :]
    part = re.split(r"^##", part[3:], flags=re.M)[0]  # up to the next heading
    (example,) = re.findall(r"^```yaml\n(.*?)^```", part, re.M | re.S)
    env = {
        name: "s"
        for name in (
            "ZOOM_WEBHOOK_SECRET_TOKEN", "META_APP_SECRET", "META_VERIFY_TOKEN",
            "PADDLE_WEBHOOK_SECRET", "PADDLE_WEBHOOK_SECRET_OLD", "LINEAR_WEBHOOK_SECRET",
            "SQUARE_SIGNATURE_KEY", "TWILIO_AUTH_TOKEN", "X_CONSUMER_SECRET",
        )
    }  # fmt: skip
    workflows = ("notify", "reply", "billing-sync", "triage", "fulfil")
    parsed = parse_triggers(
        yaml.safe_load(example), file="docs/triggers.md", workflows=workflows, env=env
    )
    assert {name: describe(t.verify) for name, t in parsed.items()} == {
        "zoom-meetings": "zoom",
        "whatsapp-messages": "meta",
        "paddle-billing": "paddle",
        "linear-issues": "linear",
        "square-payments": "square",
        "twilio-sms": "twilio",
        "x-activity": "twitter",
    }
    assert parsed["whatsapp-messages"].verify.verify_tokens == ("s",)
    assert parsed["twilio-sms"].verify.url == "https://hooks.example.com/hooks/twilio?team=ops"
    # Every preset is in the table of schemes, with its header.
    table = text[text.index("| `verify.scheme` | checks | fields |") :]
    table = table[: table.index("\n\n")]
    for name in SCHEMES:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert genuine(name)[4] in row, name
