"""The ``/ui`` routes: HTTP in, a page or a redirect out. Reading and changing runs and
deliveries is the store's and the delivery log's (gateway/store/runstore.py,
gateway/deliveries/log.py); the pages are built in gateway/faces/ui/*_views.py.

Every page needs the session cookie of gateway/faces/ui/auth.py; every POST that changes
something also needs the session's CSRF value, and answers with a redirect (so a
reload never sends it twice). Every response forbids framing, scripts and anything
from elsewhere (``SECURITY_HEADERS``): the pages show what senders sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from redis import exceptions as redis_errors
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway.deliveries.log import (
    DeliveryFilter,
    get_delivery,
    list_deliveries,
    replay,
    replay_input,
)
from gateway.faces.api import OVERLOADED_RETRY_AFTER
from gateway.faces.ui.auth import (
    LOGIN_ATTEMPTS,
    UiAuth,
    clear_session,
    client_of,
    is_https,
    login_attempt,
    set_session,
)
from gateway.faces.ui.delivery_views import deliveries_page, delivery_page
from gateway.faces.ui.layout import NOTICES, Frame, login_page, message_page
from gateway.faces.ui.markup import Html
from gateway.faces.ui.run_views import MAX_LINEAGE, Ancestor, StepState, run_page, runs_page
from gateway.ingest.delivery import RETRY_AFTER_SECONDS
from gateway.ingest.served import Serving
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.paging import list_runs_across
from gateway.store.runs import Run
from gateway.store.runstore import RunStore

log = logging.getLogger("realm")

PAGE_SIZE = 50
MAX_FORM_BYTES = 16 * 1024
SECURITY_HEADERS = {
    # Nothing but our own stylesheet and icon; no script at all; forms post here only.
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",  # the pages hold payloads
}
# What a page answers with an error page: a coded refusal, or Redis failing (the store
# maps its errors to StoreUnavailable; a bare one is still "not now", never a 500).
PAGE_ERRORS = (RealmError, redis_errors.ConnectionError, redis_errors.TimeoutError)
STATIC_TYPES = {"ui.css": "text/css; charset=utf-8", "icon.svg": "image/svg+xml"}
OFF = (
    "The inspector is off: set REALM_API_TOKEN in the gateway's environment to enable it "
    "(the same token the /v1 API takes), then log in with it here."
)


@dataclass(frozen=True)
class Visit:
    """A request from a logged-in browser: what is served now, the session and its CSRF
    value, and the form it posted (empty for a GET)."""

    request: Request
    serving: Serving
    session: str
    csrf: str
    form: Mapping[str, str] = field(default_factory=dict)

    @property
    def store(self) -> RunStore:
        return self.serving.store

    def frame(self, *, notice: str | None = None, error: str | None = None) -> Frame:
        if notice is None:
            notice = NOTICES.get(self.request.query_params.get("notice", ""))
        return Frame(self.csrf, self.serving.version, notice, error)


Page = Callable[[Visit], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def ui_routes(token: str | None) -> list[Route]:
    """The inspector's routes; without ``token`` every page says the inspector is off."""
    auth = UiAuth(token) if token else None
    static = {
        name: (resources.files("gateway.faces.ui") / "static" / name).read_bytes()
        for name in STATIC_TYPES
    }

    async def static_file(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in static:
            return _html(message_page("Not found", f"No file {name} here."), 404)
        return Response(
            static[name],
            media_type=STATIC_TYPES[name],
            headers={**SECURITY_HEADERS, "Cache-Control": "public, max-age=3600"},
        )

    async def login(request: Request) -> Response:
        if auth is None:
            return _html(message_page("Inspector off", OFF), 403)
        next_path = _safe_next(request.query_params.get("next", "/ui"))
        serving: Serving = request.state.serving
        proxies = serving.config.settings.trusted_proxies
        if request.method == "GET":
            if await auth.session_of(request, serving.store) is not None:
                return _redirect(next_path)
            notice = NOTICES.get(request.query_params.get("notice", ""))
            return _html(login_page(next_path, Frame(notice=notice)))
        # Counted before the form is read: past the limit, not even a right token passes.
        client = client_of(request, proxies)
        wait = await login_attempt(serving.store, client)
        if wait:
            log.warning("/ui/login: too many attempts from %s", client)
            error = (
                f"Too many login attempts from your address ({LOGIN_ATTEMPTS} a minute at "
                f"most): try again in {wait} s."
            )
            response = _html(login_page(next_path, Frame(error=error)), 429)
            response.headers["Retry-After"] = str(wait)
            return response
        try:
            form = await _form(request)
        except RealmError as exc:
            return _html(login_page("/ui", Frame(error=exc.message)), 413)
        next_path = _safe_next(form.get("next", "/ui"))
        if not auth.token_matches(form.get("token", "")):
            error = "That is not the gateway's API token (REALM_API_TOKEN)."
            return _html(login_page(next_path, Frame(error=error)), 401)
        response = _redirect(next_path)
        session = await auth.start_session(serving.store)
        set_session(response, session, secure=is_https(request, proxies))
        return response

    async def logout(visit: Visit) -> Response:
        assert auth is not None
        await auth.end_session(visit.store, visit.session)
        response = _redirect("/ui/login?notice=logged-out")
        proxies = visit.serving.config.settings.trusted_proxies
        clear_session(response, secure=is_https(visit.request, proxies))
        return response

    def guarded(page: Page, *, post: bool = False) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            if auth is None:
                return _html(message_page("Inspector off", OFF), 403)
            session = await auth.session_of(request, request.state.store)
            if session is None:
                if post:
                    text = "You are not logged in (or your session ended): log in, then try again."
                    return _html(message_page("Log in first", text, back="/ui/login"), 403)
                return _redirect("/ui/login?" + urlencode({"next": _here(request)}))
            csrf = auth.csrf(session)
            form: dict[str, str] = {}
            if post:
                try:
                    form = await _form(request)
                except RealmError as exc:
                    return _html(message_page("Refused", exc.message, Frame(csrf)), 413)
                if not auth.csrf_matches(session, form.get("csrf", "")):
                    text = (
                        "The form's CSRF value is missing or wrong, so nothing was done: "
                        "reload the page and try again."
                    )
                    return _html(message_page("Refused", text, Frame(csrf)), 403)
            visit = Visit(request, request.state.serving, session, csrf, form)
            try:
                return await page(visit)
            except PAGE_ERRORS as exc:
                return _error_page(request, exc, visit.frame())

        return _store_safe(endpoint)

    # HTML pages, not API: left out of /openapi.json (include_in_schema).
    pages: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
        ("/ui", guarded(deliveries), ["GET"]),
        ("/ui/deliveries", guarded(deliveries), ["GET"]),
        ("/ui/deliveries/{delivery_id}", guarded(delivery), ["GET"]),
        ("/ui/deliveries/{delivery_id}/replay", guarded(replay_delivery, post=True), ["POST"]),
        ("/ui/runs", guarded(runs), ["GET"]),
        ("/ui/runs/{run_id}", guarded(run), ["GET"]),
        ("/ui/runs/{run_id}/cancel", guarded(cancel, post=True), ["POST"]),
        ("/ui/login", _store_safe(login), ["GET", "POST"]),
        ("/ui/logout", guarded(logout, post=True), ["POST"]),
        ("/ui/static/{name}", static_file, ["GET"]),
    ]
    return [
        Route(path, endpoint, methods=methods, include_in_schema=False)
        for path, endpoint, methods in pages
    ]


# -- pages ------------------------------------------------------------------------------


async def deliveries(visit: Visit) -> Response:
    query = visit.request.query_params
    filters = {name: query.get(name, "").strip() for name in ("path", "status", "outcome")}
    paths = sorted(visit.serving.by_path)
    where = DeliveryFilter(
        path=filters["path"] or None,
        status=filters["status"] or None,
        outcome=filters["outcome"] or None,
    )
    try:
        items, next_cursor = await list_deliveries(
            visit.store, where, limit=PAGE_SIZE, cursor=query.get("cursor") or None
        )
    except RealmError as exc:
        if exc.code != "VALIDATION_PARAMS":
            raise
        page = deliveries_page([], filters, paths, None, visit.frame(error=exc.message))
        return _html(page, 422)
    return _html(
        deliveries_page(items, filters, paths, next_cursor, visit.frame(), _spooled(visit))
    )


def _spooled(visit: Visit) -> tuple[int, float] | None:
    """What this worker's spool holds: how many deliveries, the oldest's age in seconds."""
    webhooks = getattr(visit.request.state, "webhooks", None)
    spool = getattr(webhooks, "spool", None)
    if spool is None:
        return None
    oldest = spool.oldest_ms()
    return spool.pending(), 0.0 if oldest is None else max(time.time() - oldest / 1000, 0.0)


async def delivery(visit: Visit) -> Response:
    record = await get_delivery(visit.store, visit.request.path_params["delivery_id"])
    phases = await _phases_now(visit.store, record.get("triggers") or [])
    page = delivery_page(record, _not_replayable(record, visit.serving), visit.frame(), phases)
    return _html(page)


async def _phases_now(
    store: RunStore, triggers: Sequence[Mapping[str, Any]]
) -> dict[str, str | None]:
    """The phase each run a delivery's triggers were given is in now (the record holds
    the one at delivery); None for a run that expired."""
    runs = {t["run_id"]: str(t.get("workflow")) for t in triggers if t.get("run_id")}

    async def phase(run_id: str, workflow: str) -> str | None:
        name = store.keys_for_run(workflow, run_id).run(run_id)
        raw = await store.call(lambda: store.redis.hget(name, "phase"))
        return raw.decode() if raw else None

    async with store.deadline():
        found = await asyncio.gather(*(phase(r, wf) for r, wf in runs.items()))
    return dict(zip(runs, found, strict=True))


def _not_replayable(record: Mapping[str, object], serving: Serving) -> str | None:
    """Why a replay of ``record`` would be refused now (None: it would be sent)."""
    try:
        replay_input(record)
    except RealmError as exc:
        return exc.message
    if record["path"] not in serving.by_path:
        return f"no trigger serves {record['path']} in the current configuration"
    return None


async def replay_delivery(visit: Visit) -> Response:
    serving = visit.serving
    record = await replay(
        serving.store,
        serving.by_path,
        serving.config.settings,
        serving.version,
        visit.request.path_params["delivery_id"],
        rerun=visit.form.get("rerun") == "1",
    )
    if not serving.config.settings.delivery_log:
        # Nothing was written to link to: show what the replay did, once.
        notice = "Replayed. The delivery log is off (settings.delivery_log), so this is not kept."
        return _html(delivery_page(record, None, visit.frame(notice=notice)))
    return _redirect(f"/ui/deliveries/{quote(record['delivery_id'])}?notice=replayed")


async def runs(visit: Visit) -> Response:
    query = visit.request.query_params
    filters = {name: query.get(name, "").strip() for name in ("workflow", "phase")}
    filters["key"] = query.get("key", "")
    names = list(visit.serving.config.workflows)
    try:
        if filters["workflow"]:
            visit.serving.config.workflow(filters["workflow"])  # NOT_FOUND_WORKFLOW
        found, next_cursor = await list_runs_across(
            visit.store,
            [filters["workflow"]] if filters["workflow"] else names,
            key=filters["key"] or None,
            phase=filters["phase"] or None,
            limit=PAGE_SIZE,
            cursor=query.get("cursor") or None,
        )
    except RealmError as exc:
        if exc.code not in ("VALIDATION_PARAMS", "NOT_FOUND_WORKFLOW"):
            raise
        return _html(runs_page([], filters, names, None, visit.frame(error=exc.message)), 422)
    return _html(runs_page(found, filters, names, next_cursor, visit.frame()))


async def run(visit: Visit) -> Response:
    store = visit.store
    found = await store.get_run(visit.request.path_params["run_id"])
    state = await _step_state(store, found)
    lineage = await _lineage(store, found)
    page = run_page(found, state, lineage, int(time.time() * 1000), visit.frame())
    return _html(page)


async def _step_state(store: RunStore, run: Run) -> StepState:
    """The run hash's fields that ``Run`` leaves out (gateway/store/lua/take_step.lua,
    step_failed.lua, complete_step.lua write them)."""
    name = store.keys_for_run(run.workflow, run.id).run(run.id)
    async with store.deadline():
        attempt, lease, until, output = await store.call(
            lambda: store.redis.hmget(name, ["attempt", "lease", "lease_until", "output"])
        )
    return StepState(
        attempt=int(attempt or 0),
        lease=lease.decode() if lease else None,
        lease_until_ms=int(until) if until else None,
        output=_json_or_text(output),
    )


def _json_or_text(raw: bytes | None) -> object:
    if not raw:
        return None
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


async def _lineage(store: RunStore, run: Run) -> list[Ancestor]:
    """The runs ``run`` reran, newest first, by following rerun_of (bounded)."""
    out: list[Ancestor] = []
    seen = {run.id}
    older = run.rerun_of
    while older and older not in seen and len(out) < MAX_LINEAGE:
        seen.add(older)
        try:
            ancestor = await store.get_run(older, run.workflow)
        except RealmError as exc:
            if exc.code != "NOT_FOUND_RUN":
                raise
            out.append(Ancestor(older, None))  # expired: the chain ends here
            break
        out.append(Ancestor(older, ancestor))
        older = ancestor.rerun_of
    return out


async def cancel(visit: Visit) -> Response:
    run_id = visit.request.path_params["run_id"]
    cancelled = await visit.store.cancel_run(run_id)
    notice = "cancelled" if cancelled else "not-cancelled"
    return _redirect(f"/ui/runs/{quote(run_id)}?notice={notice}")


# -- plumbing ---------------------------------------------------------------------------


def _html(body: Html, status: int = 200) -> Response:
    return HTMLResponse(body, status, headers=SECURITY_HEADERS)


def _redirect(url: str) -> Response:
    # 303: the browser follows with a GET, so a reload never posts the form again.
    return RedirectResponse(url, 303, headers=SECURITY_HEADERS)


def _store_safe(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with the store's refusals before any page was built (the session's
    check, the login's count) answered as an error page, never a traceback."""

    async def safe(request: Request) -> Response:
        try:
            return await endpoint(request)
        except PAGE_ERRORS as exc:
            return _error_page(request, exc, Frame())

    return safe


def _error_page(request: Request, exc: Exception, frame: Frame) -> Response:
    """A coded error (``PAGE_ERRORS``) as a page."""
    if not isinstance(exc, RealmError):
        log.error("%s %s: the store failed: %s", request.method, request.url.path,
                  type(exc).__name__)  # fmt: skip
        exc = StoreUnavailable("Redis is unavailable; retry")
    headers = {}
    if exc.code == "STORE_UNAVAILABLE":
        status, title = 503, "Store unavailable"
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    elif exc.code == "OVERLOADED":
        status, title = 503, "Busy"
        headers["Retry-After"] = OVERLOADED_RETRY_AFTER
    elif exc.code.startswith("NOT_FOUND_"):
        status, title = 404, "Not found"
    elif exc.code.startswith("STATE_"):
        status, title = 409, "Refused"
    else:
        status, title = 422, "Not understood"
    back = "/ui/runs" if request.url.path.startswith("/ui/runs") else "/ui"
    page = message_page(title, f"{exc.code}: {exc.message}", frame, back=back)
    response = _html(page, status)
    response.headers.update(headers)
    return response


def _here(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _safe_next(path: str) -> str:
    """Where to go after logging in: a page of ours, never another site."""
    ours = path == "/ui" or path.startswith(("/ui/", "/ui?"))
    if ours and path.isascii() and path.isprintable() and "\\" not in path:
        return path
    return "/ui"


async def _form(request: Request) -> dict[str, str]:
    """A posted form (urlencoded, as browsers send it), read up to ``MAX_FORM_BYTES``."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise RealmError("VALIDATION_BODY", f"the form is over {MAX_FORM_BYTES} bytes")
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return {}
    try:
        pairs = parse_qsl(
            body.decode("latin-1"),
            keep_blank_values=True,
            errors="surrogateescape",
            max_num_fields=20,
        )
    except ValueError:
        raise RealmError("VALIDATION_BODY", "the form has too many fields") from None
    return dict(pairs)
