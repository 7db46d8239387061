"""Amazon SNS signatures (scheme `sns`): the string to sign, the certificate fetched over
https from a trusted host only and cached (gateway/ingest/sns_certs.py), the pure check
(gateway/signatures/sns.py, through verify()), and the SubscribeURL visit.

A local HTTPS server stands in for SNS: a test CA made here signs its TLS certificate
(for 127.0.0.1) and the "SNS" signing certificate it serves; the triggers trust that
CA through `ca_file` and the server through `certificate_hosts`, as a test or a private
cloud would. Messages are signed here as AWS documents it ("Verifying the signatures of
Amazon SNS messages"): RSA PKCS#1 v1.5 over SHA-1 (SignatureVersion 1) or SHA-256 (2)
of "Name\\nValue\\n" per signed field. The string-to-sign example of that page is
copied below. No Redis; no network beyond 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from starlette.datastructures import Headers

from gateway.ingest.sns_certs import (
    CertificateCache,
    prepare,
    prepare_delivery,
    visit_subscribe_url,
)
from gateway.model.errors import ConfigError
from gateway.signatures.parse import parse_verify
from gateway.signatures.sign import sign
from gateway.signatures.sns import check_url, sign_message, string_to_sign
from gateway.signatures.spec import VerifySpec, describe
from gateway.signatures.verify import verify

TOPIC = "arn:aws:sns:us-east-2:123456789012:orders"
TOKEN = "2336412f37fb687f5d51e6e2425dacbba15d8b1b2ba5c6bbd1b1e4bb1a1dde8e"
NO_HEADERS = Headers({})

# --- A test PKI (made once per module) ----------------------------------------------


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _cert(
    subject: str,
    key: rsa.RSAPrivateKey,
    issuer: tuple[x509.Name, rsa.RSAPrivateKey] | None,
    *,
    ca: bool = False,
    ip: str | None = None,
    days: tuple[int, int] = (-1, 30),
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer if issuer else (name, key)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + dt.timedelta(days=days[0]))
        .not_valid_after(now + dt.timedelta(days=days[1]))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    if ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class Pki:
    def __init__(self, root: Path) -> None:
        self.ca_key = _key()
        self.ca = _cert("Realm Test CA", self.ca_key, None, ca=True)
        issuer = (self.ca.subject, self.ca_key)
        self.tls_key = _key()
        self.tls = _cert("127.0.0.1", self.tls_key, issuer, ip="127.0.0.1")
        # The certificate SNS signs with, and one past its validity.
        self.signing_key = _key()
        self.signing = _cert("sns.amazonaws.com", self.signing_key, issuer)
        self.expired = _cert("sns.amazonaws.com", self.signing_key, issuer, days=(-30, -1))
        self.ca_file = root / "ca.pem"
        self.ca_file.write_bytes(_pem(self.ca))
        self.tls_file = root / "tls.pem"
        self.tls_file.write_bytes(
            _pem(self.tls)
            + self.tls_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("sns-pki"))


# --- The stand-in for SNS -----------------------------------------------------------


class FakeSns:
    """An HTTPS server on a free 127.0.0.1 port, in a thread: serves the signing
    certificate (and some wrong answers), takes SubscribeURL visits, and records the
    path of every request it was sent."""

    def __init__(self, pki: Pki) -> None:
        self.requests: list[str] = []
        routes: dict[str, tuple[int, bytes, dict[str, str]]] = {
            "/cert.pem": (200, _pem(pki.signing), {}),
            "/expired.pem": (200, _pem(pki.expired), {}),
            "/junk.pem": (200, b"not a certificate", {}),
            "/missing.pem": (404, b"", {}),
            "/moved.pem": (302, b"", {"Location": "/cert.pem"}),
            "/confirm": (200, b"<ConfirmSubscriptionResponse/>", {}),
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                status, body, headers = routes.get(self.path.split("?")[0], (404, b"", {}))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.tls_file)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.host = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def url(self, path: str) -> str:
        return f"https://{self.host}{path}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def sns(pki: Pki) -> Iterator[FakeSns]:
    server = FakeSns(pki)
    yield server
    server.stop()


@pytest.fixture
def cache() -> CertificateCache:
    return CertificateCache()


def trigger(sns: FakeSns | None, pki: Pki, **more: Any) -> VerifySpec:
    raw: dict[str, Any] = {"scheme": "sns", "topic_arn": TOPIC}
    if sns is not None:
        raw |= {"certificate_hosts": [sns.host], "ca_file": str(pki.ca_file)}
    return parse_verify(raw | more, file="f", trigger="t", env={})


# --- Messages, signed as AWS documents it (not with the code under test) ---------------


def aws_string(doc: dict[str, Any]) -> bytes:
    if doc["Type"] == "Notification":
        names = ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
    else:
        names = ["Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type"]
    return "".join(f"{n}\n{doc[n]}\n" for n in names if n in doc).encode()


def message(
    pki: Pki,
    cert_url: str,
    *,
    kind: str = "Notification",
    version: str = "1",
    topic: str = TOPIC,
    subject: str | None = "Order shipped",
    subscribe_url: str = "",
    key: rsa.RSAPrivateKey | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "Type": kind,
        "MessageId": "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
        "TopicArn": topic,
        "Message": '{"order": 42, "note": "line one\\nline two"}',
        "Timestamp": "2026-12-05T06:00:00.000Z",
        "SignatureVersion": version,
        "SigningCertURL": cert_url,
    }
    if kind == "Notification":
        if subject is not None:
            doc["Subject"] = subject
        doc["UnsubscribeURL"] = "https://sns.us-east-2.amazonaws.com/?Action=Unsubscribe"
    else:
        doc["Token"] = TOKEN
        doc["SubscribeURL"] = subscribe_url or f"https://sns.us-east-2.amazonaws.com/?Token={TOKEN}"
    digest = hashes.SHA1() if version == "1" else hashes.SHA256()
    raw = (key or pki.signing_key).sign(aws_string(doc), padding.PKCS1v15(), digest)
    doc["Signature"] = base64.b64encode(raw).decode()
    return doc


async def check(
    spec: VerifySpec, doc: dict[str, Any] | bytes, cache: CertificateCache
) -> str | None:
    """The request path's two steps: fetch what the message names, then verify."""
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    certificates = await prepare_delivery([spec], body, cache=cache)
    return verify(spec, NO_HEADERS, body, time.time(), certificates=certificates)


def no_secret_in(reason: str | None, doc: dict[str, Any]) -> None:
    assert reason is not None
    assert doc["Signature"] not in reason and TOKEN not in reason


# --- The string to sign -------------------------------------------------------------


def test_string_to_sign_is_aws_example() -> None:
    # AWS's example (Verifying the signatures of Amazon SNS messages), byte for byte.
    doc = {
        "Type": "Notification",
        "MessageId": "4d4dc071-ddbf-465d-bba8-08f81c89da64",
        "TopicArn": "arn:aws:sns:us-east-2:123456789012:s4-MySNSTopic-1G1WEFCOXTC0P",
        "Subject": "My subject",
        "Message": "My Test Message",
        "Timestamp": "2019-01-31T04:37:04.321Z",
        "SignatureVersion": "1",
    }
    assert string_to_sign(doc) == (
        b"Message\nMy Test Message\n"
        b"MessageId\n4d4dc071-ddbf-465d-bba8-08f81c89da64\n"
        b"Subject\nMy subject\n"
        b"Timestamp\n2019-01-31T04:37:04.321Z\n"
        b"TopicArn\narn:aws:sns:us-east-2:123456789012:s4-MySNSTopic-1G1WEFCOXTC0P\n"
        b"Type\nNotification\n"
    )
    confirmation = {
        "Type": "SubscriptionConfirmation",
        "MessageId": "3d891288-136d-417f-bc05-901c108273ee",
        "Token": "233",
        "TopicArn": "arn:aws:sns:us-east-2:123456789012:s4-MySNSTopic-1G1WEFCOXTC0P",
        "Message": "My Test Message",
        "SubscribeURL": "https://sns.us-east-2.amazonaws.com/?Action=ConfirmSubscription",
        "Timestamp": "2019-01-31T19:25:13.719Z",
    }
    assert string_to_sign(confirmation) == (
        b"Message\nMy Test Message\n"
        b"MessageId\n3d891288-136d-417f-bc05-901c108273ee\n"
        b"SubscribeURL\nhttps://sns.us-east-2.amazonaws.com/?Action=ConfirmSubscription\n"
        b"Timestamp\n2019-01-31T19:25:13.719Z\n"
        b"Token\n233\n"
        b"TopicArn\narn:aws:sns:us-east-2:123456789012:s4-MySNSTopic-1G1WEFCOXTC0P\n"
        b"Type\nSubscriptionConfirmation\n"
    )
    del doc["Subject"]  # optional: left out of the string when absent
    assert b"Subject" not in (string_to_sign(doc) or b"")


def test_sign_message_matches_aws_rule(pki: Pki) -> None:
    for version in ("1", "2"):
        doc = message(pki, "https://sns.us-east-2.amazonaws.com/x.pem", version=version)
        # PKCS#1 v1.5 is deterministic: the helper gives exactly the bytes computed here.
        assert sign_message(doc, pki.signing_key, version) == doc["Signature"]


# --- Verification -------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize(
    ("kind", "subject"),
    [
        ("Notification", "Order shipped"),
        ("Notification", None),
        ("SubscriptionConfirmation", None),
        ("UnsubscribeConfirmation", None),
    ],
)
async def test_genuine(
    sns: FakeSns, pki: Pki, cache: CertificateCache, version: str, kind: str, subject: str | None
) -> None:
    doc = message(pki, sns.url("/cert.pem"), kind=kind, version=version, subject=subject)
    assert await check(trigger(sns, pki), doc, cache) is None
    assert sns.requests == ["/cert.pem"]


async def test_tampered(sns: FakeSns, pki: Pki, cache: CertificateCache) -> None:
    spec = trigger(sns, pki)
    for field, value in (
        ("Message", '{"order": 43}'),
        ("Subject", "Order cancelled"),
        ("MessageId", "another"),
        ("Type", "SubscriptionConfirmation"),
    ):
        doc = message(pki, sns.url("/cert.pem"))
        doc[field] = value
        reason = await check(spec, doc, cache)
        expected = "signature mismatch" if field != "Type" else "SNS SubscriptionConfirmation lacks"
        assert reason is not None and reason.startswith(expected), (field, reason)
        no_secret_in(reason, doc)
    # Signed with another key: the certificate's key does not verify it.
    doc = message(pki, sns.url("/cert.pem"), key=_key())
    assert await check(spec, doc, cache) == "signature mismatch"
    # A v1 signature presented as v2 (and so hashed with SHA-256): refused.
    doc = message(pki, sns.url("/cert.pem"), version="1")
    doc["SignatureVersion"] = "2"
    assert await check(spec, doc, cache) == "signature mismatch"


async def test_wrong_topic_refused_without_fetch(
    sns: FakeSns, pki: Pki, cache: CertificateCache
) -> None:
    doc = message(pki, sns.url("/cert.pem"), topic="arn:aws:sns:us-east-2:999999999999:orders")
    reason = await check(trigger(sns, pki), doc, cache)
    assert reason == "TopicArn is not one of this trigger's topic_arn"
    assert sns.requests == [] and cache.fetches == 0
    # Patterns: one account's topics in any region.
    pattern = trigger(sns, pki, topic_arn=["arn:aws:sns:*:123456789012:*"])
    assert await check(pattern, message(pki, sns.url("/cert.pem")), cache) is None
    other = message(pki, sns.url("/cert.pem"), topic="arn:aws:sns:us-east-2:1234567890123:x")
    assert await check(pattern, other, cache) == "TopicArn is not one of this trigger's topic_arn"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            "https://sns.us-east-2.amazonaws.com.evil.test/cert.pem",
            "SigningCertURL host 'sns.us-east-2.amazonaws.com.evil.test' is not one of "
            "certificate_hosts",
        ),
        (
            "https://127.0.0.1/cert.pem",
            "SigningCertURL host '127.0.0.1' is not one of certificate_hosts",
        ),
        ("ftp://x/cert.pem", "SigningCertURL is not https"),
        ("https://user:pw@127.0.0.1/cert.pem", "SigningCertURL is not a plain https URL"),
    ],
)
async def test_untrusted_host_refused_without_fetch(
    sns: FakeSns, pki: Pki, cache: CertificateCache, url: str, reason: str
) -> None:
    doc = message(pki, url)
    spec = trigger(sns, pki)
    assert await prepare(spec, orjson.dumps(doc), cache=cache) == reason
    assert await check(spec, doc, cache) == reason
    assert sns.requests == [] and cache.fetches == 0


async def test_aws_rule_by_default(sns: FakeSns, pki: Pki, cache: CertificateCache) -> None:
    # Without certificate_hosts only sns.<region>.amazonaws.com(.cn) on 443 is trusted:
    # the local server is refused before any request.
    spec = trigger(None, pki)
    doc = message(pki, sns.url("/cert.pem"))
    reason = await check(spec, doc, cache)
    assert reason == (
        f"SigningCertURL host '{sns.host}' is not an SNS host (sns.<region>.amazonaws.com)"
    )
    assert sns.requests == [] and cache.fetches == 0
    settings = spec.sns
    assert settings is not None
    for good in (
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem",
        "https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-abc.pem",
        "https://SNS.eu-west-3.amazonaws.com:443/x.pem",
    ):
        assert check_url(settings, good, "SigningCertURL") is None, good
    for bad in (
        "http://sns.us-east-1.amazonaws.com/x.pem",
        "https://sns.us-east-1.amazonaws.com:8443/x.pem",
        "https://sns.us-east-1.amazonaws.com.evil.test/x.pem",
        "https://evil.test/sns.us-east-1.amazonaws.com/x.pem",
        "https://sns.amazonaws.com/x.pem",
        "https://sqs.us-east-1.amazonaws.com/x.pem",
        "https://x@sns.us-east-1.amazonaws.com/x.pem",
        "https://sns.us-east-1.amazonaws.com\\@evil.test/x.pem",
        "//sns.us-east-1.amazonaws.com/x.pem",
        "",
        None,
    ):
        assert check_url(settings, bad, "SigningCertURL") is not None, bad


async def test_http_refused_without_fetch(sns: FakeSns, pki: Pki, cache: CertificateCache) -> None:
    doc = message(pki, f"http://{sns.host}/cert.pem")
    assert await check(trigger(sns, pki), doc, cache) == "SigningCertURL is not https"
    assert sns.requests == [] and cache.fetches == 0


async def test_certificate_cached(sns: FakeSns, pki: Pki, cache: CertificateCache) -> None:
    spec = trigger(sns, pki)
    first = message(pki, sns.url("/cert.pem"))
    second = message(pki, sns.url("/cert.pem"), version="2", subject=None)
    assert await check(spec, first, cache) is None
    assert await check(spec, second, cache) is None
    assert await check(spec, first, cache) is None
    assert sns.requests == ["/cert.pem"] and cache.fetches == 1 and len(cache) == 1


async def test_concurrent_deliveries_fetch_once(
    sns: FakeSns, pki: Pki, cache: CertificateCache
) -> None:
    spec = trigger(sns, pki)
    body = orjson.dumps(message(pki, sns.url("/cert.pem")))
    reasons = await asyncio.gather(*(prepare(spec, body, cache=cache) for _ in range(8)))
    assert reasons == [None] * 8
    assert sns.requests == ["/cert.pem"] and cache.fetches == 1


async def test_cache_is_bounded(sns: FakeSns, pki: Pki) -> None:
    small = CertificateCache(size=2)
    spec = trigger(sns, pki)
    for n in range(3):
        doc = message(pki, sns.url(f"/cert.pem?n={n}"))
        assert await check(spec, doc, small) is None
    assert len(small) == 2 and small.fetches == 3
    # The first was dropped (least recently used): it is fetched again.
    assert await check(spec, message(pki, sns.url("/cert.pem?n=0")), small) is None
    assert small.fetches == 4


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/expired.pem", "signing certificate is expired or not yet valid"),
        ("/junk.pem", "SigningCertURL does not serve a PEM certificate"),
        ("/missing.pem", "signing certificate fetch answered 404"),
        # A redirect is not followed: its target never passed the host rule.
        ("/moved.pem", "signing certificate fetch answered 302"),
    ],
)
async def test_bad_certificate_answers(
    sns: FakeSns, pki: Pki, cache: CertificateCache, path: str, reason: str
) -> None:
    doc = message(pki, sns.url(path))
    assert await check(trigger(sns, pki), doc, cache) == reason
    assert sns.requests == [path] and len(cache) == 0


async def test_tls_checked_against_the_trusted_cas(
    sns: FakeSns, pki: Pki, cache: CertificateCache
) -> None:
    # The host is allowed but the system CAs do not know the test CA: no certificate.
    spec = parse_verify(
        {"scheme": "sns", "topic_arn": TOPIC, "certificate_hosts": [sns.host]},
        file="f",
        trigger="t",
        env={},
    )
    reason = await check(spec, message(pki, sns.url("/cert.pem")), cache)
    assert reason is not None and reason.startswith("signing certificate fetch failed ("), reason
    assert sns.requests == [] and len(cache) == 0


async def test_certificate_fetched_under_one_ca_is_not_anothers(
    sns: FakeSns, pki: Pki, cache: CertificateCache
) -> None:
    trusted = trigger(sns, pki)
    body = orjson.dumps(message(pki, sns.url("/cert.pem")))
    assert await prepare(trusted, body, cache=cache) is None
    system = parse_verify(
        {"scheme": "sns", "topic_arn": TOPIC, "certificate_hosts": [sns.host]},
        file="f",
        trigger="t",
        env={},
    )
    # Held for the trigger whose ca_file vouched for it, not for the other.
    certificates = await prepare_delivery([trusted, system], body, cache=cache)
    assert verify(trusted, NO_HEADERS, body, time.time(), certificates=certificates) is None
    reason = verify(system, NO_HEADERS, body, time.time(), certificates=certificates)
    assert reason is not None and reason.startswith("signing certificate fetch failed")


def test_verify_never_fetches(pki: Pki) -> None:
    # Without what prepare fetched, verify refuses: it is pure and does no I/O.
    spec = trigger(None, pki)
    body = orjson.dumps(message(pki, "https://sns.us-east-2.amazonaws.com/x.pem"))
    assert verify(spec, NO_HEADERS, body, time.time()) == "signing certificate not fetched"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"Type": "Other"}, "body is not an SNS message (Type)"),
        ({"Type": ["Notification"]}, "body is not an SNS message (Type)"),
        ({"SignatureVersion": {"v": 1}}, "SignatureVersion is not 1 or 2"),
        ({"TopicArn": [TOPIC]}, "TopicArn is not one of this trigger's topic_arn"),
        ({"SignatureVersion": "3"}, "SignatureVersion is not 1 or 2"),
        ({"SignatureVersion": 1}, "SignatureVersion is not 1 or 2"),
        ({"Signature": "***"}, "Signature missing or not base64"),
        ({"Signature": None}, "Signature missing or not base64"),
        ({"Message": None}, "SNS Notification lacks Message"),
        ({"Timestamp": 5}, "SNS Notification lacks Timestamp"),
        ({"SigningCertURL": None}, "SigningCertURL missing or not a string"),
    ],
)
async def test_malformed_messages(
    sns: FakeSns, pki: Pki, cache: CertificateCache, change: dict[str, Any], reason: str
) -> None:
    doc = message(pki, sns.url("/cert.pem"))
    doc = {k: v for k, v in (doc | change).items() if v is not None}
    assert await check(trigger(sns, pki), doc, cache) == reason
    assert sns.requests == []


async def test_not_json(pki: Pki, cache: CertificateCache) -> None:
    spec = trigger(None, pki)
    assert await check(spec, b"not json", cache) == "body is not an SNS message (not JSON)"
    assert await check(spec, b"[1]", cache) == "body is not an SNS message (a JSON object)"


async def test_other_schemes_need_nothing_fetched(cache: CertificateCache) -> None:
    github = parse_verify(
        {"scheme": "github", "secret_env": "S"}, file="f", trigger="t", env={"S": "x"}
    )
    assert await prepare(github, b"{}", cache=cache) is None
    assert await prepare_delivery([github], b"{}", cache=cache) == {}
    assert cache.fetches == 0


# --- The SubscribeURL ---------------------------------------------------------------


async def test_subscribe_url_visited_once(sns: FakeSns, pki: Pki, cache: CertificateCache) -> None:
    spec = trigger(sns, pki)
    confirm = sns.url(f"/confirm?Action=ConfirmSubscription&TopicArn={TOPIC}&Token={TOKEN}")
    doc = message(pki, sns.url("/cert.pem"), kind="SubscriptionConfirmation", subscribe_url=confirm)
    assert await check(spec, doc, cache) is None
    assert await visit_subscribe_url(spec, doc["SubscribeURL"]) is None
    assert sns.requests == ["/cert.pem", confirm.removeprefix(f"https://{sns.host}")]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            f"https://evil.test/?Token={TOKEN}",
            "SubscribeURL host 'evil.test' is not one of certificate_hosts",
        ),
        ("http://{host}/confirm", "SubscribeURL is not https"),
        (None, "SubscribeURL missing or not a string"),
    ],
)
async def test_subscribe_url_rule(sns: FakeSns, pki: Pki, url: str | None, reason: str) -> None:
    given = url.format(host=sns.host) if url else url
    got = await visit_subscribe_url(trigger(sns, pki), given)
    assert got == reason and TOKEN not in got
    assert sns.requests == []


async def test_subscribe_url_failures(sns: FakeSns, pki: Pki) -> None:
    assert await visit_subscribe_url(trigger(sns, pki), sns.url("/nowhere")) == (
        "SubscribeURL answered 404"
    )
    default = trigger(None, pki)
    reason = await visit_subscribe_url(default, sns.url("/confirm"))
    assert reason is not None and "is not an SNS host" in reason
    github = parse_verify(
        {"scheme": "github", "secret_env": "S"}, file="f", trigger="t", env={"S": "x"}
    )
    assert await visit_subscribe_url(github, sns.url("/confirm")) == "not an sns trigger"
    assert sns.requests == ["/nowhere"]


# --- The YAML block -----------------------------------------------------------------


def test_parse_and_describe(pki: Pki) -> None:
    spec = trigger(None, pki)
    assert spec.scheme == "sns" and spec.secrets == () and spec.sns is not None
    assert spec.sns.topic_arns == (TOPIC,) and spec.sns.certificate_hosts == ()
    assert describe(spec) == f"sns {TOPIC}"
    two = trigger(None, pki, topic_arn=[TOPIC, "arn:aws:sns:*:123456789012:*"])
    assert describe(two) == "sns 2 topics"
    assert sign(spec, b"{}", time.time()) == {}  # SNS signs its body: no header to add


@pytest.mark.parametrize(
    ("raw", "field", "fragment"),
    [
        ({}, "verify.topic_arn", "is required"),
        ({"topic_arn": "orders"}, "verify.topic_arn", "is not an SNS topic ARN"),
        ({"topic_arn": []}, "verify.topic_arn", "must be an ARN or a list"),
        ({"topic_arn": [TOPIC, TOPIC]}, "verify.topic_arn", "twice"),
        ({"topic_arn": TOPIC, "secret_env": "S"}, "verify.secret_env", "not a setting"),
        ({"topic_arn": TOPIC, "certificate_hosts": "x y"}, "verify.certificate_hosts", "host"),
        ({"topic_arn": TOPIC, "certificate_hosts": ["h:x"]}, "verify.certificate_hosts", "host"),
        ({"topic_arn": TOPIC, "ca_file": 5}, "verify.ca_file", "PEM CA bundle"),
    ],
)
def test_parse_errors(raw: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_verify({"scheme": "sns", **raw}, file="f", trigger="t", env={"S": "x"})
    assert info.value.field == field
    assert fragment in str(info.value)
