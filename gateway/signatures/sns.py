"""Amazon SNS message signatures (scheme ``sns``): the settings of a ``verify: {scheme:
sns}`` block, which URLs may serve a signing certificate or confirm a subscription,
the string SNS signs, and the check of a message against a certificate.

SNS signs its JSON body, not a header: ``Signature`` (base64) is RSA PKCS#1 v1.5 over
SHA-1 (``SignatureVersion`` "1") or SHA-256 ("2") of the string built from the
message's fields (AWS, "Verifying the signatures of Amazon SNS messages"), with the
key of the X.509 certificate at ``SigningCertURL``.

Pure code: no I/O, no clock. The certificate is fetched (over https, from an SNS host
only) and cached by gateway/ingest/sns_certs.py, which hands ``verify_sns`` what it
holds: per (``ca_file``, URL), the certificate or why it could not be had. A reason
names fields and rules, never a signature, a token or a URL's query.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from gateway.model.errors import ConfigError

__all__ = [
    "AWS_HOST",
    "CertificateKey",
    "Certificates",
    "SnsSettings",
    "certificate_key",
    "certificate_problem",
    "check_url",
    "describe_sns",
    "parse_sns",
    "sign_message",
    "signing_certificate_url",
    "string_to_sign",
    "topic_allowed",
    "verify_body",
    "verify_sns",
]

# The hosts AWS serves SNS certificates and confirmations from, as AWS's own
# validators check them (aws-js-sns-message-validator, the AWS SDK for PHP's
# MessageValidator): sns.<region>.amazonaws.com, and .amazonaws.com.cn in China.
AWS_HOST = re.compile(r"sns\.[a-zA-Z0-9\-]{3,}\.amazonaws\.com(\.cn)?")

# The fields signed, in the order signed, per message type.
_NOTIFICATION = ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type")
_CONFIRMATION = ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type")
_SIGNED_FIELDS = {
    "Notification": _NOTIFICATION,
    "SubscriptionConfirmation": _CONFIRMATION,
    "UnsubscribeConfirmation": _CONFIRMATION,
}
# Fields whose absence is tolerated (Subject is optional in a Notification).
_OPTIONAL = frozenset({"Subject"})
_HASHES: dict[str, type[hashes.HashAlgorithm]] = {"1": hashes.SHA1, "2": hashes.SHA256}

# What a topic_arn entry may be: an ARN, with * standing for any run of characters
# other than ':' (one account's topics: arn:aws:sns:*:123456789012:*).
_ARN = re.compile(r"arn:[A-Za-z0-9\-*]+:sns:[A-Za-z0-9\-*]*:[0-9*]*:[A-Za-z0-9_\-.*]+")


@dataclass(frozen=True)
class SnsSettings:
    """A ``sns`` trigger's settings: the topics it accepts (exact ARNs or patterns with
    ``*``), and, for tests and private endpoints only, the hosts trusted to serve
    certificates and confirm subscriptions (``host`` or ``host:port``; empty: AWS's
    rule, port 443) and the CA bundle their TLS is checked against (None: the
    system's)."""

    topic_arns: tuple[str, ...]
    certificate_hosts: tuple[str, ...] = ()
    ca_file: str | None = None
    # Derived: each topic_arn as a pattern (a * matches any run of characters but ':').
    patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        patterns = tuple(
            re.compile("[^:]*".join(re.escape(part) for part in arn.split("*")))
            for arn in self.topic_arns
        )
        object.__setattr__(self, "patterns", patterns)


def topic_allowed(settings: SnsSettings, topic_arn: str) -> bool:
    return any(p.fullmatch(topic_arn) for p in settings.patterns)


def describe_sns(settings: SnsSettings) -> str:
    """The label of ``describe``: ``sns arn:…:orders`` or ``sns 3 topics``."""
    arns = settings.topic_arns
    label = f"sns {arns[0]}" if len(arns) == 1 else f"sns {len(arns)} topics"
    return label + (", private hosts" if settings.certificate_hosts else "")


# --- The YAML block ---------------------------------------------------------------

ALLOWED_KEYS = ("scheme", "topic_arn", "certificate_hosts", "ca_file")


class _Fail(Protocol):
    def __call__(self, fld: str, message: str) -> ConfigError: ...


def parse_sns(raw: Mapping[str, Any], fail: _Fail) -> SnsSettings:
    """The settings of a ``verify: {scheme: sns, ...}`` block (its keys already checked
    against ``ALLOWED_KEYS``); ``fail`` builds parse.py's ConfigError."""
    if "topic_arn" not in raw:
        # Without it any AWS account's topic could subscribe this endpoint (the
        # subscription confirmation is answered automatically) and post to it.
        raise fail(
            "verify.topic_arn",
            "is required: the ARN of the topic (or a list of them) whose messages this "
            "trigger accepts, e.g. arn:aws:sns:us-east-1:123456789012:orders; * stands "
            "for any characters but ':' (arn:aws:sns:*:123456789012:*)",
        )
    arns = _strings(raw["topic_arn"], "verify.topic_arn", "an ARN or a list of ARNs", fail)
    for arn in arns:
        if not _ARN.fullmatch(arn):
            raise fail(
                "verify.topic_arn",
                f"{arn!r} is not an SNS topic ARN (arn:aws:sns:<region>:<account>:<topic>)",
            )
    hosts: tuple[str, ...] = ()
    if "certificate_hosts" in raw:
        hosts = _strings(
            raw["certificate_hosts"], "verify.certificate_hosts", "a list of host names", fail
        )
        for host in hosts:
            name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
            if not re.fullmatch(r"[A-Za-z0-9\-.]+", name) or (port and not port.isdigit()):
                raise fail(
                    "verify.certificate_hosts",
                    f"{host!r} is not a host name or host:port (for tests and private "
                    "endpoints only; leave it out for AWS)",
                )
    ca_file = raw.get("ca_file")
    if ca_file is not None and (not isinstance(ca_file, str) or not ca_file):
        raise fail("verify.ca_file", f"must be the path of a PEM CA bundle, got {ca_file!r}")
    return SnsSettings(topic_arns=arns, certificate_hosts=hosts, ca_file=ca_file)


def _strings(value: object, fld: str, what: str, fail: _Fail) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
        raise fail(fld, f"must be {what}, got {value!r}")
    if len(set(items)) != len(items):
        raise fail(fld, "lists an entry twice")
    return tuple(items)


# --- URLs ---------------------------------------------------------------------------


def check_url(settings: SnsSettings, url: object, field: str) -> str | None:
    """Why ``url`` may not be fetched (a certificate) or visited (a SubscribeURL), or
    None: https, no credentials, and a host of AWS's rule on port 443, or one of
    ``certificate_hosts``. The reason names the field and the host, never the query."""
    if not isinstance(url, str) or not url:
        return f"{field} missing or not a string"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return f"{field} is not a URL"
    if parts.scheme != "https":
        return f"{field} is not https"
    host = (parts.hostname or "").lower()
    if parts.username is not None or parts.password is not None or not host:
        return f"{field} is not a plain https URL"
    port = port or 443
    if settings.certificate_hosts:
        allowed = {h.lower() for h in settings.certificate_hosts}
        if f"{host}:{port}" in allowed or (port == 443 and host in allowed):
            return None
        return f"{field} host {_shown(host, port)} is not one of certificate_hosts"
    if not AWS_HOST.fullmatch(host) or port != 443:
        return f"{field} host {_shown(host, port)} is not an SNS host (sns.<region>.amazonaws.com)"
    return None


def _shown(host: str, port: int) -> str:
    text = host if port == 443 else f"{host}:{port}"
    return repr(text if len(text) <= 80 else text[:80] + "…")


CertificateKey = tuple[str | None, str]
# What gateway/ingest/sns_certs.py hands verify: per (ca_file, URL), the certificate,
# or why it could not be had.
Certificates = Mapping[CertificateKey, x509.Certificate | str]


def certificate_key(settings: SnsSettings, url: str) -> CertificateKey:
    """A certificate is cached under its URL and the CA bundle its TLS was checked
    with: one fetched under one trigger's ``ca_file`` proves nothing to another's."""
    return (settings.ca_file, url)


def signing_certificate_url(settings: SnsSettings, doc: object) -> tuple[str | None, str | None]:
    """(the URL of the certificate to fetch, None) for a message worth a fetch, else
    (None, why not): every check that needs no certificate runs first (the type, the
    signature version, the topic, the URL's rule), so junk and other topics cost no
    request."""
    try:
        _precheck(settings, doc)
    except _Reject as reject:
        return None, str(reject)
    assert isinstance(doc, dict)
    return doc["SigningCertURL"], None


# --- Verification -------------------------------------------------------------------


class _Reject(Exception):
    pass


def string_to_sign(doc: Mapping[str, Any]) -> bytes | None:
    """The bytes SNS signs for a message: "Name\\nValue\\n" per signed field, in AWS's
    order for its ``Type``; None for an unknown type, a missing required field or a
    value that is not a string."""
    kind = doc.get("Type")
    # A str check first: a list or an object is unhashable, and a dict lookup raises.
    fields = _SIGNED_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return None
    out: list[str] = []
    for name in fields:
        value = doc.get(name)
        if value is None and name in _OPTIONAL:
            continue
        if not isinstance(value, str):
            return None
        out += (name, "\n", value, "\n")
    return "".join(out).encode("utf-8")


def _precheck(settings: SnsSettings, doc: object) -> tuple[bytes, bytes, str]:
    """(string to sign, signature, signature version), or _Reject."""
    if not isinstance(doc, dict):
        raise _Reject("body is not an SNS message (a JSON object)")
    kind = doc.get("Type")
    if not isinstance(kind, str) or kind not in _SIGNED_FIELDS:
        raise _Reject("body is not an SNS message (Type)")
    version = doc.get("SignatureVersion")
    if not isinstance(version, str) or version not in _HASHES:
        raise _Reject("SignatureVersion is not 1 or 2")
    topic = doc.get("TopicArn")
    if not isinstance(topic, str) or not topic_allowed(settings, topic):
        # Checked before the signature: another topic's message costs no fetch.
        raise _Reject("TopicArn is not one of this trigger's topic_arn")
    message = string_to_sign(doc)
    if message is None:
        missing = [
            n
            for n in _SIGNED_FIELDS[kind]
            if n not in _OPTIONAL and not isinstance(doc.get(n), str)
        ]
        raise _Reject(f"SNS {kind} lacks {', '.join(missing) or 'a string field'}")
    text = doc.get("Signature")
    try:
        signature = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
    except (binascii.Error, ValueError):
        signature = b""
    if not signature:
        raise _Reject("Signature missing or not base64")
    problem = check_url(settings, doc.get("SigningCertURL"), "SigningCertURL")
    if problem:
        raise _Reject(problem)
    return message, signature, version


def certificate_problem(certificate: x509.Certificate, now: float) -> str | None:
    """Why ``certificate`` cannot check a signature at ``now`` (expired, not yet valid,
    not an RSA key), or None."""
    if not (
        certificate.not_valid_before_utc.timestamp()
        <= now
        <= certificate.not_valid_after_utc.timestamp()
    ):
        return "signing certificate is expired or not yet valid"
    if not isinstance(certificate.public_key(), rsa.RSAPublicKey):
        return "signing certificate does not hold an RSA key"
    return None


def verify_sns(
    settings: SnsSettings, doc: object, certificates: Certificates, now: float
) -> str | None:
    """None when ``doc`` (the parsed body) is an SNS message of an allowed topic, signed
    with the key of the certificate its SigningCertURL names; else a short reason.

    ``certificates`` is what the caller fetched (gateway/ingest/sns_certs.py): a URL it
    does not hold is a refusal, never a fetch."""
    try:
        message, signature, version = _precheck(settings, doc)
        assert isinstance(doc, dict)
        held = certificates.get(certificate_key(settings, doc["SigningCertURL"]))
        if held is None:
            raise _Reject("signing certificate not fetched")
        if isinstance(held, str):
            raise _Reject(held)
        problem = certificate_problem(held, now)
        if problem:
            raise _Reject(problem)
        key = held.public_key()
        assert isinstance(key, rsa.RSAPublicKey)
        try:
            key.verify(signature, message, padding.PKCS1v15(), _HASHES[version]())
        except InvalidSignature:
            raise _Reject("signature mismatch") from None
    except _Reject as reject:
        return str(reject)
    return None


def verify_body(
    settings: SnsSettings, body: bytes, certificates: Certificates, now: float
) -> str | None:
    """``verify_sns`` of a raw body (SNS posts JSON as text/plain)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "body is not an SNS message (not JSON)"
    return verify_sns(settings, doc, certificates, now)


def sign_message(doc: dict[str, Any], private_key: rsa.RSAPrivateKey, version: str = "1") -> str:
    """The ``Signature`` SNS would give ``doc`` with ``private_key``: for tests and
    `realm send`. ``doc`` must hold the signed fields of its Type."""
    message = string_to_sign(doc)
    if message is None or version not in _HASHES:
        raise ValueError("not a signable SNS message (Type, fields or SignatureVersion)")
    raw = private_key.sign(message, padding.PKCS1v15(), _HASHES[version]())
    return base64.b64encode(raw).decode()
