"""``realm recover stripe``: the events Stripe could not deliver, claimed here.

Stripe retries a failed delivery for days, then gives up; its API lists the events
whose delivery has not succeeded (``GET /v1/events?delivery_success=false``, newest
first, ``starting_after`` the last id while ``has_more``). Each one is walked through
the path's triggers (gateway/recover/check.py) as the delivery it would have been: the
event object as the JSON body. It comes from Stripe's API under our secret key, so it
is trusted as a verified delivery is. A dry run first; an event whose claim would
start a run is then claimed for real, here, as `realm listen` would have claimed it.

The body is our serialisation of the event, not the bytes Stripe signed: an event
that did arrive meets its own key with another body digest, which the claim reports as
a params mismatch (or refuses with STATE_IDEMPOTENCY_KEY_CONFLICT). Either way no run
starts, and the event counts as already here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.model.errors import StoreUnavailable
from gateway.recover import check
from gateway.recover.http import Api, ApiError, Refused
from gateway.recover.summary import FAILED, STARTED, STRIPE_OUTCOMES, Item, Summary
from gateway.store.runstore import RunStore

SCHEME = "stripe"
LIMIT = 100
# Pages of 100 events: more than this in one span is a --since far too wide.
MAX_PAGES = 500


async def list_events(
    api: Api, since: int, *, include_delivered: bool = False
) -> list[dict[str, Any]]:
    """The events created at or after ``since`` (epoch seconds) whose delivery has not
    succeeded (every event, ``include_delivered``), newest first."""
    params: dict[str, Any] = {"limit": LIMIT, "created[gte]": since}
    if not include_delivered:
        params["delivery_success"] = "false"
    found: list[dict[str, Any]] = []
    for _ in range(MAX_PAGES):
        reply = await api.get(api.url("/v1/events"), params)
        try:
            page = reply.json()
            events = [_checked(event) for event in page["data"]]
            more = bool(page.get("has_more"))
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(f"Stripe's list of events is not as documented: {exc!r}") from None
        found += events
        if not more or not events:
            return found
        params["starting_after"] = events[-1]["id"]
    raise ApiError(
        f"more than {MAX_PAGES * LIMIT} events since {_iso(since)}: recover a shorter "
        "span (--since)"
    )


def _checked(event: Any) -> dict[str, Any]:
    if not isinstance(event, dict) or not isinstance(event.get("id"), str):
        raise TypeError("an event without an id")
    return event


def refused_text(error: Refused) -> str:
    if error.status == 401:
        return f"{error.message}: STRIPE_API_KEY was not accepted (expired, revoked or mistyped)"
    return (
        f"{error.message}: the key may not list events (a restricted key needs "
        "read access to Events)"
    )


async def recover(
    api: Api,
    store: RunStore,
    route: check.Route,
    since: int,
    *,
    dry_run: bool,
    include_delivered: bool = False,
    shown: Callable[[Item], None] = lambda item: None,
) -> Summary:
    """Check every event since ``since`` (epoch seconds) and claim the missing ones,
    oldest first (a trigger's order value sees them in the order they happened)."""
    summary = Summary(STRIPE_OUTCOMES, dry_run, waited=api.waited)
    try:
        events = await list_events(api, since, include_delivered=include_delivered)
    except Refused as exc:
        summary.error = refused_text(exc)
        return summary
    except ApiError as exc:
        summary.error = exc.message
        return summary
    summary.examined = len(events)
    for event in reversed(events):
        item = await _recover_one(store, route, event, dry_run)
        summary.items.append(item)
        shown(item)
    return summary


async def _recover_one(
    store: RunStore, route: check.Route, event: dict[str, Any], dry_run: bool
) -> Item:
    created = event.get("created")
    at = _iso(created) if isinstance(created, int) else "-"

    def item(outcome: str, why: str) -> Item:
        return Item(event["id"], str(event.get("type") or ""), None, at, outcome, why)

    headers = check.headers_of([("Content-Type", check.JSON)])
    body = orjson.dumps(event)
    try:
        verdict = await check.look(store, route, headers, body)
        if verdict.outcome != check.MISSING:
            return item(verdict.outcome, verdict.why)
        if dry_run:
            return item(STARTED, verdict.why)
        verdict = await check.claim(store, route, headers, body)
    except StoreUnavailable as exc:
        return item(FAILED, exc.message)
    return item(verdict.outcome, verdict.why)


def _iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
