"""Signature schemes (gateway/signatures/): fixture vectors, official values, round trips,
rotation, hostile headers and config errors. Pure: no Redis, no network."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.datastructures import Headers

from gateway.model.errors import ConfigError
from gateway.signatures.parse import parse_verify
from gateway.signatures.sign import sign
from gateway.signatures.spec import VerifySpec, describe
from gateway.signatures.verify import verify

# Payloads and vectors kept with the tests (tests/payloads/README.md says where from).
PAYLOADS = Path(__file__).resolve().parent / "payloads"
VECTORS_FILE = PAYLOADS / "vectors.json"

FILE = "triggers.yaml"
NOW = 1_735_689_600.0

# How each fixture vector's sender maps onto a scheme of ours. Slack is left out
# on purpose: it signs "v0:<ts>:<body>", which no built-in scheme reproduces
# (the plain `hmac` scheme signs the body alone).
VECTOR_SCHEMES: dict[str, dict[str, Any]] = {
    "github": {"scheme": "github"},
    "stripe": {"scheme": "stripe"},
    "standard-webhooks": {"scheme": "standard"},
    "gitlab": {"scheme": "token", "header": "X-Gitlab-Token"},
}
UNSUPPORTED_VECTOR_SCHEMES = {"slack"}


def _load_vectors() -> list[Any]:
    data = json.loads(VECTORS_FILE.read_text())
    return [
        pytest.param(v, id=v["id"])
        for v in data["vectors"]
        if v["scheme"] not in UNSUPPORTED_VECTOR_SCHEMES
    ]


VECTORS = _load_vectors()
VALID_VECTORS = [p for p in VECTORS if p.values[0]["expected_valid"]]


def make_spec(raw: dict[str, Any], *secrets: str) -> VerifySpec:
    """Parse ``raw`` with secrets in variables S0, S1, ... (listed in that order)."""
    env = {f"S{i}": s for i, s in enumerate(secrets)}
    body = dict(raw)
    if raw.get("scheme") != "none":
        body["secret_env"] = list(env)
    return parse_verify(body, file=FILE, trigger="x", env=env)


def hdrs(mapping: dict[str, str]) -> Headers:
    return Headers(headers=mapping)


def std_secret(seed: str) -> str:
    return "whsec_" + base64.b64encode(hashlib.sha256(seed.encode()).digest()[:24]).decode()


# --------------------------------------------------------------------------- vectors


@pytest.mark.parametrize("vector", VECTORS)
def test_fixture_vector(vector: dict[str, Any]) -> None:
    spec = make_spec(VECTOR_SCHEMES[vector["scheme"]], vector["secret"])
    body = (PAYLOADS / vector["body_file"]).read_bytes()
    now = float(vector.get("verify_at", vector.get("timestamp", NOW)))
    reason = verify(spec, hdrs(vector["headers"]), body, now)
    if vector["expected_valid"]:
        assert reason is None, reason
    else:
        assert reason is not None


@pytest.mark.parametrize("vector", VALID_VECTORS)
def test_sign_reproduces_fixture_vector(vector: dict[str, Any]) -> None:
    """Our sender side produces byte-identical headers to the published/derived ones."""
    spec = make_spec(VECTOR_SCHEMES[vector["scheme"]], vector["secret"])
    body = (PAYLOADS / vector["body_file"]).read_bytes()
    now = float(vector.get("timestamp", NOW))
    event_id = vector["headers"].get("webhook-id")
    produced = sign(spec, body, now, event_id=event_id)
    for name, value in produced.items():
        assert vector["headers"][name] == value


def test_every_fixture_scheme_is_covered() -> None:
    schemes = {v["scheme"] for v in json.loads(VECTORS_FILE.read_text())["vectors"]}
    assert schemes <= set(VECTOR_SCHEMES) | UNSUPPORTED_VECTOR_SCHEMES


# Published values, written here so they run without the fixtures folder.


def test_github_official_hello_world() -> None:
    # docs.github.com "Validating webhook deliveries": secret, body and signature.
    spec = make_spec({"scheme": "github"}, "It's a Secret to Everybody")
    sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert sign(spec, b"Hello, World!", NOW) == {"X-Hub-Signature-256": sig}
    assert verify(spec, hdrs({"X-Hub-Signature-256": sig}), b"Hello, World!", NOW) is None


@pytest.mark.parametrize(
    ("secret", "msg_id", "ts", "body", "sig"),
    [
        # standard-webhooks python/go/js/... test_sign_function
        (
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            b'{"test": 2432232314}',
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
        ),
        # standard-webhooks rust test_sign
        (
            "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
            "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
            1649367553,
            b'{"email":"test@example.com","username":"test_user"}',
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
        ),
    ],
)
def test_standard_webhooks_official(
    secret: str, msg_id: str, ts: int, body: bytes, sig: str
) -> None:
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sig}
    for s in (secret, secret.removeprefix("whsec_")):  # raw base64 is accepted too
        spec = make_spec({"scheme": "standard"}, s)
        assert sign(spec, body, ts, event_id=msg_id) == headers
        assert verify(spec, hdrs(headers), body, ts) is None


# --------------------------------------------------------------------------- round trips

BODY = b'{"id":"evt_1","ref":"refs/heads/main","n":[1,2,3]}'

# One spec per scheme (plus hmac variants): (raw verify block, secrets).
ROUND_TRIP: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "github": ({"scheme": "github"}, ("gh-secret",)),
    "stripe": ({"scheme": "stripe"}, ("whsec_stripe_secret",)),
    "standard": ({"scheme": "standard"}, (std_secret("std"),)),
    "hmac-sha256-hex": (
        {"scheme": "hmac", "header": "X-Signature", "prefix": "sha256="},
        ("hm-secret",),
    ),
    "hmac-sha1-base64": (
        {"scheme": "hmac", "header": "X-Sig", "algorithm": "sha1", "encoding": "base64"},
        ("hm-secret",),
    ),
    "hmac-sha512-hex": (
        {"scheme": "hmac", "header": "X-Sig", "algorithm": "sha512"},
        ("hm-secret",),
    ),
    "token": ({"scheme": "token", "header": "X-Gitlab-Token"}, ("tok-secret",)),
}
SIGNED = [k for k in ROUND_TRIP if k != "token"]


def spec_for(name: str) -> VerifySpec:
    raw, secrets = ROUND_TRIP[name]
    return make_spec(raw, *secrets)


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_round_trip(name: str) -> None:
    spec = spec_for(name)
    headers = sign(spec, BODY, NOW)
    assert headers
    assert verify(spec, hdrs(headers), BODY, NOW) is None
    # Header names are case-insensitive on the wire.
    lowered = {k.lower(): v for k, v in headers.items()}
    assert verify(spec, hdrs(lowered), BODY, NOW) is None


def test_round_trip_none() -> None:
    spec = make_spec({"scheme": "none"})
    assert sign(spec, BODY, NOW) == {}
    assert verify(spec, hdrs({}), BODY, NOW) is None
    assert verify(spec, hdrs({}), b"anything", 0.0) is None


def test_sign_header_shapes() -> None:
    assert list(sign(spec_for("github"), BODY, NOW)) == ["X-Hub-Signature-256"]
    stripe = sign(spec_for("stripe"), BODY, NOW + 0.9)["Stripe-Signature"]
    assert stripe.startswith(f"t={int(NOW)},v1=")
    std = sign(spec_for("standard"), BODY, NOW)
    assert std["webhook-id"].startswith("msg_")
    assert std["webhook-timestamp"] == str(int(NOW))
    assert std["webhook-signature"].startswith("v1,")
    assert sign(spec_for("standard"), BODY, NOW, event_id="msg_x")["webhook-id"] == "msg_x"
    assert sign(spec_for("hmac-sha256-hex"), BODY, NOW)["X-Signature"].startswith("sha256=")
    assert sign(spec_for("token"), BODY, NOW) == {"X-Gitlab-Token": "tok-secret"}


def test_hmac_digest_matches_stdlib() -> None:
    spec = spec_for("hmac-sha1-base64")
    expected = base64.b64encode(hmac.new(b"hm-secret", BODY, "sha1").digest()).decode()
    assert sign(spec, BODY, NOW) == {"X-Sig": expected}


def test_hex_case_is_ignored() -> None:
    for name in ("github", "hmac-sha256-hex"):
        spec = spec_for(name)
        ((header, value),) = sign(spec, BODY, NOW).items()
        prefix, digest = value.split("=", 1)
        upper = {header: f"{prefix}={digest.upper()}"}
        assert verify(spec, hdrs(upper), BODY, NOW) is None


# --------------------------------------------------------------------------- rotation

ROTATION: dict[str, tuple[dict[str, Any], str, str, str]] = {
    # raw, new secret, old secret, unrelated secret
    "github": ({"scheme": "github"}, "gh-new", "gh-old", "gh-other"),
    "stripe": ({"scheme": "stripe"}, "whsec_new", "whsec_old", "whsec_other"),
    "standard": ({"scheme": "standard"}, std_secret("n"), std_secret("o"), std_secret("x")),
    "hmac": ({"scheme": "hmac", "header": "X-Sig"}, "hm-new", "hm-old", "hm-other"),
    "token": ({"scheme": "token", "header": "X-Token"}, "tk-new", "tk-old", "tk-other"),
}


@pytest.mark.parametrize("name", list(ROTATION))
def test_rotation(name: str) -> None:
    raw, new, old, other = ROTATION[name]
    signed_by_old = hdrs(sign(make_spec(raw, old), BODY, NOW))
    signed_by_new = hdrs(sign(make_spec(raw, new), BODY, NOW))
    both = make_spec(raw, new, old)
    assert both.secret_env == ("S0", "S1")
    assert verify(both, signed_by_old, BODY, NOW) is None
    assert verify(both, signed_by_new, BODY, NOW) is None
    assert verify(make_spec(raw, new), signed_by_old, BODY, NOW) is not None
    assert verify(make_spec(raw, new, other), signed_by_old, BODY, NOW) is not None
    # sign() uses the first listed secret.
    assert sign(both, BODY, NOW, event_id="msg_1") == sign(
        make_spec(raw, new), BODY, NOW, event_id="msg_1"
    )


def test_stripe_rotation_header_with_two_v1_and_v0() -> None:
    old = make_spec({"scheme": "stripe"}, "whsec_old")
    new = make_spec({"scheme": "stripe"}, "whsec_new")
    v_old = sign(old, BODY, NOW)["Stripe-Signature"].split("v1=")[1]
    v_new = sign(new, BODY, NOW)["Stripe-Signature"].split("v1=")[1]
    header = {"Stripe-Signature": f"t={int(NOW)},v1={v_new},v1={v_old},v0=deadbeef"}
    assert verify(old, hdrs(header), BODY, NOW) is None
    assert verify(new, hdrs(header), BODY, NOW) is None
    assert verify(make_spec({"scheme": "stripe"}, "whsec_x"), hdrs(header), BODY, NOW)


def test_standard_multiple_signatures_any_matches() -> None:
    spec = spec_for("standard")
    headers = sign(spec, BODY, NOW)
    good = headers["webhook-signature"]
    headers["webhook-signature"] = f"v1a,AAAA v1,bm9wZQ==  {good}"
    assert verify(spec, hdrs(headers), BODY, NOW) is None


# --------------------------------------------------------------------------- negatives


def _reason(spec: VerifySpec, headers: dict[str, str] | Headers, body: bytes = BODY) -> str:
    h = headers if isinstance(headers, Headers) else hdrs(headers)
    reason = verify(spec, h, body, NOW)
    assert reason is not None
    return reason


@pytest.mark.parametrize("name", SIGNED)
def test_flipped_body_byte(name: str) -> None:
    spec = spec_for(name)
    headers = sign(spec, BODY, NOW)
    tampered = bytearray(BODY)
    tampered[10] ^= 0x01
    assert _reason(spec, headers, bytes(tampered)) == "signature mismatch"


def test_token_mismatch() -> None:
    spec = spec_for("token")
    assert _reason(spec, {"X-Gitlab-Token": "tok-secreT"}) == "token mismatch"
    assert _reason(spec, {"X-Gitlab-Token": "tok-secret."}) == "token mismatch"
    # Spaces and tabs around a field value are not part of it (RFC 9110 5.5).
    assert verify(spec, hdrs({"X-Gitlab-Token": "tok-secret \t"}), BODY, NOW) is None
    assert _reason(spec, {"X-Gitlab-Token": "tok-secre"}) == "token mismatch"


def _signature_header(name: str) -> str:
    return {"github": "X-Hub-Signature-256", "stripe": "Stripe-Signature"}.get(
        name,
        "webhook-signature"
        if name == "standard"
        else ROUND_TRIP[name][0].get("header", "X-Gitlab-Token"),
    )


@pytest.mark.parametrize("name", SIGNED)
def test_truncated_signature(name: str) -> None:
    spec = spec_for(name)
    headers = sign(spec, BODY, NOW)
    key = _signature_header(name)
    headers[key] = headers[key][:-2]
    assert _reason(spec, headers) == "signature mismatch"


def test_wrong_prefix() -> None:
    gh = spec_for("github")
    value = sign(gh, BODY, NOW)["X-Hub-Signature-256"]
    digest = value.removeprefix("sha256=")
    assert "prefix" in _reason(gh, {"X-Hub-Signature-256": "sha1=" + digest})
    assert "prefix" in _reason(gh, {"X-Hub-Signature-256": digest})
    hm = spec_for("hmac-sha256-hex")
    value = sign(hm, BODY, NOW)["X-Signature"]
    assert "prefix" in _reason(hm, {"X-Signature": value.removeprefix("sha256=")})
    assert "prefix" in _reason(hm, {"X-Signature": "SHA256=" + value[7:]})


def test_github_sha1_only_rejected() -> None:
    gh = make_spec({"scheme": "github"}, "It's a Secret to Everybody")
    sha1 = "sha1=" + hmac.new(b"It's a Secret to Everybody", b"Hello, World!", "sha1").hexdigest()
    assert sha1 == "sha1=01dc10d0c83e72ed246219cdd91669667fe2ca59"
    reason = _reason(gh, {"X-Hub-Signature": sha1}, b"Hello, World!")
    assert reason.startswith("missing header X-Hub-Signature-256")
    # A valid sha1 next to a bad sha256 does not rescue the delivery.
    both = {"X-Hub-Signature": sha1, "X-Hub-Signature-256": "sha256=" + "0" * 64}
    assert _reason(gh, both, b"Hello, World!") == "signature mismatch"


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_missing_header(name: str) -> None:
    spec = spec_for(name)
    reason = _reason(spec, {"Content-Type": "application/json"})
    assert reason.startswith("missing header ")


@pytest.mark.parametrize("name", list(ROUND_TRIP))
@pytest.mark.parametrize("blank", ["", "   "])
def test_empty_header(name: str, blank: str) -> None:
    spec = spec_for(name)
    headers = sign(spec, BODY, NOW)
    key = _signature_header(name)
    headers[key] = blank
    assert _reason(spec, headers) == f"empty header {key}"


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_repeated_header(name: str) -> None:
    spec = spec_for(name)
    headers = sign(spec, BODY, NOW)
    key = _signature_header(name)
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    # Even two identical, valid copies are refused: a second copy means someone
    # on the path added a header, and which one counts would be a guess.
    raw.append((key.lower().encode(), headers[key].encode()))
    assert _reason(spec, Headers(raw=raw)) == f"header {key} repeated"


def test_repeated_github_header_raw() -> None:
    gh = make_spec({"scheme": "github"}, "It's a Secret to Everybody")
    good = b"sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    headers = Headers(raw=[(b"x-hub-signature-256", good), (b"x-hub-signature-256", b"sha256=00")])
    assert verify(gh, headers, b"Hello, World!", NOW) == "header X-Hub-Signature-256 repeated"


def test_stripe_tolerance() -> None:
    spec = spec_for("stripe")
    headers = sign(spec, BODY, NOW)
    assert verify(spec, hdrs(headers), BODY, NOW + 300) is None
    assert verify(spec, hdrs(headers), BODY, NOW - 300) is None
    assert verify(spec, hdrs(headers), BODY, NOW + 301) == "timestamp outside tolerance (300 s)"
    # Signed 10 minutes in the future (relative to our clock): refused as well.
    assert verify(spec, hdrs(headers), BODY, NOW - 600) == "timestamp outside tolerance (300 s)"
    wide = make_spec({"scheme": "stripe", "tolerance": 900}, "whsec_stripe_secret")
    assert verify(wide, hdrs(headers), BODY, NOW + 600) is None
    assert verify(wide, hdrs(headers), BODY, NOW + 901) == "timestamp outside tolerance (900 s)"


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "v1=abc",  # no timestamp
        "t=,v1=abc",
        "t=12x,v1=abc",
        "t=-5,v1=abc",
        "t=1735689600,t=1735689600,v1=abc",
        "t=1735689600,,v1=abc",
    ],
)
def test_stripe_malformed(value: str) -> None:
    assert _reason(spec_for("stripe"), {"Stripe-Signature": value}) == (
        "malformed header Stripe-Signature"
    )


def test_stripe_v0_only() -> None:
    spec = spec_for("stripe")
    v1 = sign(spec, BODY, NOW)["Stripe-Signature"].split("v1=")[1]
    header = {"Stripe-Signature": f"t={int(NOW)},v0={v1}"}
    assert _reason(spec, header) == "no v1 signature in Stripe-Signature"


def test_stripe_timestamp_is_signed() -> None:
    spec = spec_for("stripe")
    value = sign(spec, BODY, NOW)["Stripe-Signature"]
    moved = value.replace(f"t={int(NOW)}", f"t={int(NOW) + 1}")
    assert _reason(spec, {"Stripe-Signature": moved}) == "signature mismatch"


def test_standard_id_changed_after_signing() -> None:
    spec = spec_for("standard")
    headers = sign(spec, BODY, NOW, event_id="msg_original")
    headers["webhook-id"] = "msg_other"
    assert _reason(spec, headers) == "signature mismatch"


def test_standard_timestamp_changed_or_stale() -> None:
    spec = spec_for("standard")
    headers = sign(spec, BODY, NOW)
    assert verify(spec, hdrs(headers), BODY, NOW + 300) is None
    assert verify(spec, hdrs(headers), BODY, NOW + 301) == "timestamp outside tolerance (300 s)"
    assert verify(spec, hdrs(headers), BODY, NOW - 301) == "timestamp outside tolerance (300 s)"
    moved = dict(headers, **{"webhook-timestamp": str(int(NOW) + 1)})
    assert _reason(spec, moved) == "signature mismatch"
    bad = dict(headers, **{"webhook-timestamp": "soon"})
    assert _reason(spec, bad) == "malformed header webhook-timestamp"


def test_standard_v1a_only() -> None:
    spec = spec_for("standard")
    headers = sign(spec, BODY, NOW)
    sig = headers["webhook-signature"].removeprefix("v1,")
    headers["webhook-signature"] = f"v1a,{sig}"
    assert _reason(spec, headers) == "no v1 signature in webhook-signature"


@pytest.mark.parametrize("name", SIGNED)
def test_reserialised_body(name: str) -> None:
    # A proxy or framework that parses and re-dumps JSON changes the bytes.
    pretty = b'{\n  "id": "evt_1",\n  "ok": true\n}\n'
    spec = spec_for(name)
    headers = sign(spec, pretty, NOW)
    redone = json.dumps(json.loads(pretty)).encode()
    assert redone != pretty
    assert _reason(spec, headers, redone) == "signature mismatch"


def test_reserialised_fixture_body() -> None:
    body = (PAYLOADS / "github" / "push.json").read_bytes()
    spec = spec_for("github")
    headers = sign(spec, body, NOW)
    assert verify(spec, hdrs(headers), body, NOW) is None
    assert _reason(spec, headers, json.dumps(json.loads(body)).encode()) == "signature mismatch"


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_reasons_hold_no_secret_or_signature(name: str) -> None:
    spec = spec_for(name)
    headers = sign(spec, BODY, NOW)
    key = _signature_header(name)
    sent = headers[key]
    bad = dict(headers, **{key: sent[:-1] + ("0" if sent[-1] != "0" else "1")})
    reasons = [_reason(spec, bad), _reason(spec, {key: "x"})]
    if name != "token":
        reasons.append(_reason(spec, headers, BODY + b"x"))
    for reason in reasons:
        assert spec.secrets[0] not in reason
        assert sent[-16:] not in reason
        assert bad[key][-16:] not in reason


class PlainHeaders:
    """A non-Starlette header source whose values may hold any text."""

    def __init__(self, values: dict[str, list[str]]) -> None:
        self.values = values

    def getlist(self, key: str) -> list[str]:
        return self.values.get(key.lower(), [])


def test_non_latin1_header_value_does_not_crash() -> None:
    spec = spec_for("token")
    assert verify(spec, PlainHeaders({"x-gitlab-token": ["tök-€"]}), BODY, NOW) == "token mismatch"
    gh = spec_for("github")
    odd = PlainHeaders({"x-hub-signature-256": ["sha256=€€"]})
    assert verify(gh, odd, BODY, NOW) == "signature mismatch"
    ok = PlainHeaders({k.lower(): [v] for k, v in sign(gh, BODY, NOW).items()})
    assert verify(gh, ok, BODY, NOW) is None


# --------------------------------------------------------------------------- parse_verify

SECRET = "s3cr3t-VALUE-never-shown"
ENV = {"GOOD": SECRET, "EMPTY": "", "STD": std_secret("ok"), "BADSTD": "whsec_" + SECRET + "!"}


@pytest.mark.parametrize(
    ("raw", "fld", "fragment"),
    [
        (None, "verify", "scheme: none"),
        ("github", "verify", "mapping"),
        ({}, "verify.scheme", "missing"),
        ({"scheme": "bogus", "secret_env": "GOOD"}, "verify.scheme", "unknown scheme"),
        ({"scheme": 3}, "verify.scheme", "github, stripe, standard, hmac, token, none"),
        ({"scheme": "github", "secret_env": "GOOD", "extra": 1}, "verify.extra", "allowed"),
        ({"scheme": "github", "secret_env": "GOOD", "tolerance": 60}, "verify.tolerance", ""),
        ({"scheme": "github", "secret_env": "GOOD", "header": "X"}, "verify.header", ""),
        ({"scheme": "none", "secret_env": "GOOD"}, "verify.secret_env", "scheme none"),
        ({"scheme": "github"}, "verify.secret_env", "required"),
        ({"scheme": "github", "secret_env": []}, "verify.secret_env", "non-empty"),
        ({"scheme": "github", "secret_env": 5}, "verify.secret_env", "variable name"),
        ({"scheme": "github", "secret_env": [SECRET]}, "verify.secret_env", "variable names"),
        ({"scheme": "github", "secret_env": ["GOOD", "GOOD"]}, "verify.secret_env", "twice"),
        (
            {"scheme": "github", "secret_env": ["GOOD", "UNSET_VAR"]},
            "verify.secret_env",
            "environment variable UNSET_VAR is not set",
        ),
        (
            {"scheme": "github", "secret_env": "EMPTY"},
            "verify.secret_env",
            "environment variable EMPTY is empty",
        ),
        ({"scheme": "github", "secret": SECRET}, "verify.secret", "use secret_env"),
        (
            {"scheme": "github", "secret_env": "GOOD", "secret": SECRET},
            "verify.secret",
            "secrets come only from environment variables; use secret_env",
        ),
        (
            {"scheme": "hmac", "secret_env": "GOOD", "header": "X-S", "algorithm": "md5"},
            "verify.algorithm",
            "sha256, sha1, sha512",
        ),
        (
            {"scheme": "hmac", "secret_env": "GOOD", "header": "X-S", "encoding": "base32"},
            "verify.encoding",
            "hex, base64",
        ),
        ({"scheme": "hmac", "secret_env": "GOOD"}, "verify.header", "required"),
        ({"scheme": "token", "secret_env": "GOOD"}, "verify.header", "required"),
        ({"scheme": "token", "secret_env": "GOOD", "header": "X Tok"}, "verify.header", ""),
        ({"scheme": "token", "secret_env": "GOOD", "header": ""}, "verify.header", ""),
        (
            {"scheme": "hmac", "secret_env": "GOOD", "header": "X-S", "prefix": 5},
            "verify.prefix",
            "string",
        ),
        ({"scheme": "stripe", "secret_env": "GOOD", "tolerance": 0}, "verify.tolerance", ""),
        ({"scheme": "stripe", "secret_env": "GOOD", "tolerance": -5}, "verify.tolerance", ""),
        ({"scheme": "stripe", "secret_env": "GOOD", "tolerance": "300"}, "verify.tolerance", ""),
        ({"scheme": "stripe", "secret_env": "GOOD", "tolerance": True}, "verify.tolerance", ""),
        ({"scheme": "standard", "secret_env": "STD", "tolerance": 1.5}, "verify.tolerance", ""),
        (
            {"scheme": "standard", "secret_env": "GOOD"},
            "verify.secret_env",
            "environment variable GOOD does not hold a Standard Webhooks secret",
        ),
        ({"scheme": "standard", "secret_env": ["STD", "BADSTD"]}, "verify.secret_env", "BADSTD"),
    ],
)
def test_parse_errors(raw: object, fld: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_verify(raw, file=FILE, trigger="x", env=ENV)
    text = str(info.value)
    assert text.startswith(f"{FILE}: trigger 'x': field '{fld}': ")
    assert fragment in text
    assert (info.value.section, info.value.name, info.value.field) == ("trigger", "x", fld)
    assert SECRET not in text
    assert SECRET not in repr(info.value)


def test_standard_secret_forms() -> None:
    for value in ("whsec_", "whsec_not base64", "whsec_abc", "whsec_" + SECRET):
        with pytest.raises(ConfigError) as info:
            parse_verify(
                {"scheme": "standard", "secret_env": "W"}, file=FILE, trigger="x", env={"W": value}
            )
        assert value.removeprefix("whsec_") not in str(info.value) or value == "whsec_"
    ok = std_secret("ok")
    for value in (ok, ok.removeprefix("whsec_")):
        spec = parse_verify(
            {"scheme": "standard", "secret_env": "W"}, file=FILE, trigger="x", env={"W": value}
        )
        assert spec.secrets == (value,)


def test_parse_defaults_and_forms() -> None:
    spec = parse_verify({"scheme": "github", "secret_env": "GOOD"}, file=FILE, trigger="x", env=ENV)
    assert spec.scheme == "github"
    assert spec.secret_env == ("GOOD",)
    assert spec.secrets == (SECRET,)
    assert spec.tolerance == 300
    stripe = parse_verify(
        {"scheme": "stripe", "secret_env": ["GOOD"], "tolerance": 120},
        file=FILE,
        trigger="x",
        env=ENV,
    )
    assert stripe.tolerance == 120
    hm = parse_verify(
        {
            "scheme": "hmac",
            "secret_env": "GOOD",
            "header": "X-Signature",
            "algorithm": "sha512",
            "encoding": "base64",
            "prefix": "v1=",
        },
        file=FILE,
        trigger="x",
        env=ENV,
    )
    assert (hm.header, hm.algorithm, hm.encoding, hm.prefix) == (
        "X-Signature",
        "sha512",
        "base64",
        "v1=",
    )
    none = parse_verify({"scheme": "none"}, file=FILE, trigger="x", env={})
    assert none.secrets == () and none.secret_env == ()


def test_secret_never_in_repr() -> None:
    raws: list[dict[str, Any]] = [
        {"scheme": "github"},
        {"scheme": "stripe"},
        {"scheme": "hmac", "header": "X-Sig"},
        {"scheme": "token", "header": "X-Token"},
    ]
    for raw in raws:
        spec = parse_verify(dict(raw, secret_env="GOOD"), file=FILE, trigger="x", env=ENV)
        assert SECRET not in repr(spec)
        assert SECRET not in str(spec)
        assert SECRET not in describe(spec)
        assert "GOOD" in repr(spec)  # the variable name is fine to show
    std = parse_verify({"scheme": "standard", "secret_env": "STD"}, file=FILE, trigger="x", env=ENV)
    assert ENV["STD"] not in repr(std)
    assert ENV["STD"].removeprefix("whsec_") not in repr(std)


def test_describe() -> None:
    assert describe(spec_for("github")) == "github"
    assert describe(spec_for("stripe")) == "stripe"
    assert describe(spec_for("standard")) == "standard"
    assert describe(spec_for("hmac-sha256-hex")) == "hmac sha256 hex X-Signature"
    assert describe(spec_for("hmac-sha1-base64")) == "hmac sha1 base64 X-Sig"
    assert describe(spec_for("token")) == "token X-Gitlab-Token"
    assert describe(make_spec({"scheme": "none"})) == "none"
    wide = make_spec({"scheme": "stripe", "tolerance": 600}, "whsec_x")
    assert describe(wide) == "stripe ±600 s"


def test_direct_construction_derives_keys() -> None:
    spec = VerifySpec(scheme="github", secret_env=("G",), secrets=("It's a Secret to Everybody",))
    sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert verify(spec, hdrs({"X-Hub-Signature-256": sig}), b"Hello, World!", NOW) is None
    with pytest.raises(ValueError) as info:
        VerifySpec(scheme="standard", secret_env=("S",), secrets=("whsec_" + SECRET,))
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError):
        VerifySpec(scheme="token", secret_env=("S",), secrets=("x",))
