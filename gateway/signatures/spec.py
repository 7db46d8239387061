"""``VerifySpec``: how one trigger authenticates deliveries, with what it derives once
(key bytes, lower-case header names, the signed payload's pieces); the digest an HMAC
scheme expects; and the short label that describes a spec.

Secret values live only in ``VerifySpec.secrets`` and the derived key bytes;
neither appears in a repr, an error message or a label.
"""

from __future__ import annotations

import base64
import hmac
import re
from dataclasses import dataclass, field, fields

from gateway.signatures.ed25519 import is_asymmetric, public_keys
from gateway.signatures.schemes import (
    DEFAULT_TOLERANCE,
    HMAC_SCHEMES,
    PRESETS,
    TOLERANCES,
    URL_SCHEMES,
    Algorithm,
    Encoding,
    Scheme,
    standard_key,
)
from gateway.signatures.sns import SnsSettings, describe_sns
from gateway.signatures.twilio import url_variants

__all__ = [
    "TIMESTAMP_DOT_BODY",
    "Piece",
    "VerifySpec",
    "compile_payload",
    "describe",
    "encode_digest",
]

# A placeholder of `signed_payload`, and the ones there are.
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_PAYLOAD_FIELDS = ("timestamp", "body")
_BODY_ONLY = "{body}"
TIMESTAMP_DOT_BODY = "{timestamp}.{body}"

# One piece of a signed payload: ("text", literal bytes), ("timestamp", b"") or
# ("body", b""); the placeholders are filled per delivery.
Piece = tuple[str, bytes]


@dataclass(frozen=True)
class VerifySpec:
    """How one trigger authenticates deliveries.

    ``secrets`` and every derived key are excluded from ``repr`` so that a spec
    can be logged or shown in a traceback without leaking anything (so are
    ``verify_tokens``). For the presets (``slack``, ``shopify``, ``gitlab``, ``zoom``,
    ``meta``, ...) the header, encoding and signed payload fields hold the sender's
    values once constructed.
    """

    scheme: Scheme
    secret_env: tuple[str, ...]
    secrets: tuple[str, ...] = field(repr=False)
    tolerance: int = DEFAULT_TOLERANCE
    header: str | None = None
    algorithm: Algorithm = "sha256"
    encoding: Encoding = "hex"
    prefix: str = ""
    # hmac only: the header carrying a Unix timestamp (seconds), checked against
    # `tolerance`, and what is signed: a template over {timestamp} and {body}.
    timestamp_header: str | None = None
    signed_payload: str | None = None
    # square and twilio: the URL the sender posts to, which it signs (URL_SCHEMES).
    url: str | None = None
    # meta only: the variables holding the verify token(s) Meta's GET subscription
    # check sends (compared by the handshake), and their values, kept as secret.
    verify_token_env: tuple[str, ...] = ()
    verify_tokens: tuple[str, ...] = field(default=(), repr=False)
    # sns only (it has no secret): the topics it accepts, and the hosts and CA bundle
    # trusted to serve certificates (gateway/signatures/sns.py).
    sns: SnsSettings | None = None
    # Derived in __post_init__ so verify() does no per-request decoding: the HMAC
    # key bytes for each secret (for `standard`, the base64-decoded key; for
    # `token`, the expected header bytes), the lower-case header names and the
    # signed payload's pieces.
    keys: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    header_key: str = field(init=False, repr=False, compare=False)
    timestamp_key: str = field(init=False, repr=False, compare=False)
    payload: tuple[Piece, ...] = field(init=False, repr=False, compare=False)
    # twilio: the URLs a signature may cover (twilio.url_variants).
    urls: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # standard (its whpk_/whsk_ secrets) and discord: the raw Ed25519 public keys.
    public_keys: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # frozen=True forbids normal assignment; everything set here is either a
        # preset's fixed value or a pure function of the public fields, so setting
        # it once keeps the spec immutable.
        for name, value in PRESETS.get(self.scheme, {}).items():
            given = getattr(self, name)
            if given != value and given != _FIELD_DEFAULTS[name]:
                raise ValueError(f"scheme {self.scheme} fixes {name} itself")
            object.__setattr__(self, name, value)
        if self.scheme == "standard":
            keys: list[bytes] = []
            for secret in self.secrets:
                if is_asymmetric(secret):  # v1a's Ed25519 key: public_keys below
                    continue
                key = standard_key(secret)
                if key is None:
                    # No value in the message: it would be the secret itself.
                    raise ValueError("a standard secret is not whsec_ followed by base64")
                keys.append(key)
            derived = tuple(keys)
        else:
            derived = tuple(s.encode("utf-8") for s in self.secrets)
        if self.scheme in ("hmac", "token") and not self.header:
            raise ValueError(f"scheme {self.scheme} needs a header")
        if self.scheme not in ("none", "sns") and not self.secrets:
            raise ValueError(f"scheme {self.scheme} needs at least one secret")
        if (self.scheme == "sns") != (self.sns is not None):
            raise ValueError("scheme sns, and it alone, has sns settings (topic_arn)")
        object.__setattr__(self, "public_keys", public_keys(self.scheme, self.secrets))
        if self.scheme in URL_SCHEMES and not self.url:
            raise ValueError(f"scheme {self.scheme} needs a url")
        if self.url and self.scheme not in URL_SCHEMES:
            raise ValueError(f"scheme {self.scheme} signs no url")
        if (self.verify_token_env or self.verify_tokens) and self.scheme != "meta":
            raise ValueError("only scheme meta has verify tokens")
        payload: tuple[Piece, ...] = ()
        if self.scheme == "square":
            # Square signs the notification URL followed by the body. The URL is
            # literal text, not a template: a '{' in it must not read as a placeholder.
            payload = (("text", (self.url or "").encode("utf-8")), ("body", b""))
        elif self.scheme in HMAC_SCHEMES:
            if self.signed_payload is None:
                template = TIMESTAMP_DOT_BODY if self.timestamp_header else _BODY_ONLY
                object.__setattr__(self, "signed_payload", template)
            payload = compile_payload(self.signed_payload or "", bool(self.timestamp_header))
        object.__setattr__(self, "keys", derived)
        object.__setattr__(self, "header_key", (self.header or "").lower())
        object.__setattr__(self, "timestamp_key", (self.timestamp_header or "").lower())
        object.__setattr__(self, "payload", payload)
        urls = url_variants(self.url or "") if self.scheme == "twilio" else ()
        object.__setattr__(self, "urls", urls)


# What a preset's field holds when the caller left it alone.
_FIELD_DEFAULTS = {f.name: f.default for f in fields(VerifySpec) if f.init}


def compile_payload(template: str, timestamped: bool) -> tuple[Piece, ...]:
    """Split a ``signed_payload`` template into pieces; ValueError says what is wrong."""
    pieces: list[Piece] = []
    seen: list[str] = []
    pos = 0

    def literal(text: str) -> None:
        if "{" in text or "}" in text:
            raise ValueError(
                "has a '{' or '}' outside a placeholder; the placeholders are "
                "{timestamp} and {body}"
            )
        if text:
            pieces.append(("text", text.encode("utf-8")))

    for match in _PLACEHOLDER.finditer(template):
        literal(template[pos : match.start()])
        name = match.group(1)
        if name not in _PAYLOAD_FIELDS:
            raise ValueError(
                f"unknown placeholder {{{name}}}; the placeholders are {{timestamp}} and {{body}}"
            )
        if name in seen:
            raise ValueError(f"has {{{name}}} twice")
        seen.append(name)
        pieces.append((name, b""))
        pos = match.end()
    literal(template[pos:])
    if "body" not in seen:
        raise ValueError("must contain {body}")
    if timestamped and "timestamp" not in seen:
        # An unsigned timestamp proves nothing: anyone could put a fresh one on
        # a captured delivery, and the tolerance check would pass.
        raise ValueError(
            "must contain {timestamp}: the timestamp_header's value counts only if it is signed"
        )
    if not timestamped and "timestamp" in seen:
        raise ValueError(
            "uses {timestamp}, which needs timestamp_header (the header that carries it)"
        )
    return tuple(pieces)


def encode_digest(spec: VerifySpec, key: bytes, body: bytes, timestamp: bytes) -> bytes:
    """The signature ``spec`` expects from ``key`` over ``body`` (and ``timestamp``, for a
    payload that signs one), encoded as its header carries it, without the prefix."""
    if spec.payload == (("body", b""),):
        # The usual case (the body alone): one call, and the body is not copied.
        digest = hmac.digest(key, body, spec.algorithm)
    else:
        mac = hmac.new(key, digestmod=spec.algorithm)
        for kind, text in spec.payload:
            mac.update(body if kind == "body" else timestamp if kind == "timestamp" else text)
        digest = mac.digest()
    return digest.hex().encode() if spec.encoding == "hex" else base64.b64encode(digest)


def describe(spec: VerifySpec) -> str:
    """Short label for tables, e.g. ``hmac sha256 hex X-Signature``; never a secret."""
    if spec.scheme == "hmac":
        label = f"hmac {spec.algorithm} {spec.encoding} {spec.header}"
        if spec.timestamp_header:
            label += f", timestamp {spec.timestamp_header} ±{spec.tolerance} s"
        return label
    if spec.scheme == "token":
        return f"token {spec.header}"
    if spec.scheme == "sns" and spec.sns is not None:
        return describe_sns(spec.sns)
    timestamped = ("stripe", "standard", "slack", "zoom", "paddle", "linear", "discord")
    if spec.scheme in timestamped and spec.tolerance != TOLERANCES.get(
        spec.scheme, DEFAULT_TOLERANCE
    ):
        return f"{spec.scheme} ±{spec.tolerance} s"
    return spec.scheme
