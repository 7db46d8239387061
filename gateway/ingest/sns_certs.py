"""Amazon SNS's signing certificates, fetched and cached for scheme ``sns``, and the
visit of a SubscribeURL that confirms a subscription.

The verification itself is pure (gateway/signatures/sns.py): before it, the request
path awaits ``prepare_delivery`` (or ``prepare`` per spec), which fetches the
certificate a message names, only over https and only from a host the trigger trusts
(AWS's ``sns.<region>.amazonaws.com``, or its ``certificate_hosts`` in tests and
private clouds), after every check that needs no certificate has passed, so junk
and other topics' messages cost no request. Certificates are cached per worker, by
URL and CA bundle, a bounded number, each until it expires (or a day); one fetch per
URL is in flight at a time, however many deliveries wait for it.

Reasons name the field, the host and the rule, never a URL's query (a SubscribeURL
carries the subscription's token) nor a signature.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
import orjson
from cryptography import x509

from gateway.signatures.sns import (
    CertificateKey,
    SnsSettings,
    certificate_key,
    certificate_problem,
    check_url,
    signing_certificate_url,
)
from gateway.signatures.spec import VerifySpec

__all__ = [
    "CERTIFICATES",
    "FETCH_TIMEOUT",
    "CertificateCache",
    "prepare",
    "prepare_delivery",
    "visit_subscribe_url",
]

# Seconds for one fetch (connect, TLS, answer): SNS's hosts answer in well under one,
# and a delivery waits for it the first time a certificate is seen.
FETCH_TIMEOUT = 3.0
# A certificate file is about 2 KB; anything much larger is not one.
MAX_CERTIFICATE_BYTES = 64 * 1024
# Kept at most this long even when valid for longer: AWS rotates under a new URL, and
# a day bounds how long a certificate no longer served stays trusted.
MAX_AGE = 24 * 3600.0


@dataclass
class _Entry:
    certificate: x509.Certificate
    until: float  # when it is fetched again (its expiry or MAX_AGE, whichever first)


class CertificateCache:
    """Per worker: certificates by (CA bundle, URL), the least recently used dropped
    past ``size``. Only ``prepare`` adds to it; verification reads a snapshot."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._entries: OrderedDict[CertificateKey, _Entry] = OrderedDict()
        self._fetching: dict[CertificateKey, asyncio.Future[str | None]] = {}
        self.fetches = 0  # requests made (tests and metrics)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CertificateKey, now: float) -> x509.Certificate | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now >= entry.until:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry.certificate

    def put(self, key: CertificateKey, certificate: x509.Certificate, now: float) -> None:
        until = min(certificate.not_valid_after_utc.timestamp(), now + MAX_AGE)
        self._entries[key] = _Entry(certificate, until)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    async def fetch(self, settings: SnsSettings, url: str) -> str | None:
        """The certificate at ``url`` in the cache (None), or why not. The URL's rule is
        checked again here: nothing else may ever be fetched."""
        problem = check_url(settings, url, "SigningCertURL")
        if problem:
            return problem
        key = certificate_key(settings, url)
        if self.get(key, time.time()) is not None:
            return None
        pending = self._fetching.get(key)
        if pending is not None:
            # Another delivery is fetching it: wait for that one. shield: one waiter's
            # cancel (its deadline) must not cancel the fetch the others wait for.
            return await asyncio.shield(pending)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._fetching[key] = future
        try:
            why = await self._fetch(settings, key, url)
            future.set_result(why)
            return why
        except BaseException:
            future.set_result("signing certificate fetch was interrupted")
            raise
        finally:
            del self._fetching[key]

    async def _fetch(self, settings: SnsSettings, key: CertificateKey, url: str) -> str | None:
        self.fetches += 1
        response = await _get(settings, url, "signing certificate fetch")
        if isinstance(response, str):
            return response
        if response.status_code != 200:
            return f"signing certificate fetch answered {response.status_code}"
        if len(response.content) > MAX_CERTIFICATE_BYTES:
            return "signing certificate fetch answered more than a certificate"
        try:
            certificate = x509.load_pem_x509_certificate(response.content)
        except ValueError:
            return "SigningCertURL does not serve a PEM certificate"
        now = time.time()
        problem = certificate_problem(certificate, now)
        if problem:
            return problem
        self.put(key, certificate, now)
        return None


# This worker's certificates: what the request path uses.
CERTIFICATES = CertificateCache()


@functools.lru_cache(maxsize=16)
def _tls(ca_file: str | None) -> ssl.SSLContext:
    # The system's CAs, or the trigger's bundle (tests, private clouds); built once each.
    return ssl.create_default_context(cafile=ca_file)


def _client(settings: SnsSettings) -> httpx.AsyncClient:
    # No redirects: a 3xx would lead to a URL the host rule never saw. HTTPS_PROXY and
    # NO_PROXY are honoured (egress often goes through a proxy); TLS is still checked
    # end to end against the trusted CAs.
    return httpx.AsyncClient(
        verify=_tls(settings.ca_file), timeout=FETCH_TIMEOUT, follow_redirects=False
    )


async def _get(settings: SnsSettings, url: str, what: str) -> httpx.Response | str:
    """GET ``url`` (its host already checked), or why it could not be had (``what``
    names the request in the reason)."""
    try:
        async with _client(settings) as client:
            return await client.get(url)
    except httpx.TimeoutException:
        return f"{what} timed out ({FETCH_TIMEOUT:g} s)"
    except (httpx.HTTPError, ssl.SSLError, OSError) as exc:
        return f"{what} failed ({type(exc).__name__})"


def _settings(spec: VerifySpec) -> SnsSettings | None:
    return spec.sns if spec.scheme == "sns" else None


async def prepare(
    spec: VerifySpec, body: bytes, *, cache: CertificateCache | None = None
) -> str | None:
    """Fetch into the cache the certificate the SNS message ``body`` names, unless it is
    there: None when it is (or ``spec`` is not ``sns``), else why it is not: a check
    that needs no certificate failed (the type, the topic, not https, a host that is
    not trusted: then nothing was requested), or the fetch failed, timed out, or
    answered no valid certificate. verify() gives the same reason."""
    settings = _settings(spec)
    if settings is None:
        return None
    url, why = signing_certificate_url(settings, _parse(body))
    if url is None:
        return why
    return await (CERTIFICATES if cache is None else cache).fetch(settings, url)


async def prepare_delivery(
    specs: Iterable[VerifySpec], body: bytes, *, cache: CertificateCache | None = None
) -> dict[CertificateKey, x509.Certificate | str]:
    """What ``verify(..., certificates=...)`` needs for one delivery: per (CA bundle,
    URL) its ``sns`` specs name, the certificate or why it could not be had. Empty (and
    nothing awaited) when no spec is ``sns``, the usual case."""
    cache = CERTIFICATES if cache is None else cache  # (an empty cache is falsy)
    out: dict[CertificateKey, x509.Certificate | str] = {}
    doc: object = _UNPARSED
    for spec in specs:
        settings = _settings(spec)
        if settings is None:
            continue
        if doc is _UNPARSED:
            doc = _parse(body)
        url, _ = signing_certificate_url(settings, doc)
        if url is None:
            continue
        key = certificate_key(settings, url)
        if key in out:
            continue
        why = await cache.fetch(settings, url)
        # A snapshot: a certificate evicted by another delivery meanwhile still counts.
        held = cache.get(key, time.time()) if why is None else None
        out[key] = held if held is not None else (why or "signing certificate not fetched")
    return out


_UNPARSED = object()


def _parse(body: bytes) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


async def visit_subscribe_url(spec: VerifySpec, url: object) -> str | None:
    """Confirm an SNS subscription: GET ``url`` (a verified SubscriptionConfirmation's
    ``SubscribeURL``) under the same rule as certificates (https, an SNS host or one of
    ``certificate_hosts``, no redirect). None when SNS answered 2xx, else why not."""
    settings = _settings(spec)
    if settings is None:
        return "not an sns trigger"
    problem = check_url(settings, url, "SubscribeURL")
    if problem:
        return problem
    assert isinstance(url, str)
    response = await _get(settings, url, "SubscribeURL visit")
    if isinstance(response, str):
        return response
    if not 200 <= response.status_code < 300:
        return f"SubscribeURL answered {response.status_code}"
    return None
