"""Webhook signature schemes: parse a trigger's ``verify:`` block, verify and sign deliveries.

Pure code: no I/O, no clock, no logging. The caller passes the environment to
``parse_verify`` and the current time to ``verify``/``sign`` so that tests can
pin both. Secret values live only in ``VerifySpec.secrets`` and the derived key
bytes; neither appears in a repr, an error message or a rejection reason.

``slack``, ``shopify`` and ``gitlab`` are presets: a fixed ``hmac`` or ``token``
configuration under the sender's name, so a trigger cannot get one of its
header names, encodings or signed strings wrong.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from secrets import token_hex
from typing import Literal, Protocol, get_args

from gateway.errors import ConfigError

__all__ = [
    "Algorithm",
    "Encoding",
    "HeaderLookup",
    "Scheme",
    "VerifySpec",
    "describe",
    "parse_verify",
    "sign",
    "verify",
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

# Which YAML keys each scheme accepts. Anything else is a typo or a key meant for
# another scheme; silently ignoring it could leave a trigger less strict than
# its author believes, so it is refused.
_ALLOWED_KEYS: dict[str, tuple[str, ...]] = {
    "github": ("scheme", "secret_env"),
    "stripe": ("scheme", "secret_env", "tolerance"),
    "standard": ("scheme", "secret_env", "tolerance"),
    "hmac": (
        "scheme",
        "secret_env",
        "header",
        "algorithm",
        "encoding",
        "prefix",
        "timestamp_header",
        "signed_payload",
        "tolerance",
    ),
    "token": ("scheme", "secret_env", "header"),
    "none": ("scheme",),
    "slack": ("scheme", "secret_env", "tolerance"),
    "shopify": ("scheme", "secret_env"),
    "gitlab": ("scheme", "secret_env"),
}

# Schemes checked as an HMAC of a signed payload built from the body (and a
# timestamp): `hmac` as configured, the presets as their senders document them.
_HMAC_SCHEMES = ("hmac", "slack", "shopify")

# What each preset fixes, from the senders' documentation: Slack, "Verifying
# requests from Slack" (HMAC-SHA256 of `v0:<timestamp>:<body>`, hex, `v0=`, five
# minutes); Shopify, "Verify webhook deliveries" (HMAC-SHA256 of the raw body,
# base64); GitLab, "Webhooks" (the secret token itself in X-Gitlab-Token).
_PRESETS: dict[str, dict[str, str | None]] = {
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

# Header names as the senders spell them (for messages and ``sign``), and the
# lower-case form used for look-ups (Starlette's Headers are case-insensitive,
# but lower-casing once here keeps other mappings working too).
_GITHUB_HEADER = "X-Hub-Signature-256"
_GITHUB_SHA1_HEADER = "X-Hub-Signature"
_GITHUB_PREFIX = "sha256="
_GITHUB_KEY = _GITHUB_HEADER.lower()
_GITHUB_SHA1_KEY = _GITHUB_SHA1_HEADER.lower()
_STRIPE_HEADER = "Stripe-Signature"
_STRIPE_KEY = _STRIPE_HEADER.lower()
_STD_ID = "webhook-id"
_STD_TIMESTAMP = "webhook-timestamp"
_STD_SIGNATURE = "webhook-signature"
# Svix sends Standard Webhooks under its own names (the same headers with a
# `svix-` prefix, unless a customer has them renamed to `webhook-`).
_STD_ALIASES = (
    (_STD_ID, "svix-id"),
    (_STD_TIMESTAMP, "svix-timestamp"),
    (_STD_SIGNATURE, "svix-signature"),
)
_WHSEC = "whsec_"

# What secret_env entries may look like (a POSIX-style variable name).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# RFC 9110 token characters: what a header field name may contain.
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# A placeholder of `signed_payload`, and the ones there are.
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_PAYLOAD_FIELDS = ("timestamp", "body")
_BODY_ONLY = "{body}"
_TIMESTAMP_DOT_BODY = "{timestamp}.{body}"

# One piece of a signed payload: ("text", literal bytes), ("timestamp", b"") or
# ("body", b""); the placeholders are filled per delivery.
_Piece = tuple[str, bytes]


class HeaderLookup(Protocol):
    """What ``verify`` needs from request headers (``starlette.datastructures.Headers``).

    Values are decoded as latin-1 (one character per byte, as Starlette does), so
    ``_raw`` turns them back into exactly the bytes the sender signed.
    """

    def getlist(self, key: str) -> list[str]: ...


@dataclass(frozen=True)
class VerifySpec:
    """How one trigger authenticates deliveries.

    ``secrets`` and every derived key are excluded from ``repr`` so that a spec
    can be logged or shown in a traceback without leaking anything. For the
    presets (``slack``, ``shopify``, ``gitlab``) the header, encoding and signed
    payload fields hold the sender's values once constructed.
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
    # Derived in __post_init__ so verify() does no per-request decoding: the HMAC
    # key bytes for each secret (for `standard`, the base64-decoded key; for
    # `token`, the expected header bytes), the lower-case header names and the
    # signed payload's pieces.
    keys: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    header_key: str = field(init=False, repr=False, compare=False)
    timestamp_key: str = field(init=False, repr=False, compare=False)
    payload: tuple[_Piece, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # frozen=True forbids normal assignment; everything set here is either a
        # preset's fixed value or a pure function of the public fields, so setting
        # it once keeps the spec immutable.
        for name, value in _PRESETS.get(self.scheme, {}).items():
            given = getattr(self, name)
            if given != value and given != _FIELD_DEFAULTS[name]:
                raise ValueError(f"scheme {self.scheme} fixes {name} itself")
            object.__setattr__(self, name, value)
        if self.scheme == "standard":
            keys: list[bytes] = []
            for secret in self.secrets:
                key = _standard_key(secret)
                if key is None:
                    # No value in the message: it would be the secret itself.
                    raise ValueError("a standard secret is not whsec_ followed by base64")
                keys.append(key)
            derived = tuple(keys)
        else:
            derived = tuple(s.encode("utf-8") for s in self.secrets)
        if self.scheme in ("hmac", "token") and not self.header:
            raise ValueError(f"scheme {self.scheme} needs a header")
        if self.scheme != "none" and not self.secrets:
            raise ValueError(f"scheme {self.scheme} needs at least one secret")
        payload: tuple[_Piece, ...] = ()
        if self.scheme in _HMAC_SCHEMES:
            if self.signed_payload is None:
                template = _TIMESTAMP_DOT_BODY if self.timestamp_header else _BODY_ONLY
                object.__setattr__(self, "signed_payload", template)
            payload = _compile_payload(self.signed_payload or "", bool(self.timestamp_header))
        object.__setattr__(self, "keys", derived)
        object.__setattr__(self, "header_key", (self.header or "").lower())
        object.__setattr__(self, "timestamp_key", (self.timestamp_header or "").lower())
        object.__setattr__(self, "payload", payload)


# What a preset's field holds when the caller left it alone.
_FIELD_DEFAULTS = {f.name: f.default for f in fields(VerifySpec) if f.init}


def _compile_payload(template: str, timestamped: bool) -> tuple[_Piece, ...]:
    """Split a ``signed_payload`` template into pieces; ValueError says what is wrong."""
    pieces: list[_Piece] = []
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


# --------------------------------------------------------------------------- parse


def parse_verify(raw: object, *, file: str, trigger: str, env: Mapping[str, str]) -> VerifySpec:
    """Build a ``VerifySpec`` from the YAML mapping under a trigger's ``verify:`` key.

    Raises ``ConfigError`` (section ``trigger``, the trigger's name, field
    ``verify.<key>``) for every problem; secret values never reach a message.
    """

    def fail(fld: str, message: str) -> ConfigError:
        return ConfigError(file, message, section="trigger", name=trigger, field=fld)

    if raw is None:
        raise fail(
            "verify",
            "is required; write {scheme: none} to accept unsigned deliveries explicitly",
        )
    if not isinstance(raw, Mapping):
        raise fail(
            "verify",
            f"must be a mapping such as {{scheme: github, secret_env: NAME}}, "
            f"not {type(raw).__name__}",
        )
    for key in raw:
        if not isinstance(key, str):
            raise fail("verify", f"keys must be strings, got {key!r}")

    # Checked before anything else: a secret pasted into YAML is the mistake
    # most worth a precise message. The value itself is never echoed.
    for key in ("secret", "secrets"):
        if key in raw:
            raise fail(
                f"verify.{key}",
                "secrets come only from environment variables; use secret_env "
                "to name the variable(s) that hold it",
            )

    allowed = ", ".join(SCHEMES)
    if "scheme" not in raw:
        raise fail("verify.scheme", f"is missing; one of {allowed}")
    scheme = raw["scheme"]
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise fail("verify.scheme", f"unknown scheme {scheme!r}; one of {allowed}")

    allowed_keys = _ALLOWED_KEYS[scheme]
    for key in raw:
        if key not in allowed_keys:
            raise fail(
                f"verify.{key}",
                f"is not a setting of scheme {scheme}; allowed: {', '.join(allowed_keys)}",
            )

    if scheme == "none":
        return VerifySpec(scheme="none", secret_env=(), secrets=())

    names = _parse_secret_env(raw.get("secret_env"), fail)
    secret_values: list[str] = []
    for var in names:
        value = env.get(var)
        if value is None:
            raise fail("verify.secret_env", f"environment variable {var} is not set")
        if value == "":
            raise fail("verify.secret_env", f"environment variable {var} is empty")
        if scheme == "standard" and _standard_key(value) is None:
            raise fail(
                "verify.secret_env",
                f"environment variable {var} does not hold a Standard Webhooks secret "
                f"(expected {_WHSEC} followed by non-empty base64)",
            )
        secret_values.append(value)

    tolerance = DEFAULT_TOLERANCE
    if "tolerance" in raw:
        tol = raw["tolerance"]
        # bool is an int subclass; `tolerance: yes` is not a number of seconds.
        if isinstance(tol, bool) or not isinstance(tol, int) or tol <= 0:
            raise fail(
                "verify.tolerance",
                f"must be a positive whole number of seconds, got {tol!r}",
            )
        tolerance = tol

    if scheme in _PRESETS:
        # Everything else is fixed by the preset (VerifySpec fills it in).
        return VerifySpec(
            scheme=scheme,  # type: ignore[arg-type]  # narrowed by the SCHEMES check
            secret_env=names,
            secrets=tuple(secret_values),
            tolerance=tolerance,
        )

    header: str | None = None
    if scheme in ("hmac", "token"):
        if "header" not in raw:
            example = "X-Signature" if scheme == "hmac" else "X-Gitlab-Token"
            raise fail(
                "verify.header",
                f"is required for scheme {scheme} (the header carrying the "
                f"{'signature' if scheme == 'hmac' else 'token'}, e.g. {example})",
            )
        header = _parse_header(raw["header"], "verify.header", fail)

    algorithm = raw.get("algorithm", "sha256")
    if algorithm not in ALGORITHMS:
        raise fail(
            "verify.algorithm",
            f"unknown algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}",
        )
    encoding = raw.get("encoding", "hex")
    if encoding not in ENCODINGS:
        raise fail(
            "verify.encoding",
            f"unknown encoding {encoding!r}; one of {', '.join(ENCODINGS)}",
        )
    prefix = raw.get("prefix", "")
    if not isinstance(prefix, str):
        raise fail("verify.prefix", f"must be a string such as 'sha256=', got {prefix!r}")

    timestamp_header: str | None = None
    signed_payload: str | None = None
    if scheme == "hmac":
        timestamp_header, signed_payload = _parse_signed_payload(raw, header, fail)

    return VerifySpec(
        scheme=scheme,  # type: ignore[arg-type]  # narrowed by the SCHEMES check
        secret_env=names,
        secrets=tuple(secret_values),
        tolerance=tolerance,
        header=header,
        algorithm=algorithm,
        encoding=encoding,
        prefix=prefix,
        timestamp_header=timestamp_header,
        signed_payload=signed_payload,
    )


def _parse_signed_payload(
    raw: Mapping[str, object], header: str | None, fail: _Fail
) -> tuple[str | None, str | None]:
    """`timestamp_header` and `signed_payload` of scheme hmac; a `tolerance` without a
    timestamp_header is refused (it would check nothing)."""
    timestamp_header: str | None = None
    if "timestamp_header" in raw:
        timestamp_header = _parse_header(raw["timestamp_header"], "verify.timestamp_header", fail)
        if timestamp_header.lower() == (header or "").lower():
            raise fail(
                "verify.timestamp_header",
                f"must differ from header ({header}): the timestamp and the signature "
                "travel in two headers",
            )
    elif "tolerance" in raw:
        raise fail(
            "verify.tolerance",
            "applies only with timestamp_header: scheme hmac signs no timestamp without it",
        )
    if "signed_payload" not in raw:
        return timestamp_header, None
    signed_payload = raw["signed_payload"]
    if not isinstance(signed_payload, str):
        raise fail(
            "verify.signed_payload",
            f"must be a string such as '{_TIMESTAMP_DOT_BODY}', got {signed_payload!r}",
        )
    try:
        _compile_payload(signed_payload, timestamp_header is not None)
    except ValueError as exc:
        raise fail("verify.signed_payload", f"{exc} (got {signed_payload!r})") from None
    return timestamp_header, signed_payload


def _parse_header(value: object, fld: str, fail: _Fail) -> str:
    if not isinstance(value, str) or not value or not set(value) <= _TCHARS:
        raise fail(fld, f"must be a header name, got {value!r}")
    return value


def _parse_secret_env(value: object, fail: _Fail) -> tuple[str, ...]:
    if value is None:
        raise fail(
            "verify.secret_env",
            "is required: the name of the environment variable holding the secret, "
            "or a list of names to allow rotation",
        )
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise fail(
            "verify.secret_env",
            "must be a variable name or a non-empty list of variable names",
        )
    names: list[str] = []
    for item in items:
        if not isinstance(item, str) or not _ENV_NAME.fullmatch(item):
            # The entry is not echoed: the likeliest cause is a secret pasted
            # where its variable's name belongs.
            raise fail(
                "verify.secret_env",
                "entries must be environment variable names (letters, digits and _, "
                "not starting with a digit); the secret itself goes in that variable",
            )
        if item in names:
            raise fail("verify.secret_env", f"{item} is listed twice")
        names.append(item)
    return tuple(names)


class _Fail(Protocol):
    def __call__(self, fld: str, message: str) -> ConfigError: ...


def _standard_key(secret: str) -> bytes | None:
    """Decode a Standard Webhooks secret, or None when it is not one.

    Like the reference libraries, the ``whsec_`` prefix is optional.
    """
    encoded = secret.removeprefix(_WHSEC)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None
    return key or None


# --------------------------------------------------------------------------- verify


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


def _raw(value: str) -> bytes:
    # Starlette decodes header bytes as latin-1, so encoding back as latin-1
    # recovers exactly what the sender signed; other mappings may hold wider text.
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


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
        raise _Reject(f"missing header {_GITHUB_HEADER} ({_GITHUB_SHA1_HEADER} is not accepted)")
    value = _only(values, _GITHUB_HEADER)
    if not value.startswith(_GITHUB_PREFIX):
        raise _Reject(f"header {_GITHUB_HEADER} lacks prefix {_GITHUB_PREFIX!r}")
    candidate = _raw(value[len(_GITHUB_PREFIX) :].lower())
    for key in spec.keys:
        if hmac.compare_digest(candidate, hmac.digest(key, body, "sha256").hex().encode()):
            return None
    raise _Reject("signature mismatch")


def _verify_stripe(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    value = _single(headers, _STRIPE_KEY, _STRIPE_HEADER)
    timestamp_text: str | None = None
    candidates: list[bytes] = []
    for item in value.split(","):
        name, sep, part = item.strip().partition("=")
        if not sep:
            raise _Reject(f"malformed header {_STRIPE_HEADER}")
        if name == "t":
            if timestamp_text is not None:
                raise _Reject(f"malformed header {_STRIPE_HEADER}")
            timestamp_text = part
        elif name == "v1":
            candidates.append(_raw(part.lower()))
        # v0 and unknown schemes are ignored, as Stripe's own libraries do.
    if timestamp_text is None or (timestamp := _digits(timestamp_text)) is None:
        raise _Reject(f"malformed header {_STRIPE_HEADER}")
    if not candidates:
        raise _Reject(f"no v1 signature in {_STRIPE_HEADER}")
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
    found = [(headers.getlist(std), headers.getlist(svix)) for std, svix in _STD_ALIASES]
    # A sender that uses the svix- names alone is told about those in messages.
    svix_only = any(s for _, s in found) and not any(w for w, _ in found)
    found_fields: list[tuple[str, str]] = []
    for (std, svix), (std_values, svix_values) in zip(_STD_ALIASES, found, strict=True):
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
            candidates.append(_raw(sig))
    if not candidates:
        raise _Reject(f"no v1 signature in {signature_label}")
    _check_time(timestamp, now, spec.tolerance)
    message = _raw(msg_id) + b"." + _raw(timestamp_text) + b"." + body
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
    candidate = _raw(text)
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
        if hmac.compare_digest(candidate, _encode_digest(spec, key, body, timestamp)):
            return None
    raise _Reject("signature mismatch")


def _verify_token(spec: VerifySpec, headers: HeaderLookup, body: bytes, now: float) -> None:
    """`token` and `gitlab`: the header holds the shared token itself."""
    label = spec.header or ""
    candidate = _raw(_single(headers, spec.header_key, label))
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


def _encode_digest(spec: VerifySpec, key: bytes, body: bytes, timestamp: bytes) -> bytes:
    if spec.payload == (("body", b""),):
        # The usual case (the body alone): one call, and the body is not copied.
        digest = hmac.digest(key, body, spec.algorithm)
    else:
        mac = hmac.new(key, digestmod=spec.algorithm)
        for kind, text in spec.payload:
            mac.update(body if kind == "body" else timestamp if kind == "timestamp" else text)
        digest = mac.digest()
    return digest.hex().encode() if spec.encoding == "hex" else base64.b64encode(digest)


# --------------------------------------------------------------------------- sign


def sign(
    spec: VerifySpec, body: bytes, now: float, *, event_id: str | None = None
) -> dict[str, str]:
    """Headers a real sender would add to ``body``, signed with the first secret.

    Used by tests, the benchmark and ``realm triggers test --sign``.
    ``event_id`` sets ``webhook-id`` for the standard scheme (else a random
    ``msg_<hex>``); other schemes carry no signed event id.
    """
    if spec.scheme == "none":
        return {}
    key = spec.keys[0]
    if spec.scheme == "github":
        return {_GITHUB_HEADER: _GITHUB_PREFIX + hmac.digest(key, body, "sha256").hex()}
    if spec.scheme == "stripe":
        t = str(int(now))
        sig = hmac.digest(key, t.encode() + b"." + body, "sha256").hex()
        return {_STRIPE_HEADER: f"t={t},v1={sig}"}
    if spec.scheme == "standard":
        msg_id = event_id if event_id is not None else f"msg_{token_hex(12)}"
        t = str(int(now))
        message = _raw(msg_id) + b"." + t.encode() + b"." + body
        sig = base64.b64encode(hmac.digest(key, message, "sha256")).decode()
        return {_STD_ID: msg_id, _STD_TIMESTAMP: t, _STD_SIGNATURE: f"v1,{sig}"}
    if spec.scheme in _HMAC_SCHEMES:
        t = str(int(now))
        encoded = _encode_digest(spec, key, body, t.encode()).decode()
        headers = {spec.header or "": spec.prefix + encoded}
        if spec.timestamp_header:
            headers[spec.timestamp_header] = t
        return headers
    # token and gitlab: the sender puts the shared token itself in the header.
    return {spec.header or "": spec.secrets[0]}


def describe(spec: VerifySpec) -> str:
    """Short label for tables, e.g. ``hmac sha256 hex X-Signature``; never a secret."""
    if spec.scheme == "hmac":
        label = f"hmac {spec.algorithm} {spec.encoding} {spec.header}"
        if spec.timestamp_header:
            label += f", timestamp {spec.timestamp_header} ±{spec.tolerance} s"
        return label
    if spec.scheme == "token":
        return f"token {spec.header}"
    if spec.scheme in ("stripe", "standard", "slack") and spec.tolerance != DEFAULT_TOLERANCE:
        return f"{spec.scheme} ±{spec.tolerance} s"
    return spec.scheme
