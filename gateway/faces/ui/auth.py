"""Who may use ``/ui``: whoever holds the admin API's token (REALM_API_TOKEN), proved
once on the login form, then by a session cookie.

The cookie is not the token: it is an expiry and an HMAC of it keyed by the token.
A stolen cookie so never gives the token away and stops working at its expiry;
every worker checks it with no shared state; a new token ends every session.
Forms that change something carry a CSRF value, an HMAC of the session, on top of
the cookie's SameSite=Strict.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "realm_ui"
SESSION_SECONDS = 12 * 3600
_SESSION_LABEL = b"realm-ui-session-v1:"
_CSRF_LABEL = b"realm-ui-csrf-v1:"


def _secret_bytes(text: str) -> bytes:
    # surrogateescape: the environment's bytes as they were, even when not UTF-8 (as
    # gateway/faces/api.py compares the bearer token).
    return text.encode("utf-8", "surrogateescape")


class UiAuth:
    def __init__(self, token: str) -> None:
        self._key = _secret_bytes(token)

    def _mac(self, label: bytes, text: str) -> str:
        return hmac.new(self._key, label + text.encode(), hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        """The login form's token is the API's (constant time)."""
        return hmac.compare_digest(_secret_bytes(given), self._key)

    def new_session(self, now: float | None = None) -> str:
        expires = str(int(now if now is not None else time.time()) + SESSION_SECONDS)
        return f"{expires}.{self._mac(_SESSION_LABEL, expires)}"

    def session_of(self, request: Request) -> str | None:
        """The request's session cookie if it is one of ours and has not expired."""
        value = request.cookies.get(COOKIE, "")
        expires, _, mac = value.partition(".")
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 12):
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(_SESSION_LABEL, expires).encode()):
            return None
        return value if int(expires) > time.time() else None

    def csrf(self, session: str) -> str:
        return self._mac(_CSRF_LABEL, session)

    def csrf_matches(self, session: str, given: str) -> bool:
        return hmac.compare_digest(_secret_bytes(given), self.csrf(session).encode())


def set_session(response: Response, request: Request, session: str) -> None:
    response.set_cookie(
        COOKIE,
        session,
        max_age=SESSION_SECONDS,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def end_session(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
