"""The client of a sender's API for ``realm recover``: one ``httpx.AsyncClient`` with
the token as a bearer, writes paced to a rate, rate-limit replies waited out (within a
bound), server errors retried a few times, and every message free of the token.

What counts as a rate-limit reply follows the senders' documentation: GitHub answers
403 or 429 with ``Retry-After`` (a secondary limit) or with ``x-ratelimit-remaining: 0``
and ``x-ratelimit-reset`` (epoch seconds, the primary limit); Stripe answers 429,
sometimes with ``Retry-After``, and says with ``Stripe-Should-Retry`` whether a retry
can succeed.
"""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import httpx

# Per request: the seconds of rate-limit and retry waits after which it is given up
# (the item it was for counts as failed). A scheduled run must end; the next one
# picks up what this one could not do.
MAX_WAIT = 60.0
# Tries of a request answered 5xx or not answered at all, with these pauses between.
TRIES = 3
BACKOFF = (0.5, 1.0)
TIMEOUT = 30.0
# A 403/429 that says "rate limit" but not how long: GitHub asks for at least a minute.
UNSAID_WAIT = 60.0
_MAX_SHOWN = 200


class ApiError(Exception):
    """A request that failed for good; the message says which and why, and is safe to
    print (no token)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Refused(ApiError):
    """401, 403 (not a rate limit) or 404: the token, or what it names, is wrong. The
    caller says which of its inputs that means."""


@dataclass
class Waited:
    """Rate-limit replies waited out during a run, and the seconds spent waiting."""

    replies: int = 0
    seconds: float = 0.0


class Pacer:
    """At most ``rate`` calls per second: each waits until ``1/rate`` after the last."""

    def __init__(self, rate: float) -> None:
        self.gap = 1.0 / rate
        self.next = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        if now < self.next:
            await asyncio.sleep(self.next - now)
        self.next = max(now, self.next) + self.gap


def check_api_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError saying why it cannot be used. A
    token goes with every request, so only https, or http to this machine (tests,
    a local proxy)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"must be an https:// URL such as https://api.github.com (got {url!r})")
    if parts.query or parts.fragment:
        raise ValueError(f"must not have a query or fragment (got {url!r})")
    if parts.scheme == "http" and not _loopback(parts.hostname):
        raise ValueError(
            f"must be https:// (the token goes with every request); http:// only to this "
            f"machine (got {url!r})"
        )
    return url.rstrip("/")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Api:
    """One sender's API at ``base_url``, authenticated with ``token``. Use as ``async
    with``. ``name`` ("GitHub", "Stripe") starts every message."""

    def __init__(
        self,
        name: str,
        base_url: str,
        token: str,
        *,
        headers: Mapping[str, str] | None = None,
        rate: float = 2.0,
        max_wait: float = MAX_WAIT,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._headers = {
            "Authorization": f"Bearer {token}",
            "User-Agent": "realm-gateway-recover",
            **(headers or {}),
        }
        self.max_wait = max_wait
        self.pacer = Pacer(rate)
        self.waited = Waited()
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Self:
        # No redirects: a redirect could carry the token to another host.
        self._client = httpx.AsyncClient(
            headers=self._headers, timeout=TIMEOUT, follow_redirects=False
        )
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def owns(self, url: str) -> bool:
        """Whether ``url`` (a next page's link) is under this API's base URL: the token
        goes only there."""
        base, other = urllib.parse.urlsplit(self.base_url), urllib.parse.urlsplit(url)
        return (other.scheme, other.netloc) == (base.scheme, base.netloc) and (
            other.path + "/"
        ).startswith(base.path + "/")

    def scrub(self, text: str) -> str:
        """``text`` (a sender's message) without the token, one line, clipped."""
        text = " ".join(text.replace(self._token, "***").split())
        return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "…"

    async def get(self, url: str, params: Mapping[str, Any] | None = None) -> httpx.Response:
        return await self._request("GET", url, params)

    async def post(self, url: str) -> httpx.Response:
        """A write, paced to the rate."""
        await self.pacer.wait()
        return await self._request("POST", url, None)

    async def _request(
        self, method: str, url: str, params: Mapping[str, Any] | None
    ) -> httpx.Response:
        """The 2xx reply to one request, after the waits and retries the sender asks
        for; ApiError (Refused for 401/403/404) once it cannot be had."""
        assert self._client is not None, "use Api as `async with`"
        give_up = time.monotonic() + self.max_wait
        what = f"{method} {urllib.parse.urlsplit(url).path}"
        failures = limited = 0
        while True:
            try:
                reply = await self._client.request(method, url, params=params)
            except httpx.HTTPError as exc:
                failures += 1
                problem = f"{self.name} did not answer {what}: {type(exc).__name__}"
                await self._pause_or_fail(failures, give_up, problem)
                continue
            if reply.is_success:
                return reply
            status = reply.status_code
            said = self.message(reply)
            wait = rate_limit_wait(reply, said, limited)
            if wait is not None:
                limited += 1
                if time.monotonic() + wait > give_up:
                    raise ApiError(
                        f"{self.name}'s rate limit on {what} did not lift within "
                        f"{self.max_wait:.0f} s (it asked to wait {wait:.0f} s more)",
                        status,
                    )
                self.waited.replies += 1
                self.waited.seconds += wait
                await asyncio.sleep(wait)
                continue
            retry = reply.headers.get("stripe-should-retry")
            if (status >= 500 and retry != "false") or retry == "true":
                failures += 1
                await self._pause_or_fail(
                    failures, give_up, f"{self.name} answered {status} to {what}: {said}"
                )
                continue
            kind = Refused if status in (401, 403, 404) else ApiError
            raise kind(f"{self.name} answered {status} to {what}: {said}", status)

    async def _pause_or_fail(self, failures: int, give_up: float, problem: str) -> None:
        if failures >= TRIES:
            raise ApiError(f"{problem} ({failures} tries)")
        pause = BACKOFF[min(failures, len(BACKOFF)) - 1]
        if time.monotonic() + pause > give_up:
            raise ApiError(problem)
        await asyncio.sleep(pause)

    def message(self, reply: httpx.Response) -> str:
        """What the sender said of an error: GitHub's ``message``, Stripe's
        ``error.message``, or the reply's start; scrubbed."""
        try:
            data = reply.json()
        except ValueError:
            data = None
        said = None
        if isinstance(data, dict):
            said = data.get("message")
            error = data.get("error")
            if said is None and isinstance(error, dict):
                said = error.get("message")
        if not isinstance(said, str) or not said:
            said = reply.text or reply.reason_phrase or "no message"
        return self.scrub(said)


def rate_limit_wait(reply: httpx.Response, said: str, before: int = 0) -> float | None:
    """Seconds to wait before trying ``reply``'s request again, when it is a rate-limit
    reply; None when it is not one (or the sender says a retry cannot succeed).
    ``before``: the rate-limit replies this request had already; a 429 that does not
    say how long is backed off from exponentially."""
    status = reply.status_code
    if status not in (403, 429) or reply.headers.get("stripe-should-retry") == "false":
        return None
    after = retry_after(reply.headers.get("retry-after"))
    if after is not None:
        return after
    if reply.headers.get("x-ratelimit-remaining") == "0":
        try:
            reset = float(reply.headers.get("x-ratelimit-reset", ""))
        except ValueError:
            return UNSAID_WAIT
        # One second more: the reset is in whole seconds, and the clocks differ a little.
        return max(reset - time.time(), 0.0) + 1.0
    if status == 429 or "rate limit" in said.lower():
        return UNSAID_WAIT if status == 403 else min(2.0**before, 16.0)
    return None  # a 403 that is not a rate limit: a permission


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: a number of seconds or an HTTP date; None if absent
    or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)
