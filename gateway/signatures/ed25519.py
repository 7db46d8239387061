"""Ed25519 signatures: Standard Webhooks' asymmetric ``v1a`` signatures and Discord's
interactions, their key formats, the check itself and the signing side.

- Standard Webhooks ("Signature scheme", symmetric vs asymmetric): a ``v1a,<base64>``
  entry of ``webhook-signature`` is an Ed25519 signature of
  ``{webhook-id}.{webhook-timestamp}.{body}``, as the ``v1`` HMAC signs it. The public
  key is serialized ``whpk_<base64>``, the secret key ``whsk_<base64>``: its 32-byte
  seed, or (as NaCl/libsodium hand out a signing key) the 64 bytes of the seed followed
  by the public key. A ``whsec_`` secret keeps meaning the HMAC key of ``v1``.
- Discord ("Receiving and responding", security and authorization): Ed25519 of the
  ``X-Signature-Timestamp`` header's text followed by the body, hex in
  ``X-Signature-Ed25519``, checked with the application's public key (64 hex digits).

Pure code: the Ed25519 arithmetic is the ``cryptography`` package's (OpenSSL), never
hand-written. Nothing here logs, and no message quotes a key or a signature.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gateway.signatures.schemes import PLACEHOLDER_SECRET

__all__ = [
    "DISCORD_SIGNATURE",
    "DISCORD_TIMESTAMP",
    "MAX_SIGNATURES",
    "SIGNATURE_SIZE",
    "WHPK",
    "WHSK",
    "any_valid",
    "discord_headers",
    "discord_public_key",
    "from_base64",
    "from_hex",
    "is_asymmetric",
    "is_discord_ping",
    "key_problem",
    "public_bytes",
    "public_keys",
    "sign_v1a",
    "signing_key",
    "standard_public_key",
]

DISCORD_SIGNATURE = "X-Signature-Ed25519"
DISCORD_TIMESTAMP = "X-Signature-Timestamp"
WHPK = "whpk_"
WHSK = "whsk_"
_WHSEC = "whsec_"  # schemes.WHSEC; not imported, so that spec.py may import this module

KEY_SIZE = 32
SIGNATURE_SIZE = 64
# The most Ed25519 signatures one delivery may ask to be checked. Each check costs
# about 50 us, a hundred times an HMAC, and a header may hold hundreds of entries; a
# sender rotating keys sends two or three.
MAX_SIGNATURES = 8


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def is_asymmetric(secret: str) -> bool:
    """Whether a ``standard`` secret is an Ed25519 key (``whpk_``/``whsk_``), not the
    ``whsec_`` HMAC key."""
    return secret.startswith((WHPK, WHSK))


def signing_key(secret: str) -> Ed25519PrivateKey | None:
    """The private key of a ``whsk_`` secret (32-byte seed, or 64 bytes: seed then
    public key, which must belong to it); None for anything else."""
    if not secret.startswith(WHSK):
        return None
    raw = _b64(secret.removeprefix(WHSK))
    if raw is None or len(raw) not in (KEY_SIZE, 2 * KEY_SIZE):
        return None
    key = Ed25519PrivateKey.from_private_bytes(raw[:KEY_SIZE])
    if len(raw) == 2 * KEY_SIZE and raw[KEY_SIZE:] != public_bytes(key.public_key()):
        return None  # a public half that is not this seed's: a pasting mistake
    return key


def standard_public_key(secret: str) -> bytes | None:
    """The raw 32-byte public key a ``whpk_`` secret holds, or that a ``whsk_`` one
    derives; None when the secret is neither (or not a valid key)."""
    if secret.startswith(WHSK):
        key = signing_key(secret)
        return None if key is None else public_bytes(key.public_key())
    if not secret.startswith(WHPK):
        return None
    raw = _b64(secret.removeprefix(WHPK))
    if raw is None or len(raw) != KEY_SIZE or _public(raw) is None:
        return None
    return raw


def discord_public_key(secret: str) -> bytes | None:
    """The raw key of a Discord application's public key (64 hex digits, as the
    developer portal shows it); None when it is not one."""
    raw = from_hex(secret.strip(), KEY_SIZE)
    return raw if raw is not None and _public(raw) is not None else None


def key_problem(scheme: str, variable: str, value: str) -> str | None:
    """What is wrong with ``value`` (from environment variable ``variable``) as a key of
    ``scheme``, for parse.py's message; None when it is fine or not ours to judge.
    Never quotes the value."""
    if scheme == "standard":
        if is_asymmetric(value):
            if standard_public_key(value) is None:
                return (
                    f"environment variable {variable} does not hold a Standard Webhooks "
                    f"Ed25519 key ({WHPK} + base64 of the 32-byte public key, or {WHSK} + "
                    "base64 of the 32-byte seed or the 64-byte seed and public key)"
                )
            return None
        return None  # whsec_: parse.py's own check
    if scheme == "discord" and value != PLACEHOLDER_SECRET and discord_public_key(value) is None:
        return (
            f"environment variable {variable} does not hold a Discord application's "
            "public key (64 hex digits, from the developer portal's General Information)"
        )
    return None


def public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


@functools.lru_cache(maxsize=256)
def _public(raw: bytes) -> Ed25519PublicKey | None:
    # Loaded once per key: the keys are a config's, a handful.
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None


def from_hex(text: str, size: int = SIGNATURE_SIZE) -> bytes | None:
    """``size`` bytes written as hex (either case), or None."""
    if len(text) != 2 * size or not text.isascii():
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def from_base64(text: bytes) -> bytes | None:
    """A 64-byte signature written as base64, or None."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == SIGNATURE_SIZE else None


def any_valid(keys: Iterable[bytes], signatures: Sequence[bytes], message: bytes) -> bool:
    """Whether any of ``signatures`` (raw, 64 bytes each) is one of ``keys`` (raw public
    keys) over ``message``. Which key or entry matched is not secret: public keys, and
    the order the sender chose."""
    for raw in keys:
        key = _public(raw)
        if key is None:
            continue
        for signature in signatures:
            try:
                key.verify(signature, message)
            except InvalidSignature:
                continue
            return True
    return False


def sign_v1a(secret: str, message: bytes) -> str | None:
    """The ``v1a,<base64>`` entry a ``whsk_`` secret gives ``message``; None for any
    other secret (a public key cannot sign)."""
    key = signing_key(secret)
    if key is None:
        return None
    return "v1a," + base64.b64encode(key.sign(message)).decode()


def discord_headers(private_key: Ed25519PrivateKey, body: bytes, now: float) -> dict[str, str]:
    """The two headers Discord adds to ``body``, signed with ``private_key``: for tests
    (a Discord trigger holds only the public key, so ``sign`` cannot, nor `realm send`)."""
    timestamp = str(int(now))
    signature = private_key.sign(timestamp.encode("ascii") + body).hex()
    return {DISCORD_SIGNATURE: signature, DISCORD_TIMESTAMP: timestamp}


def is_discord_ping(body_doc: Any) -> bool:
    """Whether a verified Discord interaction is the PING (``type`` 1) that Discord
    sends to check an endpoint, which expects ``{"type": 1}`` back."""
    if not isinstance(body_doc, dict):
        return False
    kind = body_doc.get("type")
    return kind == 1 and not isinstance(kind, bool)


def public_keys(scheme: str, secrets: Sequence[str]) -> tuple[bytes, ...]:
    """The raw Ed25519 public keys a spec verifies with: of its ``whpk_``/``whsk_``
    secrets for ``standard`` (its ``whsec_`` ones are HMAC keys), of every secret for
    ``discord``; () for other schemes. ValueError (never quoting a secret) for a key
    that is not one."""
    if scheme == "standard":
        keys = [standard_public_key(s) for s in secrets if is_asymmetric(s)]
        what = f"{WHPK}/{WHSK} secret is not base64 of an Ed25519 key"
    elif scheme == "discord":
        keys = [discord_public_key(s) for s in secrets if s != PLACEHOLDER_SECRET]
        what = "discord key is not 64 hex digits of an Ed25519 public key"
    else:
        return ()
    if None in keys:
        raise ValueError(f"a {scheme} {what}" if scheme == "standard" else f"a {what}")
    return tuple(k for k in keys if k is not None)
