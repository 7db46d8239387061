"""GitHub's and Stripe's APIs as `realm recover` calls them, served on loopback for its
tests (tests/test_recover_github.py, tests/test_recover_stripe.py).

Each stand-in implements the documented endpoints and their paging with the documented
shapes, keeps every call it was made, and can answer the next calls with rate-limit
replies:

- GitHub ("REST API endpoints for repository webhooks", "… organization webhooks",
  "… GitHub App webhooks"): ``GET <hook>/deliveries`` (``per_page``, a ``cursor`` in the
  ``Link`` header's ``rel="next"`` URL, newest first), ``GET <hook>/deliveries/{id}``
  (``request.headers`` and ``request.payload``), ``POST <hook>/deliveries/{id}/attempts``
  (202). A redelivery is recorded; given a gateway URL and the hook's secret, it is
  also sent there, signed as GitHub signs, and listed as a new attempt with the
  gateway's answer. Without one it is not listed: GitHub has not got to it yet.
- Stripe ("List all events"): ``GET /v1/events`` with ``delivery_success``,
  ``created[gte]``, ``limit`` and ``starting_after``, newest first, ``has_more``.

Both refuse a wrong token (401), as their senders do; Stripe's message quotes the key,
so a test can check that the command never shows it.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from tests.servers import free_port
from tests.signing import github_headers

Reply = tuple[int, dict[str, str], Any]  # status, headers, JSON body


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    at: float  # time.monotonic()
    status: int = 0


# --------------------------------------------------------------------------- rate limits


def github_primary_limit(seconds: float = 1) -> Callable[[], Reply]:
    """GitHub's primary limit: 403, ``x-ratelimit-remaining: 0``, the reset ``seconds``
    from the moment it is answered (epoch seconds, rounded up)."""

    def reply() -> Reply:
        reset = str(int(time.time() + seconds + 0.999))
        headers = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": reset}
        return 403, headers, {"message": "API rate limit exceeded for user ID 1."}

    return reply


def retry_after(seconds: int | None = 1, status: int = 429, **headers: str) -> Callable[[], Reply]:
    """A secondary limit (GitHub: 403 or 429) or Stripe's 429, with ``Retry-After``
    (None: without), and ``headers`` (``**{"Stripe-Should-Retry": "false"}``)."""
    said = "You have exceeded a secondary rate limit."
    # GitHub's shape and Stripe's, in one body.
    message = {"message": said, "error": {"message": said, "type": "rate_limit_error"}}
    if seconds is not None:
        headers = {"Retry-After": str(seconds), **headers}
    return lambda: (status, headers, message)


def server_error(status: int = 502) -> Callable[[], Reply]:
    return lambda: (status, {}, {"message": "Server Error"})


# --------------------------------------------------------------------------- the servers


class FakeApi:
    """What both stand-ins share: the token check, the calls kept, canned replies."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.url = ""  # set by serve()
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        # The next calls (of a method, or any) answered with these instead.
        self._canned: list[tuple[str | None, Callable[[], Reply]]] = []
        # Called with each call before it is answered (a test's fault at that moment).
        self.on_call: Callable[[Call], None] = lambda call: None

    def answer_next(self, reply: Callable[[], Reply], times: int = 1, method: str | None = None):
        """Answer the next ``times`` calls (of ``method``, or any) with ``reply()``."""
        with self.lock:
            self._canned += [(method, reply)] * times

    def calls_to(self, method: str, suffix: str = "") -> list[Call]:
        return [c for c in self.calls if c.method == method and c.path.endswith(suffix)]

    def handle(self, method: str, target: str, headers: Any) -> tuple[int, dict[str, str], bytes]:
        split = urllib.parse.urlsplit(target)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(split.query).items()}
        call = Call(method, split.path, query, time.monotonic())
        self.on_call(call)
        with self.lock:
            self.calls.append(call)
            canned = next((c for c in self._canned if c[0] in (None, method)), None)
            if canned is not None:
                self._canned.remove(canned)
        if headers.get("Authorization") != f"Bearer {self.token}":
            status, extra, body = self.unauthorised(headers.get("Authorization") or "")
        elif canned is not None:
            status, extra, body = canned[1]()
        else:
            status, extra, body = self.route(method, split.path, query)
        call.status = status
        return status, {"Content-Type": "application/json", **extra}, json.dumps(body).encode()

    def unauthorised(self, given: str) -> Reply:
        raise NotImplementedError

    def route(self, method: str, path: str, query: dict[str, str]) -> Reply:
        raise NotImplementedError


@contextmanager
def serve(api: FakeApi) -> Iterator[str]:
    """Serve ``api`` on a free loopback port; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            status, headers, body = api.handle(self.command, self.path, self.headers)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield api.url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# --------------------------------------------------------------------------- GitHub

_ids = itertools.count(90001)


@dataclass
class Attempt:
    id: int
    guid: str
    event: str
    action: str | None
    body: bytes
    delivered_at: float  # epoch seconds
    status: str
    status_code: int
    redelivery: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def listed(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "guid": self.guid,
            "delivered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.delivered_at)),
            "redelivery": self.redelivery,
            "duration": 0.27,
            "status": self.status,
            "status_code": self.status_code,
            "event": self.event,
            "action": self.action,
            "installation_id": None,
            "repository_id": 1296269,
            "throttled_at": None,
        }


def failure(code: int) -> tuple[str, int]:
    """GitHub's status text and code for a delivery the gateway answered ``code`` (0:
    no answer in time)."""
    return ("timed out", 0) if code == 0 else (f"Invalid HTTP Response: {code}", code)


class GitHubApi(FakeApi):
    """One hook's deliveries (``hook``: ``/repos/O/R/hooks/ID``, ``/orgs/O/hooks/ID`` or
    ``/app/hook``). ``deliver_to``: the gateway URL a redelivery is sent to, signed with
    ``secret``. ``max_page``: the most attempts a page holds (GitHub: 100)."""

    def __init__(
        self,
        token: str,
        hook: str = "/repos/octo-org/shop-api/hooks/7",
        *,
        deliver_to: str | None = None,
        secret: str | None = None,
        max_page: int = 100,
    ) -> None:
        super().__init__(token)
        self.hook = hook
        self.deliver_to = deliver_to
        self.secret = secret
        self.max_page = max_page
        self.attempts: list[Attempt] = []
        self.redelivered: list[int] = []  # the delivery ids whose attempts were POSTed
        self.answers: list[httpx.Response] = []  # the gateway's, to the redeliveries sent

    def add(
        self,
        guid: str,
        body: bytes,
        *,
        event: str = "push",
        action: str | None = None,
        code: int = 503,
        ago: float = 60,
        redelivery: bool = False,
    ) -> Attempt:
        """An attempt ``ago`` seconds ago that the gateway answered ``code`` (2xx: OK)."""
        status, status_code = ("OK", code) if 200 <= code < 300 else failure(code)
        headers = {
            "Accept": "*/*",
            "User-Agent": "GitHub-Hookshot/044aadd",
            "X-GitHub-Delivery": guid,
            "X-GitHub-Event": event,
            "X-GitHub-Hook-ID": "7",
            "Content-Type": "application/json",
        }
        attempt = Attempt(
            next(_ids), guid, event, action, body, time.time() - ago, status, status_code,
            redelivery, headers,
        )  # fmt: skip
        with self.lock:
            self.attempts.append(attempt)
        return attempt

    def unauthorised(self, given: str) -> Reply:
        docs = "https://docs.github.com/rest"
        return 401, {}, {"message": "Bad credentials", "documentation_url": docs}

    def route(self, method: str, path: str, query: dict[str, str]) -> Reply:
        base = self.hook + "/deliveries"
        if method == "GET" and path == base:
            return self._list(query)
        rest = path.removeprefix(base + "/").split("/")
        if path.startswith(base + "/") and rest[0].isdigit():
            attempt = next((a for a in self.attempts if a.id == int(rest[0])), None)
            if attempt is not None and method == "GET" and len(rest) == 1:
                return 200, {}, self._detail(attempt)
            if attempt is not None and method == "POST" and rest[1:] == ["attempts"]:
                self._redeliver(attempt)
                return 202, {}, {}
        return 404, {}, {"message": "Not Found", "documentation_url": "https://docs.github.com"}

    def _list(self, query: dict[str, str]) -> Reply:
        per_page = min(int(query.get("per_page", 30)), 100, self.max_page)
        with self.lock:
            ordered = sorted(self.attempts, key=lambda a: (a.delivered_at, a.id), reverse=True)
        start = 0
        if "cursor" in query:
            after = int(query["cursor"].removeprefix("v1_"))
            start = next(i for i, a in enumerate(ordered) if a.id == after) + 1
        page = ordered[start : start + per_page]
        headers = {}
        if start + per_page < len(ordered):
            link = f"{self.url}{self.hook}/deliveries?per_page={per_page}"
            headers["Link"] = f'<{link}&cursor=v1_{page[-1].id}>; rel="next", <{link}>; rel="first"'
        return 200, headers, [a.listed() for a in page]

    def _detail(self, attempt: Attempt) -> dict[str, Any]:
        return {
            **attempt.listed(),
            "url": f"https://api.github.com{self.hook}",
            "request": {"headers": attempt.headers, "payload": json.loads(attempt.body)},
            "response": {"headers": {}, "payload": None},
        }

    def _redeliver(self, attempt: Attempt) -> None:
        with self.lock:
            self.redelivered.append(attempt.id)
        if self.deliver_to is None:
            return
        assert self.secret is not None
        headers = github_headers(
            attempt.body, self.secret, event=attempt.event, delivery=attempt.guid
        )
        try:
            answer = httpx.post(self.deliver_to, content=attempt.body, headers=headers)
        except httpx.HTTPError:
            code = 0
        else:
            code = answer.status_code
            with self.lock:
                self.answers.append(answer)
        self.add(attempt.guid, attempt.body, event=attempt.event, action=attempt.action,
                 code=code, ago=0, redelivery=True)  # fmt: skip


# --------------------------------------------------------------------------- Stripe


class StripeApi(FakeApi):
    """An account's events; ``max_page``: the most a page holds (Stripe: 100)."""

    def __init__(self, key: str, *, max_page: int = 100) -> None:
        super().__init__(key)
        self.max_page = max_page
        self.events: list[tuple[dict[str, Any], bool]] = []  # (event, delivered)

    def add(self, event: dict[str, Any], *, delivered: bool = False) -> dict[str, Any]:
        with self.lock:
            self.events.append((event, delivered))
        return event

    def unauthorised(self, given: str) -> Reply:
        key = given.removeprefix("Bearer ")
        message = f"Invalid API Key provided: {key}"
        return 401, {}, {"error": {"message": message, "type": "invalid_request_error"}}

    def route(self, method: str, path: str, query: dict[str, str]) -> Reply:
        if (method, path) != ("GET", "/v1/events"):
            return 404, {}, {"error": {"message": f"Unrecognized request URL ({method}: {path})"}}
        limit = min(int(query.get("limit", 10)), 100, self.max_page)
        since = int(query.get("created[gte]", 0))
        success = query.get("delivery_success")
        with self.lock:
            chosen = [
                event
                for event, delivered in self.events
                if event["created"] >= since
                and (success is None or delivered == (success == "true"))
            ]
        chosen.sort(key=lambda e: e["created"], reverse=True)
        start = 0
        if "starting_after" in query:
            start = next(i for i, e in enumerate(chosen) if e["id"] == query["starting_after"]) + 1
        page = chosen[start : start + limit]
        more = start + limit < len(chosen)
        return 200, {}, {"object": "list", "url": "/v1/events", "has_more": more, "data": page}
