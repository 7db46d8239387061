"""The `slack`, `shopify` and `gitlab` presets, Svix's header names for `standard`, and
the timestamp option of `hmac` (gateway/signatures/), against the senders' published
examples; and each scheme's replay-guard default (gateway/ingest/triggers.py). Pure: no Redis.

Published values are copied here (the tests read nothing outside the repository):

- Slack: the worked example of api.slack.com "Verifying requests from Slack" (also in
  slackapi/python-slack-sdk tests/slack_sdk/signature/test_signature_verifier.py).
- Svix / Standard Webhooks: standard-webhooks/standard-webhooks
  libraries/python/tests/test_webhooks.py::test_sign_function (the same message,
  with `svix-id`, `svix-timestamp` and `svix-signature`, is Svix's own documentation
  example) and libraries/rust/src/lib.rs::test_sign.
- Shopify publishes no secret, body and signature together (its documentation's
  example header comes without the secret or body it signs). The two vectors here
  were computed independently with Python's ``hmac`` and ``base64``, not with
  gateway code, and the second one also appears in a third-party test of SQLPage's
  ``sqlpage.hmac(…, 'sha256-base64')`` as a Shopify example.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.datastructures import Headers

from gateway.ingest.triggers import parse_triggers
from gateway.model.errors import ConfigError
from gateway.signatures.parse import parse_verify
from gateway.signatures.sign import sign
from gateway.signatures.spec import VerifySpec, describe
from gateway.signatures.verify import verify

FILE = "triggers.yaml"
TRIGGERS_DOC = Path(__file__).resolve().parents[1] / "docs" / "triggers.md"

# --- Slack's published example.
SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
SLACK_TS = 1531420618
SLACK_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow"
    b"&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner"
    b"&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com"
    b"%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
    b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
)
SLACK_SIG = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
SLACK_HEADERS = {"X-Slack-Request-Timestamp": str(SLACK_TS), "X-Slack-Signature": SLACK_SIG}

# --- Standard Webhooks reference-library vectors (python and rust tests).
SVIX_VECTORS = [
    pytest.param(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        1614265330,
        b'{"test": 2432232314}',
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
        id="python-test_sign_function",
    ),
    pytest.param(
        "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
        "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
        1649367553,
        b'{"email":"test@example.com","username":"test_user"}',
        "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
        id="rust-test_sign",
    ),
]
SVIX_SECRET, SVIX_ID, SVIX_TS, SVIX_BODY, SVIX_SIG = SVIX_VECTORS[0].values

# --- Shopify: computed with Python's hmac (see the module docstring).
SHOPIFY_VECTORS = [
    pytest.param(
        "shop-secret", b'{"id":1}', "plW8VGqq0nDMIEhDqaNNW99asdUCy7EIqLZVcQwtAZ0=", id="a"
    ),
    pytest.param(
        "test-webhook-secret",
        b'{"id":1234567890,"email":"customer@example.com","total_price":"123.45"}',
        "QNyObTlKbMx2qDlPF/ZOZcBqg5OgPg+2oky3zldc0Gw=",
        id="b",
    ),
]

GITLAB_TOKEN = "my-gitlab-secret-token"
BODY = b'{"id": "evt_1", "kind": "order.paid"}'
NOW = 1_735_689_600.0
SECRET = "s3cr3t-VALUE-never-shown"


def spec_of(raw: dict[str, Any], *secrets: str) -> VerifySpec:
    """Parse ``raw`` with its secrets in variables S0, S1, ... (listed in that order)."""
    env = {f"S{i}": s for i, s in enumerate(secrets)}
    return parse_verify({**raw, "secret_env": list(env)}, file=FILE, trigger="x", env=env)


def check(
    spec: VerifySpec, headers: dict[str, str] | Headers, body: bytes, now: float
) -> str | None:
    return verify(spec, headers if isinstance(headers, Headers) else Headers(headers), body, now)


SLACK = spec_of({"scheme": "slack"}, SLACK_SECRET)
STANDARD = spec_of({"scheme": "standard"}, SVIX_SECRET)
SHOPIFY = spec_of({"scheme": "shopify"}, "shop-secret")
GITLAB = spec_of({"scheme": "gitlab"}, GITLAB_TOKEN)
TIMED = spec_of(
    {
        "scheme": "hmac",
        "header": "X-Acme-Signature",
        "prefix": "v1=",
        "timestamp_header": "X-Acme-Timestamp",
    },
    "acme-secret",
)


# --------------------------------------------------------------------------- slack


def test_slack_published_example_verifies_and_sign_reproduces_it() -> None:
    assert check(SLACK, SLACK_HEADERS, SLACK_BODY, SLACK_TS) is None
    assert sign(SLACK, SLACK_BODY, SLACK_TS) == SLACK_HEADERS
    # Header names are case-insensitive (Slack's documentation says not to assume a case).
    lowered = {k.lower(): v for k, v in SLACK_HEADERS.items()}
    assert check(SLACK, lowered, SLACK_BODY, SLACK_TS) is None
    upper_hex = {**SLACK_HEADERS, "X-Slack-Signature": "v0=" + SLACK_SIG[3:].upper()}
    assert check(SLACK, upper_hex, SLACK_BODY, SLACK_TS) is None


def test_slack_replay_window_is_300_s_either_way() -> None:
    assert check(SLACK, SLACK_HEADERS, SLACK_BODY, SLACK_TS + 300) is None
    assert check(SLACK, SLACK_HEADERS, SLACK_BODY, SLACK_TS - 300) is None
    stale = "timestamp outside tolerance (300 s)"
    assert check(SLACK, SLACK_HEADERS, SLACK_BODY, SLACK_TS + 301) == stale
    assert check(SLACK, SLACK_HEADERS, SLACK_BODY, SLACK_TS - 301) == stale
    wide = spec_of({"scheme": "slack", "tolerance": 900}, SLACK_SECRET)
    assert check(wide, SLACK_HEADERS, SLACK_BODY, SLACK_TS + 900) is None
    assert check(wide, SLACK_HEADERS, SLACK_BODY, SLACK_TS + 901) == (
        "timestamp outside tolerance (900 s)"
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # The timestamp is signed: a fresh one on a captured delivery does not verify.
        ({"X-Slack-Request-Timestamp": str(SLACK_TS + 1)}, "signature mismatch"),
        ({"X-Slack-Signature": SLACK_SIG[:-1] + "4"}, "signature mismatch"),
        ({"X-Slack-Signature": SLACK_SIG[3:]}, "header X-Slack-Signature lacks prefix 'v0='"),
        (
            {"X-Slack-Signature": "v1=" + SLACK_SIG[3:]},
            "header X-Slack-Signature lacks prefix 'v0='",
        ),
        ({"X-Slack-Signature": None}, "missing header X-Slack-Signature"),
        ({"X-Slack-Request-Timestamp": None}, "missing header X-Slack-Request-Timestamp"),
        ({"X-Slack-Request-Timestamp": " "}, "empty header X-Slack-Request-Timestamp"),
        (
            {"X-Slack-Request-Timestamp": "1531420618.5"},
            "malformed header X-Slack-Request-Timestamp",
        ),
        (
            {"X-Slack-Request-Timestamp": "+1531420618"},
            "malformed header X-Slack-Request-Timestamp",
        ),
    ],
)
def test_slack_refusals(change: dict[str, str | None], reason: str) -> None:
    headers = {k: v for k, v in {**SLACK_HEADERS, **change}.items() if v is not None}
    now = SLACK_TS + 1
    assert check(SLACK, headers, SLACK_BODY, now) == reason


def test_slack_body_and_repeated_header() -> None:
    assert check(SLACK, SLACK_HEADERS, SLACK_BODY + b"&x=1", SLACK_TS) == "signature mismatch"
    raw = [(k.lower().encode(), v.encode()) for k, v in SLACK_HEADERS.items()]
    raw.append((b"x-slack-request-timestamp", str(SLACK_TS).encode()))
    assert check(SLACK, Headers(raw=raw), SLACK_BODY, SLACK_TS) == (
        "header X-Slack-Request-Timestamp repeated"
    )


def test_slack_rotation_any_listed_secret_verifies() -> None:
    rotating = spec_of({"scheme": "slack"}, "new-signing-secret", SLACK_SECRET)
    assert check(rotating, SLACK_HEADERS, SLACK_BODY, SLACK_TS) is None
    fresh = sign(rotating, BODY, NOW)
    assert check(rotating, fresh, BODY, NOW) is None
    assert check(SLACK, fresh, BODY, NOW) == "signature mismatch"


# --------------------------------------------------------------------------- shopify


@pytest.mark.parametrize(("secret", "body", "digest"), SHOPIFY_VECTORS)
def test_shopify_vectors(secret: str, body: bytes, digest: str) -> None:
    # The vector is the standard library's answer, so this checks the gateway against it.
    expected = base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest())
    assert expected.decode() == digest
    spec = spec_of({"scheme": "shopify"}, secret)
    assert sign(spec, body, NOW) == {"X-Shopify-Hmac-Sha256": digest}
    assert check(spec, {"X-Shopify-Hmac-Sha256": digest}, body, NOW) is None
    # Shopify's documentation spells the header X-Shopify-Hmac-SHA256 too.
    assert check(spec, {"x-shopify-hmac-sha256": digest}, body, 0.0) is None


def test_shopify_refusals() -> None:
    digest = "plW8VGqq0nDMIEhDqaNNW99asdUCy7EIqLZVcQwtAZ0="
    body = b'{"id":1}'
    assert check(SHOPIFY, {"X-Shopify-Hmac-Sha256": digest}, b'{"id":2}', NOW) == (
        "signature mismatch"
    )
    # Base64 is case-sensitive, unlike hex: a lower-cased digest is another value.
    assert check(SHOPIFY, {"X-Shopify-Hmac-Sha256": digest.lower()}, body, NOW) == (
        "signature mismatch"
    )
    hexed = hmac.new(b"shop-secret", body, hashlib.sha256).hexdigest()
    assert check(SHOPIFY, {"X-Shopify-Hmac-Sha256": hexed}, body, NOW) == "signature mismatch"
    assert check(SHOPIFY, {}, body, NOW) == "missing header X-Shopify-Hmac-Sha256"
    twice = Headers(raw=[(b"x-shopify-hmac-sha256", digest.encode())] * 2)
    assert check(SHOPIFY, twice, body, NOW) == "header X-Shopify-Hmac-Sha256 repeated"
    # No timestamp is signed: the same delivery verifies at any time.
    assert check(SHOPIFY, {"X-Shopify-Hmac-Sha256": digest}, body, NOW * 2) is None


def test_shopify_rotation() -> None:
    # Shopify may sign with the old client secret for up to an hour after a rotation.
    rotating = spec_of({"scheme": "shopify"}, "new-client-secret", "shop-secret")
    digest = "plW8VGqq0nDMIEhDqaNNW99asdUCy7EIqLZVcQwtAZ0="
    assert check(rotating, {"X-Shopify-Hmac-Sha256": digest}, b'{"id":1}', NOW) is None


# --------------------------------------------------------------------------- gitlab


def test_gitlab_token() -> None:
    assert sign(GITLAB, BODY, NOW) == {"X-Gitlab-Token": GITLAB_TOKEN}
    sent = {"X-Gitlab-Token": GITLAB_TOKEN, "X-Gitlab-Event": "Push Hook"}
    assert check(GITLAB, sent, BODY, NOW) is None
    assert check(GITLAB, {"x-gitlab-token": GITLAB_TOKEN}, b"anything", 0.0) is None
    assert check(GITLAB, {"X-Gitlab-Token": GITLAB_TOKEN[:-1]}, BODY, NOW) == "token mismatch"
    assert check(GITLAB, {"X-Gitlab-Token": GITLAB_TOKEN + "x"}, BODY, NOW) == "token mismatch"
    assert check(GITLAB, {"X-Realm-Token": GITLAB_TOKEN}, BODY, NOW) == (
        "missing header X-Gitlab-Token"
    )
    rotating = spec_of({"scheme": "gitlab"}, "new-token", GITLAB_TOKEN)
    assert check(rotating, sent, BODY, NOW) is None


# --------------------------------------------------------------------------- standard / svix


@pytest.mark.parametrize(("secret", "msg_id", "ts", "body", "sig"), SVIX_VECTORS)
def test_standard_accepts_svix_header_names(
    secret: str, msg_id: str, ts: int, body: bytes, sig: str
) -> None:
    spec = spec_of({"scheme": "standard"}, secret)
    svix = {"svix-id": msg_id, "svix-timestamp": str(ts), "svix-signature": sig}
    assert check(spec, svix, body, ts) is None
    webhook = {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sig}
    assert check(spec, webhook, body, ts) is None
    # A sender that sends both (or a proxy that copies them) is fine while they agree.
    assert check(spec, {**svix, **webhook}, body, ts) is None
    assert check(spec, svix, body, ts + 301) == "timestamp outside tolerance (300 s)"


SVIX = {"svix-id": SVIX_ID, "svix-timestamp": str(SVIX_TS), "svix-signature": SVIX_SIG}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # An unsigned webhook-id beside the signed svix-id: a trigger reading
        # `webhook-id` would take an id nobody signed, so the delivery is refused.
        ({"webhook-id": "msg_other"}, "headers webhook-id and svix-id differ"),
        (
            {"webhook-timestamp": str(SVIX_TS + 1)},
            "headers webhook-timestamp and svix-timestamp differ",
        ),
        ({"webhook-signature": "v1,AAAA"}, "headers webhook-signature and svix-signature differ"),
        ({"svix-id": "msg_other"}, "signature mismatch"),
        ({"svix-signature": None}, "missing header svix-signature"),
        ({"svix-timestamp": "soon"}, "malformed header svix-timestamp"),
        ({"svix-signature": "v1a," + SVIX_SIG[3:]}, "no v1 signature in svix-signature"),
        ({"svix-id": ""}, "empty header svix-id"),
        # Mixed names with nothing sent twice: each value is used under the name it has.
        ({"svix-signature": None, "webhook-signature": SVIX_SIG}, None),
    ],
)
def test_svix_refusals(change: dict[str, str | None], reason: str | None) -> None:
    headers = {k: v for k, v in {**SVIX, **change}.items() if v is not None}
    assert check(STANDARD, headers, SVIX_BODY, SVIX_TS) == reason


def test_svix_repeated_and_missing_headers() -> None:
    raw = [(k.encode(), v.encode()) for k, v in SVIX.items()]
    twice = Headers(raw=[*raw, (b"svix-signature", SVIX_SIG.encode())])
    assert check(STANDARD, twice, SVIX_BODY, SVIX_TS) == "header svix-signature repeated"
    # With neither name the message names the standard one, as before.
    assert check(STANDARD, {}, SVIX_BODY, SVIX_TS) == "missing header webhook-id"


# --------------------------------------------------------------------------- hmac with a timestamp


def test_hmac_can_describe_slack_and_verifies_its_published_example() -> None:
    as_hmac = spec_of(
        {
            "scheme": "hmac",
            "header": "X-Slack-Signature",
            "prefix": "v0=",
            "timestamp_header": "X-Slack-Request-Timestamp",
            "signed_payload": "v0:{timestamp}:{body}",
        },
        SLACK_SECRET,
    )
    assert check(as_hmac, SLACK_HEADERS, SLACK_BODY, SLACK_TS) is None
    assert sign(as_hmac, SLACK_BODY, SLACK_TS) == SLACK_HEADERS


def test_hmac_timestamp_default_payload_matches_stdlib() -> None:
    headers = sign(TIMED, BODY, NOW + 0.7)
    ts = str(int(NOW))
    expected = hmac.new(b"acme-secret", ts.encode() + b"." + BODY, hashlib.sha256).hexdigest()
    assert headers == {"X-Acme-Signature": "v1=" + expected, "X-Acme-Timestamp": ts}
    assert TIMED.signed_payload == "{timestamp}.{body}"
    assert check(TIMED, headers, BODY, NOW) is None
    assert check(TIMED, headers, BODY, NOW + 301) == "timestamp outside tolerance (300 s)"
    moved = {**headers, "X-Acme-Timestamp": str(int(NOW) + 60)}
    assert check(TIMED, moved, BODY, NOW) == "signature mismatch"
    assert check(TIMED, {"X-Acme-Signature": headers["X-Acme-Signature"]}, BODY, NOW) == (
        "missing header X-Acme-Timestamp"
    )
    assert check(TIMED, {**headers, "X-Acme-Timestamp": "1e9"}, BODY, NOW) == (
        "malformed header X-Acme-Timestamp"
    )


def test_hmac_template_with_text_around_and_base64_sha512() -> None:
    spec = spec_of(
        {
            "scheme": "hmac",
            "header": "X-Sig",
            "algorithm": "sha512",
            "encoding": "base64",
            "timestamp_header": "X-Time",
            "signed_payload": "POST /hooks|{body}|t={timestamp}|end",
            "tolerance": 60,
        },
        "k",
    )
    ts = str(int(NOW))
    message = b"POST /hooks|" + BODY + b"|t=" + ts.encode() + b"|end"
    expected = base64.b64encode(hmac.new(b"k", message, hashlib.sha512).digest()).decode()
    assert sign(spec, BODY, NOW) == {"X-Sig": expected, "X-Time": ts}
    assert check(spec, {"X-Sig": expected, "X-Time": ts}, BODY, NOW + 60) is None
    assert check(spec, {"X-Sig": expected, "X-Time": ts}, BODY, NOW + 61) == (
        "timestamp outside tolerance (60 s)"
    )


def test_hmac_without_timestamp_is_unchanged() -> None:
    spec = spec_of({"scheme": "hmac", "header": "X-Sig"}, "k")
    assert spec.signed_payload == "{body}" and spec.timestamp_header is None
    expected = hmac.new(b"k", BODY, hashlib.sha256).hexdigest()
    assert sign(spec, BODY, NOW) == {"X-Sig": expected}
    assert check(spec, {"X-Sig": expected}, BODY, 0.0) is None


# --------------------------------------------------------------------------- config


ENV = {"GOOD": SECRET}


@pytest.mark.parametrize(
    ("raw", "fld", "message"),
    [
        (
            {"scheme": "slack", "header": "X-Sig"},
            "verify.header",
            "is not a setting of scheme slack; allowed: scheme, secret_env, tolerance",
        ),
        (
            {"scheme": "slack", "signed_payload": "{body}"},
            "verify.signed_payload",
            "is not a setting of scheme slack; allowed: scheme, secret_env, tolerance",
        ),
        (
            {"scheme": "shopify", "tolerance": 300},
            "verify.tolerance",
            "is not a setting of scheme shopify; allowed: scheme, secret_env",
        ),
        (
            {"scheme": "shopify", "encoding": "hex"},
            "verify.encoding",
            "is not a setting of scheme shopify; allowed: scheme, secret_env",
        ),
        (
            {"scheme": "gitlab", "header": "X-Gitlab-Token"},
            "verify.header",
            "is not a setting of scheme gitlab; allowed: scheme, secret_env",
        ),
        (
            {"scheme": "token", "header": "X-T", "timestamp_header": "X-Time"},
            "verify.timestamp_header",
            "is not a setting of scheme token; allowed: scheme, secret_env, header",
        ),
        (
            {"scheme": "slack", "tolerance": 0},
            "verify.tolerance",
            "must be a positive whole number of seconds, got 0",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "tolerance": 60},
            "verify.tolerance",
            "applies only with timestamp_header: scheme hmac signs no timestamp without it",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "timestamp_header": "X Time"},
            "verify.timestamp_header",
            "must be a header name, got 'X Time'",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "timestamp_header": "x-s"},
            "verify.timestamp_header",
            "must differ from header (X-S): the timestamp and the signature travel in two headers",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "signed_payload": "{timestamp}.{body}"},
            "verify.signed_payload",
            "uses {timestamp}, which needs timestamp_header (the header that carries it) "
            "(got '{timestamp}.{body}')",
        ),
        (
            {
                "scheme": "hmac",
                "header": "X-S",
                "timestamp_header": "X-T",
                "signed_payload": "{body}",
            },
            "verify.signed_payload",
            "must contain {timestamp}: the timestamp_header's value counts only if it is "
            "signed (got '{body}')",
        ),
        (
            {
                "scheme": "hmac",
                "header": "X-S",
                "timestamp_header": "X-T",
                "signed_payload": "{timestamp}.",
            },
            "verify.signed_payload",
            "must contain {body} (got '{timestamp}.')",
        ),
        (
            {
                "scheme": "hmac",
                "header": "X-S",
                "timestamp_header": "X-T",
                "signed_payload": "{id}.{timestamp}.{body}",
            },
            "verify.signed_payload",
            "unknown placeholder {id}; the placeholders are {timestamp} and {body} "
            "(got '{id}.{timestamp}.{body}')",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "signed_payload": "{body}{body}"},
            "verify.signed_payload",
            "has {body} twice (got '{body}{body}')",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "signed_payload": "{{body}}"},
            "verify.signed_payload",
            "has a '{' or '}' outside a placeholder; the placeholders are {timestamp} and "
            "{body} (got '{{body}}')",
        ),
        (
            {"scheme": "hmac", "header": "X-S", "signed_payload": 5},
            "verify.signed_payload",
            "must be a string such as '{timestamp}.{body}', got 5",
        ),
    ],
)
def test_parse_errors(raw: dict[str, Any], fld: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_verify({**raw, "secret_env": "GOOD"}, file=FILE, trigger="x", env=ENV)
    assert str(info.value) == f"{FILE}: trigger 'x': field '{fld}': {message}"
    assert (info.value.section, info.value.name, info.value.field) == ("trigger", "x", fld)
    assert SECRET not in repr(info.value)


def test_unknown_scheme_lists_the_new_ones() -> None:
    with pytest.raises(ConfigError) as info:
        parse_verify({"scheme": "svix", "secret_env": "GOOD"}, file=FILE, trigger="x", env=ENV)
    assert str(info.value).endswith(
        "unknown scheme 'svix'; one of github, stripe, standard, hmac, token, none, "
        "slack, shopify, gitlab, zoom, meta, paddle, linear, square, twilio, twitter, "
        "discord, sns"
    )


def test_presets_fill_their_fields_and_refuse_others() -> None:
    assert (SLACK.header, SLACK.prefix, SLACK.timestamp_header, SLACK.signed_payload) == (
        "X-Slack-Signature",
        "v0=",
        "X-Slack-Request-Timestamp",
        "v0:{timestamp}:{body}",
    )
    assert (SHOPIFY.header, SHOPIFY.encoding, SHOPIFY.prefix) == (
        "X-Shopify-Hmac-Sha256",
        "base64",
        "",
    )
    assert GITLAB.header == "X-Gitlab-Token"
    # Built directly (as handlers.py builds its signer), a preset fills itself in too.
    direct = VerifySpec(scheme="slack", secret_env=("S",), secrets=(SLACK_SECRET,))
    assert direct.header == "X-Slack-Signature"
    assert verify(direct, Headers(SLACK_HEADERS), SLACK_BODY, SLACK_TS) is None
    with pytest.raises(ValueError, match="scheme slack fixes encoding itself"):
        VerifySpec(scheme="slack", secret_env=("S",), secrets=("x",), encoding="base64")
    with pytest.raises(ValueError, match="scheme gitlab fixes header itself"):
        VerifySpec(scheme="gitlab", secret_env=("S",), secrets=("x",), header="X-Token")
    with pytest.raises(ValueError, match=re.escape("must contain {timestamp}")):
        VerifySpec(scheme="hmac", secret_env=("S",), secrets=("x",), header="X-S",
                   timestamp_header="X-T", signed_payload="{body}")  # fmt: skip


def test_describe() -> None:
    assert describe(SLACK) == "slack"
    assert describe(spec_of({"scheme": "slack", "tolerance": 120}, "s")) == "slack ±120 s"
    assert describe(SHOPIFY) == "shopify"
    assert describe(GITLAB) == "gitlab"
    assert describe(TIMED) == "hmac sha256 hex X-Acme-Signature, timestamp X-Acme-Timestamp ±300 s"


@pytest.mark.parametrize("raw", [{"scheme": "slack"}, {"scheme": "shopify"}, {"scheme": "gitlab"}])
def test_secret_never_in_repr_describe_or_reasons(raw: dict[str, Any]) -> None:
    spec = parse_verify({**raw, "secret_env": "GOOD"}, file=FILE, trigger="x", env=ENV)
    assert SECRET not in repr(spec) and SECRET not in describe(spec)
    signed = sign(spec, BODY, NOW)
    name = spec.header or ""
    bad = {**signed, name: signed[name][:-1] + ("0" if signed[name][-1] != "0" else "1")}
    reason = check(spec, bad, BODY, NOW)
    assert reason in ("signature mismatch", "token mismatch")
    assert SECRET not in (reason or "") and signed[name] not in (reason or "")


# --------------------------------------------------------------------------- replay guard


def _trigger(verify_yaml: str, extra: str = "") -> dict[str, Any]:
    return yaml.safe_load(
        f"t:\n  workflow: w\n  path: /hooks/x\n  verify: {verify_yaml}\n"
        f"  event_id: {{header: X-Id}}\n{extra}"
    )


REPLAY_DEFAULTS = [
    # Body alone signed, event id in an unsigned header (X-Shopify-Webhook-Id): on.
    ("{scheme: shopify, secret_env: S}", True),
    # The token travels in every delivery: a replayer could forge any body. Off.
    ("{scheme: gitlab, secret_env: S}", False),
    # Timestamped, but the event id may come from an unsigned header: allowed, off.
    ("{scheme: hmac, secret_env: S, header: X-S, timestamp_header: X-T}", False),
]


@pytest.mark.parametrize(("verify_yaml", "default"), REPLAY_DEFAULTS)
def test_replay_guard_defaults(verify_yaml: str, default: bool) -> None:
    raw = _trigger(verify_yaml)
    env = {"S": "secret"}
    assert parse_triggers(raw, file=FILE, workflows=("w",), env=env)["t"].replay_guard is default
    raw["t"]["replay_guard"] = not default
    flipped = parse_triggers(raw, file=FILE, workflows=("w",), env=env)["t"]
    assert flipped.replay_guard is not default


def test_replay_guard_is_refused_for_slack() -> None:
    off = parse_triggers(
        _trigger("{scheme: slack, secret_env: S}"), file=FILE, workflows=("w",), env={"S": "s"}
    )
    assert off["t"].replay_guard is False
    with pytest.raises(ConfigError) as refused:
        parse_triggers(
            _trigger("{scheme: slack, secret_env: S}", "  replay_guard: true\n"),
            file=FILE,
            workflows=("w",),
            env={"S": "s"},
        )
    assert str(refused.value) == (
        f"{FILE}: trigger 't': field 'replay_guard': is not needed with scheme slack: "
        "it signs a timestamp and the event id"
    )


# --------------------------------------------------------------------------- docs


def test_the_docs_more_senders_examples_parse() -> None:
    text = TRIGGERS_DOC.read_text()
    part = text[text.index("**More senders.**") :]
    part = part[: part.index("`secret_env` names one variable")]
    examples = re.findall(r"^```yaml\n(.*?)^```", part, re.M | re.S)
    assert len(examples) == 2
    triggers: dict[str, Any] = {}
    for example in examples:
        triggers.update(yaml.safe_load(example))
    env = {
        "SLACK_SIGNING_SECRET": "s",
        "SHOPIFY_CLIENT_SECRET": "s",
        "GITLAB_WEBHOOK_TOKEN": "s",
        "ACME_SECRET": "s",
    }
    workflows = ("notify", "fulfil", "deploy", "sync")
    parsed = parse_triggers(triggers, file="docs/triggers.md", workflows=workflows, env=env)
    assert {name: describe(t.verify) for name, t in parsed.items()} == {
        "slack-command": "slack",
        "shopify-orders": "shopify",
        "gitlab-push": "gitlab",
        "acme-events": "hmac sha256 hex X-Acme-Signature, timestamp X-Acme-Timestamp ±300 s",
    }
