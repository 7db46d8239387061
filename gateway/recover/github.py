"""``realm recover github``: a webhook's recent deliveries as GitHub lists them, and a
redelivery of each one that failed and never reached the gateway.

GitHub's REST API ("Webhook deliveries" of a repository, an organisation or a GitHub
App) lists every delivery attempt, newest first, a page at a time (the ``Link``
header's ``rel="next"`` holds a cursor); a redelivery is an attempt with the same
``guid`` and ``redelivery: true``. GitHub never redelivers a failed delivery by itself.

For each event (guid) with no successful attempt, the newest attempt's request (its
headers and payload) is walked through the path's triggers as a dry run
(gateway/recover/check.py); an event whose claim would start a run is missing and
GitHub is asked to deliver it again (``POST …/deliveries/{id}/attempts``). The
redelivery then arrives as any delivery does, signed, at `realm listen`.

A redelivery takes GitHub a moment, and until it is done the event still looks
missing. So that a run soon after (or two at once) does not ask twice, each
redelivery asked for is held in Redis for ``HOLD_SECONDS`` (``SET NX``, expiring),
and an event whose newest attempt is a redelivery younger than that is left to it:
both are "in flight", looked at again by a later run.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from gateway.ingest.webhooks import RequestHeaders
from gateway.model.errors import StoreUnavailable
from gateway.recover import check
from gateway.recover.http import Api, ApiError, Refused
from gateway.recover.summary import (
    FAILED,
    GITHUB_OUTCOMES,
    IN_FLIGHT,
    OK,
    REDELIVERED,
    Item,
    Summary,
)
from gateway.store.runstore import RunStore

SCHEME = "github"
HEADERS = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28"}
PER_PAGE = 100
# Pages of 100 attempts: GitHub keeps deliveries for a few days, so a list this long
# means a --since far too wide for one run.
MAX_PAGES = 500
# How long a redelivery is left to itself before a run may ask for it again.
HOLD_SECONDS = 600
_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


@dataclass(frozen=True)
class Hook:
    """The webhook whose deliveries are recovered: a repository's, an organisation's or
    the GitHub App's (whose API calls need the app's JWT as the token)."""

    kind: str  # repo | org | app
    owner: str | None = None  # OWNER/REPO, or ORG
    hook_id: int | None = None

    @property
    def base(self) -> str:
        quoted = urllib.parse.quote(self.owner or "", safe="/")
        if self.kind == "repo":
            return f"/repos/{quoted}/hooks/{self.hook_id}"
        if self.kind == "org":
            return f"/orgs/{quoted}/hooks/{self.hook_id}"
        return "/app/hook"

    @property
    def label(self) -> str:
        if self.kind == "repo":
            return f"hook {self.hook_id} of repository {self.owner}"
        if self.kind == "org":
            return f"hook {self.hook_id} of organisation {self.owner}"
        return "the GitHub App's hook"

    @property
    def scope(self) -> str:
        """Names the hook in the Redis key that holds a redelivery."""
        return self.base.strip("/").replace("/", ":")


@dataclass(frozen=True)
class Attempt:
    """One delivery attempt as GitHub lists it."""

    id: int
    guid: str
    at: datetime
    redelivery: bool
    status: str
    status_code: int
    event: str
    action: str | None

    @property
    def ok(self) -> bool:
        return self.status == "OK" or 200 <= self.status_code < 300

    @property
    def when(self) -> str:
        return self.at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _attempt(raw: Any) -> Attempt:
    at = datetime.fromisoformat(str(raw["delivered_at"]).replace("Z", "+00:00"))
    return Attempt(
        id=int(raw["id"]),
        guid=str(raw["guid"]),
        at=at if at.tzinfo else at.replace(tzinfo=UTC),
        redelivery=bool(raw.get("redelivery")),
        status=str(raw.get("status") or ""),
        status_code=int(raw.get("status_code") or 0),
        event=str(raw.get("event") or ""),
        action=None if raw.get("action") is None else str(raw["action"]),
    )


async def list_attempts(api: Api, hook: Hook, since: datetime) -> list[Attempt]:
    """Every attempt delivered at or after ``since``, newest first, page by page."""
    url: str | None = api.url(hook.base + "/deliveries")
    params: dict[str, Any] | None = {"per_page": PER_PAGE}
    found: list[Attempt] = []
    for _ in range(MAX_PAGES):
        if url is None:
            return found
        reply = await api.get(url, params)
        try:
            page = [_attempt(raw) for raw in reply.json()]
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(f"GitHub's list of deliveries is not as documented: {exc!r}") from None
        for attempt in page:
            if attempt.at < since:
                return found
            found.append(attempt)
        url, params = next_page(reply.headers.get("link")), None
        if url is not None and not api.owns(url):
            raise ApiError(f"GitHub's next page is not under {api.base_url}; not followed")
    raise ApiError(
        f"more than {MAX_PAGES * PER_PAGE} deliveries since {since:%Y-%m-%dT%H:%M:%SZ}: "
        "recover a shorter span (--since)"
    )


def next_page(link: str | None) -> str | None:
    """The ``rel="next"`` URL of a ``Link`` header, or None on the last page."""
    if not link:
        return None
    for part in link.split(","):
        found = _NEXT.search(part)
        if found:
            return found.group(1)
    return None


def refused_text(error: Refused, hook: Hook) -> str:
    """What a 401/403/404 means, in the words of the user's inputs."""
    if error.status == 401:
        return f"{error.message}: GITHUB_TOKEN was not accepted (expired, revoked or mistyped" + (
            "; for --app it must be the app's JWT)" if hook.kind == "app" else ")"
        )
    if error.status == 404:
        return (
            f"{error.message}: no {hook.label}, or the token may not see it "
            "(it needs the admin:repo_hook scope or Webhooks read and write; for an "
            "organisation, admin:org_hook)"
        )
    return f"{error.message}: the token may not read or redeliver the deliveries of {hook.label}"


async def recover(
    api: Api,
    store: RunStore,
    hook: Hook,
    route: check.Route,
    since: datetime,
    *,
    dry_run: bool,
    include_delivered: bool = False,
    shown: Callable[[Item], None] = lambda item: None,
) -> Summary:
    """Check every event delivered to ``hook`` since ``since`` and redeliver the missing
    ones (oldest first); ``shown`` is called with each item as it is decided."""
    summary = Summary(GITHUB_OUTCOMES, dry_run, waited=api.waited)
    try:
        attempts = await list_attempts(api, hook, since)
    except Refused as exc:
        summary.error = refused_text(exc, hook)
        return summary
    except ApiError as exc:
        summary.error = exc.message
        return summary
    summary.examined = len(attempts)
    events: dict[str, list[Attempt]] = {}
    for attempt in attempts:  # newest first, so each list's first is the newest
        events.setdefault(attempt.guid, []).append(attempt)
    for tries in reversed(events.values()):
        try:
            item = await _recover_one(api, store, hook, route, tries, dry_run, include_delivered)
        except Refused as exc:  # 401: the token stopped working; every call would fail
            summary.error = refused_text(exc, hook)
            return summary
        summary.items.append(item)
        shown(item)
    return summary


async def _recover_one(
    api: Api,
    store: RunStore,
    hook: Hook,
    route: check.Route,
    tries: list[Attempt],
    dry_run: bool,
    include_delivered: bool,
) -> Item:
    newest = tries[0]

    def item(outcome: str, why: str) -> Item:
        return Item(newest.guid, newest.event, newest.action, newest.when, outcome, why)

    delivered = next((a for a in tries if a.ok), None)
    if delivered is not None and not include_delivered:
        return item(OK, f"attempt {delivered.id} answered {delivered.status_code}")
    age = time.time() - newest.at.timestamp()
    if newest.redelivery and not newest.ok and age < HOLD_SECONDS:
        return item(
            IN_FLIGHT,
            f"a redelivery in the last {HOLD_SECONDS // 60} min has not succeeded yet; "
            "looked at again later",
        )
    held = _held_key(store, hook, newest.guid)
    try:
        if await _exists(store, held):
            return item(IN_FLIGHT, f"redelivery asked for in the last {HOLD_SECONDS // 60} min")
        detail = await api.get(api.url(f"{hook.base}/deliveries/{newest.id}"))
        headers, body = _request_of(detail, newest)
        verdict = await check.look(store, route, headers, body)
    except (ApiError, StoreUnavailable) as exc:
        if isinstance(exc, Refused) and exc.status == 401:
            raise
        return item(FAILED, _failure(exc, hook))
    if verdict.outcome != check.MISSING:
        return item(verdict.outcome, verdict.why)
    why = f"last attempt: {newest.status or newest.status_code}; {verdict.why}"
    if dry_run:
        return item(REDELIVERED, why)
    try:
        if not await _hold(store, held):
            return item(IN_FLIGHT, "another run asked for its redelivery just now")
        try:
            await api.post(api.url(f"{hook.base}/deliveries/{newest.id}/attempts"))
        except ApiError:
            await _release(store, held)  # a later run may ask again
            raise
    except (ApiError, StoreUnavailable) as exc:
        if isinstance(exc, Refused) and exc.status == 401:
            raise
        return item(FAILED, _failure(exc, hook))
    return item(REDELIVERED, why)


def _failure(error: ApiError | StoreUnavailable, hook: Hook) -> str:
    # A 403 on one event is the token's permission (read but not write, say).
    if isinstance(error, Refused) and error.status == 403:
        return refused_text(error, hook)
    return error.message


def _request_of(reply: httpx.Response, attempt: Attempt) -> tuple[RequestHeaders, bytes]:
    """The headers and body of an attempt's request, as the gateway would have had
    them: the payload re-serialised as JSON (GitHub keeps it parsed)."""
    try:
        request = reply.json()["request"]
        raw_headers = request.get("headers") or {}
        payload = request["payload"]
        pairs = [(str(name), str(value)) for name, value in raw_headers.items()]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ApiError(
            f"GitHub's record of delivery {attempt.id} is not as documented: {exc!r}"
        ) from None
    if payload is None:
        raise ApiError(f"GitHub's record of delivery {attempt.id} has no payload")
    names = {name.lower() for name, _ in pairs}
    # What every GitHub delivery carries, and the triggers read: never missing here.
    if "x-github-delivery" not in names:
        pairs.append(("X-GitHub-Delivery", attempt.guid))
    if "x-github-event" not in names and attempt.event:
        pairs.append(("X-GitHub-Event", attempt.event))
    return check.headers_of(pairs), orjson.dumps(payload)


def _held_key(store: RunStore, hook: Hook, guid: str) -> str:
    # A tag of its own, with a ':' no workflow name may hold: it never meets a
    # workflow's keys, and on a cluster it is one slot like any other key.
    return f"{store.prefix}:{{recover:github}}:{hook.scope}:{guid}"


async def _exists(store: RunStore, key: str) -> bool:
    async with store.deadline():
        return bool(await store.call(lambda: store.redis.exists(key)))


async def _hold(store: RunStore, key: str) -> bool:
    """Hold a redelivery for HOLD_SECONDS; False when one is already held."""
    stamp = str(int(time.time()))
    async with store.deadline():
        return bool(await store.call(lambda: store.redis.set(key, stamp, nx=True, ex=HOLD_SECONDS)))


async def _release(store: RunStore, key: str) -> None:
    try:
        async with store.deadline():
            await store.call(lambda: store.redis.delete(key))
    except StoreUnavailable:
        pass  # it expires by itself
