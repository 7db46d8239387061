"""Ed25519 schemes (gateway/signatures/ed25519.py): Standard Webhooks' asymmetric `v1a`
signatures beside its `v1` HMAC, and Discord's interactions. Pure: no Redis, no network.

Where the values come from:
- The Ed25519 primitive against RFC 8032's section 7.1 vectors TEST 1 and TEST 2 (copied
  below), which OpenSSL (through `cryptography`) reproduces.
- Standard Webhooks `v1`: signed at test time by the reference library, the
  `standardwebhooks` package. It has no `v1a` (it checks and signs `v1` only), and the
  spec (standard-webhooks/standard-webhooks, spec/standard-webhooks.md) publishes no
  key with its `v1a` example header; so `v1a` deliveries are signed here by an
  independent computation with `cryptography`, from the spec's text: Ed25519 over
  `{webhook-id}.{webhook-timestamp}.{body}`, base64, `v1a,`, keys `whpk_`/`whsk_`.
- Discord: neither of Discord's libraries (discord-interactions-js, -python) publishes
  a fixed vector (their tests generate a key pair each run); deliveries are signed
  here with `cryptography`, as Discord documents it: hex Ed25519 of timestamp + body.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from standardwebhooks.webhooks import Webhook
from starlette.datastructures import Headers

from gateway.model.errors import ConfigError
from gateway.signatures.ed25519 import (
    MAX_SIGNATURES,
    any_valid,
    discord_headers,
    is_discord_ping,
    public_bytes,
)
from gateway.signatures.parse import parse_verify
from gateway.signatures.sign import sign
from gateway.signatures.spec import VerifySpec, describe
from gateway.signatures.verify import verify

NOW = 1_735_689_600.0
BODY = b'{"type":"contact.created","data":{"id":"1f81eb52"}}'
MSG_ID = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"

# RFC 8032, section 7.1: (secret key, public key, message, signature), hex.
RFC8032 = [
    pytest.param(
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555f"
        "b8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
        id="test1",
    ),
    pytest.param(
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da08"
        "5ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
        id="test2",
    ),
]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


KEY = Ed25519PrivateKey.generate()
OTHER = Ed25519PrivateKey.generate()
SEED = KEY.private_bytes_raw()
PUBLIC = public_bytes(KEY.public_key())
HMAC_KEY = bytes(range(32))
ENV = {
    "WHPK": "whpk_" + b64(PUBLIC),
    "WHSK": "whsk_" + b64(SEED),
    "WHSK64": "whsk_" + b64(SEED + PUBLIC),
    "OTHER_PK": "whpk_" + b64(public_bytes(OTHER.public_key())),
    "WHSEC": "whsec_" + b64(HMAC_KEY),
    "DISCORD": PUBLIC.hex(),
    "DISCORD_OTHER": public_bytes(OTHER.public_key()).hex(),
    "BAD_LEN": "whpk_" + b64(PUBLIC[:31]),
    "BAD_PAIR": "whsk_" + b64(SEED + public_bytes(OTHER.public_key())),
    "NOT_HEX": "z" * 64,
    "NOT_B64": "not base64!",
}
SECRET_VALUES = list(ENV.values())


def spec(scheme: str, *names: str, **more: object) -> VerifySpec:
    return parse_verify(
        {"scheme": scheme, "secret_env": list(names), **more}, file="f", trigger="t", env=ENV
    )


def v1a(private: Ed25519PrivateKey, msg_id: str, timestamp: str, body: bytes) -> str:
    """The spec's v1a entry, computed here (not with the code under test)."""
    return "v1a," + b64(private.sign(f"{msg_id}.{timestamp}.".encode() + body))


def std_headers(signature: str, timestamp: float = NOW, msg_id: str = MSG_ID) -> Headers:
    return Headers(
        {
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(timestamp)),
            "webhook-signature": signature,
        }
    )


def check_reason(reason: str | None) -> None:
    # A reason never quotes a key, a secret or a signature.
    assert reason is not None
    for value in SECRET_VALUES:
        assert value not in reason


# --- The primitive ------------------------------------------------------------------


@pytest.mark.parametrize(("secret", "public", "message", "signature"), RFC8032)
def test_rfc8032_vectors(secret: str, public: str, message: str, signature: str) -> None:
    private = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(secret))
    assert public_bytes(private.public_key()).hex() == public
    assert private.sign(bytes.fromhex(message)).hex() == signature
    raw = bytes.fromhex(signature)
    assert any_valid([bytes.fromhex(public)], [raw], bytes.fromhex(message))
    assert not any_valid([bytes.fromhex(public)], [raw], bytes.fromhex(message) + b"x")
    flipped = bytes([raw[0] ^ 1]) + raw[1:]
    assert not any_valid([bytes.fromhex(public)], [flipped], bytes.fromhex(message))


# --- Standard Webhooks v1a ----------------------------------------------------------


@pytest.mark.parametrize("names", [("WHPK",), ("WHSK",), ("WHSK64",), ("WHSEC", "WHPK")])
def test_v1a_genuine(names: tuple[str, ...]) -> None:
    timestamp = str(int(NOW))
    headers = std_headers(v1a(KEY, MSG_ID, timestamp, BODY))
    assert verify(spec("standard", *names), headers, BODY, NOW) is None


def test_v1a_tampered_body_id_and_timestamp() -> None:
    verifier = spec("standard", "WHPK")
    signature = v1a(KEY, MSG_ID, str(int(NOW)), BODY)
    assert verify(verifier, std_headers(signature), BODY + b" ", NOW) == "signature mismatch"
    moved = std_headers(signature, msg_id="msg_other")
    assert verify(verifier, moved, BODY, NOW) == "signature mismatch"
    later = std_headers(signature, timestamp=NOW + 1)
    assert verify(verifier, later, BODY, NOW) == "signature mismatch"


def test_v1a_wrong_key() -> None:
    signature = v1a(OTHER, MSG_ID, str(int(NOW)), BODY)
    reason = verify(spec("standard", "WHPK"), std_headers(signature), BODY, NOW)
    assert reason == "signature mismatch"
    check_reason(reason)
    # Rotation: the other key listed too, and the same delivery verifies.
    assert verify(spec("standard", "WHPK", "OTHER_PK"), std_headers(signature), BODY, NOW) is None


def test_v1a_missing_headers() -> None:
    verifier = spec("standard", "WHPK")
    signature = v1a(KEY, MSG_ID, str(int(NOW)), BODY)
    full = {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(int(NOW)),
        "webhook-signature": signature,
    }
    for name in full:
        headers = Headers({k: v for k, v in full.items() if k != name})
        assert verify(verifier, headers, BODY, NOW) == f"missing header {name}"


def test_v1a_stale_timestamp() -> None:
    verifier = spec("standard", "WHPK")
    old = NOW - 301
    headers = std_headers(v1a(KEY, MSG_ID, str(int(old)), BODY), timestamp=old)
    assert verify(verifier, headers, BODY, NOW) == "timestamp outside tolerance (300 s)"
    assert verify(verifier, headers, BODY, old) is None
    assert verify(spec("standard", "WHPK", tolerance=600), headers, BODY, NOW) is None


def test_v1a_among_other_entries() -> None:
    # The spec's example header: a v1 and a v1a entry side by side, either may verify.
    timestamp = str(int(NOW))
    hmac_entry = Webhook("whsec_" + b64(HMAC_KEY)).sign(
        MSG_ID, datetime.fromtimestamp(NOW, UTC), BODY.decode()
    )
    both = f"{hmac_entry} {v1a(KEY, MSG_ID, timestamp, BODY)}"
    assert verify(spec("standard", "WHPK"), std_headers(both), BODY, NOW) is None
    assert verify(spec("standard", "WHSEC"), std_headers(both), BODY, NOW) is None
    # A wrong v1a beside a good one: any entry may match.
    wrong = f"{v1a(OTHER, MSG_ID, timestamp, BODY)} {v1a(KEY, MSG_ID, timestamp, BODY)}"
    assert verify(spec("standard", "WHPK"), std_headers(wrong), BODY, NOW) is None


def test_v1_from_the_reference_library() -> None:
    # standardwebhooks signs v1 only: it checks our whsec_ path, and that a whpk_-only
    # trigger does not take a v1 entry it has no key for.
    entry = Webhook("whsec_" + b64(HMAC_KEY)).sign(
        MSG_ID, datetime.fromtimestamp(NOW, UTC), BODY.decode()
    )
    assert entry.startswith("v1,")
    assert verify(spec("standard", "WHSEC"), std_headers(entry), BODY, NOW) is None
    reason = verify(spec("standard", "WHPK"), std_headers(entry), BODY, NOW)
    assert reason == "no v1a signature in webhook-signature"
    # And the other way: a v1a-only header to a whsec_-only trigger.
    only_v1a = std_headers(v1a(KEY, MSG_ID, str(int(NOW)), BODY))
    reason = verify(spec("standard", "WHSEC"), only_v1a, BODY, NOW)
    assert reason == "no v1 signature in webhook-signature"
    reason = verify(spec("standard", "WHSEC", "WHPK"), std_headers("v2,abc"), BODY, NOW)
    assert reason == "no v1 or v1a signature in webhook-signature"


def test_reference_library_accepts_what_sign_gives_for_whsec() -> None:
    headers = sign(spec("standard", "WHSEC"), BODY, NOW, event_id=MSG_ID)
    ours = headers["webhook-signature"]
    theirs = Webhook("whsec_" + b64(HMAC_KEY)).sign(
        MSG_ID, datetime.fromtimestamp(NOW, UTC), BODY.decode()
    )
    assert ours == theirs


@pytest.mark.parametrize("name", ["WHSK", "WHSK64"])
def test_sign_v1a_with_whsk(name: str) -> None:
    headers = sign(spec("standard", name), BODY, NOW, event_id=MSG_ID)
    # The same bytes an independent computation gives (Ed25519 is deterministic).
    assert headers["webhook-signature"] == v1a(KEY, MSG_ID, str(int(NOW)), BODY)
    assert headers["webhook-id"] == MSG_ID
    assert verify(spec("standard", "WHPK"), Headers(headers), BODY, NOW) is None


def test_sign_with_a_public_key_signs_nothing() -> None:
    assert sign(spec("standard", "WHPK"), BODY, NOW) == {}


def test_v1a_malformed_and_too_many_entries() -> None:
    verifier = spec("standard", "WHPK")
    for bad in ("v1a,not-base64!", "v1a," + b64(b"short"), "v1a,"):
        assert verify(verifier, std_headers(bad), BODY, NOW) == "signature mismatch"
    good = v1a(KEY, MSG_ID, str(int(NOW)), BODY)
    many = " ".join([v1a(OTHER, MSG_ID, str(int(NOW)), BODY)] * MAX_SIGNATURES + [good])
    reason = verify(verifier, std_headers(many), BODY, NOW)
    assert reason == f"more than {MAX_SIGNATURES} v1a signatures in webhook-signature"
    check_reason(reason)
    assert good.removeprefix("v1a,") not in (reason or "")


def test_v1a_svix_names() -> None:
    signature = v1a(KEY, MSG_ID, str(int(NOW)), BODY)
    headers = Headers(
        {"svix-id": MSG_ID, "svix-timestamp": str(int(NOW)), "svix-signature": signature}
    )
    assert verify(spec("standard", "WHPK"), headers, BODY, NOW) is None


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("BAD_LEN", "Ed25519 key"),
        ("BAD_PAIR", "Ed25519 key"),
        ("NOT_B64", "Standard Webhooks secret"),
    ],
)
def test_standard_key_errors(name: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        spec("standard", name)
    assert info.value.field == "verify.secret_env"
    assert fragment in str(info.value) and name in str(info.value)
    assert ENV[name] not in str(info.value)


# --- Discord ------------------------------------------------------------------------


def discord(private: Ed25519PrivateKey, body: bytes, timestamp: float = NOW) -> Headers:
    """Discord's headers, computed here (not with the code under test)."""
    stamp = str(int(timestamp))
    signature = private.sign(stamp.encode() + body).hex()
    return Headers({"X-Signature-Ed25519": signature, "X-Signature-Timestamp": stamp})


PING = b'{"id":"787053080478613555","token":"ThisIsATokenFromDiscordThatIsVeryLong","type":1}'


def test_discord_genuine() -> None:
    assert verify(spec("discord", "DISCORD"), discord(KEY, PING), PING, NOW) is None
    # Upper-case hex (the key and the signature): the same bytes.
    upper = dict(discord(KEY, PING))
    upper["x-signature-ed25519"] = upper["x-signature-ed25519"].upper()
    env = dict(ENV, UPPER=PUBLIC.hex().upper())
    upper_spec = parse_verify(
        {"scheme": "discord", "secret_env": "UPPER"}, file="f", trigger="t", env=env
    )
    assert verify(upper_spec, Headers(upper), PING, NOW) is None


def test_discord_helper_signs_as_discord() -> None:
    headers = discord_headers(KEY, PING, NOW)
    assert headers == {
        "X-Signature-Ed25519": discord(KEY, PING)["x-signature-ed25519"],
        "X-Signature-Timestamp": str(int(NOW)),
    }
    assert verify(spec("discord", "DISCORD"), Headers(headers), PING, NOW) is None


def test_discord_tampered() -> None:
    verifier = spec("discord", "DISCORD")
    headers = discord(KEY, PING)
    assert verify(verifier, headers, PING.replace(b'"type":1', b'"type":2'), NOW) == (
        "signature mismatch"
    )
    # The timestamp is signed: a fresh one on a captured delivery does not verify.
    moved = dict(headers, **{"x-signature-timestamp": str(int(NOW) + 1)})
    assert verify(verifier, Headers(moved), PING, NOW) == "signature mismatch"


def test_discord_wrong_key_and_rotation() -> None:
    headers = discord(OTHER, PING)
    reason = verify(spec("discord", "DISCORD"), headers, PING, NOW)
    assert reason == "signature mismatch"
    check_reason(reason)
    assert headers["x-signature-ed25519"] not in (reason or "")
    assert verify(spec("discord", "DISCORD", "DISCORD_OTHER"), headers, PING, NOW) is None


def test_discord_missing_malformed_repeated_headers() -> None:
    verifier = spec("discord", "DISCORD")
    headers = dict(discord(KEY, PING))
    for name, label in (
        ("x-signature-ed25519", "X-Signature-Ed25519"),
        ("x-signature-timestamp", "X-Signature-Timestamp"),
    ):
        without = Headers({k: v for k, v in headers.items() if k != name})
        assert verify(verifier, without, PING, NOW) == f"missing header {label}"
    short = dict(headers, **{"x-signature-ed25519": headers["x-signature-ed25519"][:-2]})
    assert verify(verifier, Headers(short), PING, NOW) == "malformed header X-Signature-Ed25519"
    soon = dict(headers, **{"x-signature-timestamp": "soon"})
    assert verify(verifier, Headers(soon), PING, NOW) == "malformed header X-Signature-Timestamp"
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    twice = Headers(raw=[*raw, (b"x-signature-ed25519", headers["x-signature-ed25519"].encode())])
    assert verify(verifier, twice, PING, NOW) == "header X-Signature-Ed25519 repeated"


def test_discord_stale_timestamp() -> None:
    verifier = spec("discord", "DISCORD")
    old = discord(KEY, PING, NOW - 301)
    assert verify(verifier, old, PING, NOW) == "timestamp outside tolerance (300 s)"
    future = discord(KEY, PING, NOW + 301)
    assert verify(verifier, future, PING, NOW) == "timestamp outside tolerance (300 s)"
    assert verify(spec("discord", "DISCORD", tolerance=900), old, PING, NOW) is None
    assert describe(spec("discord", "DISCORD", tolerance=900)) == "discord ±900 s"
    assert describe(verifier) == "discord"


def test_discord_key_errors_and_keys() -> None:
    with pytest.raises(ConfigError) as info:
        spec("discord", "NOT_HEX")
    assert "public key (64 hex digits" in str(info.value) and ENV["NOT_HEX"] not in str(info.value)
    with pytest.raises(ConfigError) as info:
        spec("discord", "DISCORD", header="X-Other")
    assert info.value.field == "verify.header"
    # A discord trigger holds the public key: sign() has nothing to sign with.
    assert sign(spec("discord", "DISCORD"), PING, NOW) == {}


@pytest.mark.parametrize(
    ("doc", "ping"),
    [
        ({"type": 1, "id": "1"}, True),
        ({"type": 2}, False),
        ({"type": True}, False),
        ({"type": "1"}, False),
        ([1], False),
        (None, False),
    ],
)
def test_is_discord_ping(doc: object, ping: bool) -> None:
    assert is_discord_ping(doc) is ping
