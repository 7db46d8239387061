"""Who may use ``/ui``: whoever holds the admin API's token (REALM_API_TOKEN), proved
once on the login form, then by a session cookie.

The cookie is not the token: ``<expiry>.<session id>.<HMAC of both, keyed by the
token>``. A forged or expired cookie is refused without asking Redis, and a new token
ends every session. A session lives in Redis too (a key that expires with it), so
logging out ends it at once in every worker: the same cookie, and the CSRF value
derived from it, stop working. Forms that change something carry that CSRF value
on top of the cookie's SameSite=Strict.

Login attempts are counted per client in Redis, in a fixed window shared by every
worker: past ``LOGIN_ATTEMPTS`` the form answers 429 with Retry-After. The client, and
whether it came over HTTPS (the cookie's ``Secure``), are read from
``X-Forwarded-For`` and ``X-Forwarded-Proto`` only when the request comes from an
address of ``settings.trusted_proxies``: anyone else could claim anything in them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import Response

from gateway.model.config import Network
from gateway.store.runstore import RunStore

COOKIE = "realm_ui"
SESSION_SECONDS = 12 * 3600
# Login attempts one client may make per window (a right token counts too: past the
# limit the form is not even checked, so guessing gains nothing from it).
LOGIN_ATTEMPTS = 10
LOGIN_WINDOW_SECONDS = 60
_SESSION_LABEL = b"realm-ui-session-v2:"
_CSRF_LABEL = b"realm-ui-csrf-v1:"


def _secret_bytes(text: str) -> bytes:
    # surrogateescape: the environment's bytes as they were, even when not UTF-8 (as
    # gateway/faces/api.py compares the bearer token).
    return text.encode("utf-8", "surrogateescape")


class UiAuth:
    """The cookie's and the CSRF value's HMACs, and the sessions and login attempts
    kept in Redis (under the store's key prefix)."""

    def __init__(self, token: str) -> None:
        self._key = _secret_bytes(token)

    def _mac(self, label: bytes, text: str) -> str:
        return hmac.new(self._key, label + text.encode(), hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        """The login form's token is the API's (constant time)."""
        return hmac.compare_digest(_secret_bytes(given), self._key)

    def new_session(self, now: float | None = None) -> str:
        """A cookie value for a new session (not yet live: see ``start_session``)."""
        expires = str(int(now if now is not None else time.time()) + SESSION_SECONDS)
        signed = f"{expires}.{secrets.token_hex(16)}"
        return f"{signed}.{self._mac(_SESSION_LABEL, signed)}"

    def signed_session(self, request: Request) -> str | None:
        """The request's session cookie if we signed it and it has not expired (Redis
        not asked: whether it is still live is ``session_of``'s question)."""
        value = request.cookies.get(COOKIE, "")
        signed, _, mac = value.rpartition(".")
        expires, _, session_id = signed.partition(".")
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 12):
            return None
        if not (len(session_id) == 32 and session_id.isascii() and session_id.isalnum()):
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(_SESSION_LABEL, signed).encode()):
            return None
        return value if int(expires) > time.time() else None

    async def session_of(self, request: Request, store: RunStore) -> str | None:
        """The request's session if it is ours, not expired and not logged out."""
        session = self.signed_session(request)
        if session is None:
            return None
        async with store.deadline():
            live = await store.call(lambda: store.redis.exists(_session_key(store, session)))
        return session if live else None

    async def start_session(self, store: RunStore) -> str:
        """A new session, live in Redis until it expires or is logged out."""
        session = self.new_session()
        seconds = int(session.partition(".")[0]) - int(time.time())
        async with store.deadline():
            await store.call(lambda: store.redis.set(_session_key(store, session), 1, ex=seconds))
        return session

    async def end_session(self, store: RunStore, session: str) -> None:
        """Log out: the session stops working in every worker."""
        async with store.deadline():
            await store.call(lambda: store.redis.delete(_session_key(store, session)))

    def csrf(self, session: str) -> str:
        return self._mac(_CSRF_LABEL, session)

    def csrf_matches(self, session: str, given: str) -> bool:
        return hmac.compare_digest(_secret_bytes(given), self.csrf(session).encode())


def _session_key(store: RunStore, session: str) -> str:
    # A digest: what Redis holds is not a cookie anyone could send.
    digest = hashlib.sha256(session.encode()).hexdigest()
    return f"{store.prefix}:{{ui:sessions}}:{digest}"


async def login_attempt(store: RunStore, client: str) -> int:
    """Count one login attempt of ``client``: 0 if it is within the limit, else the
    seconds until its window ends (for Retry-After)."""
    name = f"{store.prefix}:{{ui:logins}}:{client}"

    async def count() -> list[int]:
        # The window starts with its first attempt: EXPIRE NX sets the expiry of a count
        # that has none (a new one, or one whose expiry a crash left unset), never moves it.
        async with store.redis.pipeline(transaction=False) as pipe:
            pipe.incr(name)
            pipe.expire(name, LOGIN_WINDOW_SECONDS, nx=True)
            pipe.ttl(name)
            attempts, _, ttl = await pipe.execute()
            return [int(attempts), int(ttl)]

    async with store.deadline():
        attempts, ttl = await store.call(count)
    if attempts <= LOGIN_ATTEMPTS:
        return 0
    return max(1, min(ttl, LOGIN_WINDOW_SECONDS))


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        return None


def _trusted(address: str | None, proxies: Sequence[Network]) -> bool:
    ip = _address(address) if address else None
    return ip is not None and any(ip in network for network in proxies)


def client_of(request: Request, proxies: Sequence[Network]) -> str:
    """Who sent the request: its peer's address, or behind trusted proxies the last
    address of ``X-Forwarded-For`` that is not one of them."""
    peer = request.client.host if request.client else "unknown"
    if not _trusted(peer, proxies):
        return peer
    hops = [hop.strip() for hop in request.headers.get("x-forwarded-for", "").split(",")]
    for hop in reversed([hop for hop in hops if hop]):
        if not _trusted(hop, proxies):
            ip = _address(hop)
            return str(ip) if ip is not None else peer
    return peer


def is_https(request: Request, proxies: Sequence[Network]) -> bool:
    """Whether the browser reached us over HTTPS: the connection's scheme, or the
    ``X-Forwarded-Proto`` a trusted proxy set (its last value: the nearest proxy's)."""
    if request.url.scheme == "https":
        return True
    peer = request.client.host if request.client else None
    if not _trusted(peer, proxies):
        return False
    proto = request.headers.get("x-forwarded-proto", "").split(",")[-1]
    return proto.strip().lower() == "https"


def set_session(response: Response, session: str, *, secure: bool) -> None:
    response.set_cookie(
        COOKIE,
        session,
        max_age=SESSION_SECONDS,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=secure,
    )


def clear_session(response: Response, *, secure: bool) -> None:
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict", secure=secure)
