"""A trigger's ``verify:`` block, read from YAML into a ``VerifySpec``: which keys each
scheme accepts, where the secrets come from, and every check with its message.

The caller passes the environment, so that tests can pin it. A secret's value
never reaches a message, and a secret pasted into the YAML is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol
from urllib.parse import urlsplit

from gateway.model.errors import ConfigError
from gateway.signatures.ed25519 import WHPK, WHSK, is_asymmetric, key_problem
from gateway.signatures.schemes import (
    ALGORITHMS,
    DEFAULT_TOLERANCE,
    ENCODINGS,
    PRESETS,
    SCHEMES,
    TOLERANCES,
    URL_SCHEMES,
    WHSEC,
    is_header_name,
    standard_key,
)
from gateway.signatures.sns import ALLOWED_KEYS as SNS_KEYS
from gateway.signatures.sns import parse_sns
from gateway.signatures.spec import TIMESTAMP_DOT_BODY, VerifySpec, compile_payload

__all__ = ["parse_verify"]

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
    "zoom": ("scheme", "secret_env", "tolerance"),
    "meta": ("scheme", "secret_env", "verify_token_env"),
    "paddle": ("scheme", "secret_env", "tolerance"),
    "linear": ("scheme", "secret_env", "tolerance"),
    "square": ("scheme", "secret_env", "url"),
    "twilio": ("scheme", "secret_env", "url"),
    "twitter": ("scheme", "secret_env"),
    "discord": ("scheme", "secret_env", "tolerance"),
    "sns": SNS_KEYS,
}

# What `url` names for each scheme that signs one, for the message when it is missing.
_URL_HINTS = {
    "square": "the notification URL of the subscription, as configured in Square",
    "twilio": "the full URL Twilio requests, query string included, as configured in Twilio",
}

# What secret_env entries may look like (a POSIX-style variable name).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    if scheme == "sns":  # no secret: AWS's certificate (gateway/signatures/sns.py)
        return VerifySpec(scheme="sns", secret_env=(), secrets=(), sns=parse_sns(raw, fail))

    names = _parse_secret_env(raw.get("secret_env"), fail)
    secret_values: list[str] = []
    for var in names:
        value = env.get(var)
        if value is None:
            raise fail("verify.secret_env", f"environment variable {var} is not set")
        if value == "":
            raise fail("verify.secret_env", f"environment variable {var} is empty")
        problem = key_problem(scheme, var, value)  # Ed25519 keys: whpk_/whsk_, discord
        if problem:
            raise fail("verify.secret_env", problem)
        if scheme == "standard" and standard_key(value) is None and not is_asymmetric(value):
            raise fail(
                "verify.secret_env",
                f"environment variable {var} does not hold a Standard Webhooks secret "
                f"(expected {WHSEC} followed by non-empty base64, or {WHPK}/{WHSK} for v1a)",
            )
        secret_values.append(value)

    tolerance = TOLERANCES.get(scheme, DEFAULT_TOLERANCE)
    if "tolerance" in raw:
        tol = raw["tolerance"]
        # bool is an int subclass; `tolerance: yes` is not a number of seconds.
        if isinstance(tol, bool) or not isinstance(tol, int) or tol <= 0:
            raise fail(
                "verify.tolerance",
                f"must be a positive whole number of seconds, got {tol!r}",
            )
        tolerance = tol

    if scheme in PRESETS:
        url = _parse_url(raw, scheme, fail) if scheme in URL_SCHEMES else None
        token_env: tuple[str, ...] = ()
        tokens: list[str] = []
        if "verify_token_env" in raw:
            # Secrets too (Meta's GET subscription check compares one), read as
            # secret_env is; the handshake compares them, verify() never does.
            token_env = _parse_secret_env(raw["verify_token_env"], fail, "verify.verify_token_env")
            for var in token_env:
                value = env.get(var)
                if not value:
                    problem = "is not set" if value is None else "is empty"
                    raise fail("verify.verify_token_env", f"environment variable {var} {problem}")
                tokens.append(value)
        # Everything else is fixed by the preset (VerifySpec fills it in).
        return VerifySpec(
            scheme=scheme,  # type: ignore[arg-type]  # narrowed by the SCHEMES check
            secret_env=names,
            secrets=tuple(secret_values),
            tolerance=tolerance,
            url=url,
            verify_token_env=token_env,
            verify_tokens=tuple(tokens),
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
            f"must be a string such as '{TIMESTAMP_DOT_BODY}', got {signed_payload!r}",
        )
    try:
        compile_payload(signed_payload, timestamp_header is not None)
    except ValueError as exc:
        raise fail("verify.signed_payload", f"{exc} (got {signed_payload!r})") from None
    return timestamp_header, signed_payload


def _parse_url(raw: Mapping[str, object], scheme: str, fail: _Fail) -> str:
    """`url` of square and twilio: the absolute http(s) URL the sender signs, as given
    (it is signed character for character, so nothing is normalised)."""
    if "url" not in raw:
        raise fail(
            "verify.url",
            f"is required for scheme {scheme}: {_URL_HINTS[scheme]} "
            f"(e.g. https://hooks.example.com/hooks/{scheme})",
        )
    url = raw["url"]
    if not isinstance(url, str):
        raise fail("verify.url", f"must be a URL such as https://hooks.example.com/, got {url!r}")
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises ValueError
    except ValueError:
        raise fail("verify.url", "is not a valid URL") from None
    if "@" in parts.netloc:
        # Checked first and never echoed: a user:password there is a credential.
        raise fail("verify.url", "must not contain credentials (user:password@)")
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise fail("verify.url", f"must be an absolute http or https URL, got {url!r}")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise fail("verify.url", f"must not contain spaces or control characters, got {url!r}")
    if parts.fragment:
        raise fail("verify.url", f"must not have a #fragment (no sender signs one), got {url!r}")
    return url


def _parse_header(value: object, fld: str, fail: _Fail) -> str:
    if not is_header_name(value):
        raise fail(fld, f"must be a header name, got {value!r}")
    return value


def _parse_secret_env(
    value: object, fail: _Fail, fld: str = "verify.secret_env"
) -> tuple[str, ...]:
    if value is None:
        raise fail(
            fld,
            "is required: the name of the environment variable holding the secret, "
            "or a list of names to allow rotation",
        )
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise fail(
            fld,
            "must be a variable name or a non-empty list of variable names",
        )
    names: list[str] = []
    for item in items:
        if not isinstance(item, str) or not _ENV_NAME.fullmatch(item):
            # The entry is not echoed: the likeliest cause is a secret pasted
            # where its variable's name belongs.
            raise fail(
                fld,
                "entries must be environment variable names (letters, digits and _, "
                "not starting with a digit); the secret itself goes in that variable",
            )
        if item in names:
            raise fail(fld, f"{item} is listed twice")
        names.append(item)
    return tuple(names)


class _Fail(Protocol):
    def __call__(self, fld: str, message: str) -> ConfigError: ...
