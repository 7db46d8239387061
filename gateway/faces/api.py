"""The admin API under ``/v1``: the run store over HTTP, behind a bearer token."""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.deliveries import log as deliveries
from gateway.deliveries.text import check_cursor as check_delivery_cursor
from gateway.deliveries.text import parse_since
from gateway.faces.admission import Admission
from gateway.ingest import replies
from gateway.ingest.delivery import RETRY_AFTER_SECONDS
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.paging import check_cursor, parse_limit
from gateway.store.reconcile import reconcile
from gateway.store.runs import new_run_id
from gateway.store.runstore import RunStore

if TYPE_CHECKING:
    from gateway.ingest.served import Serving
    from gateway.store.runs import TakenStep

Handler = Callable[[Request, RunStore], Awaitable[Response]]
# As a webhook the worker has no room for (gateway/ingest/webhooks.py): soon.
OVERLOADED_RETRY_AFTER = "1"


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(content), status, headers, media_type="application/json")


def error_response(error: RealmError, *, batch_id: str | None = None) -> Response:
    headers = {}
    if error.code == "STORE_UNAVAILABLE":
        status = 503
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    elif error.code == "OVERLOADED":  # too many calls queued for a Redis connection here
        status = 503
        headers["Retry-After"] = OVERLOADED_RETRY_AFTER
    elif error.code.startswith("STATE_"):
        status = 409
    elif error.code.startswith("NOT_FOUND_"):
        status = 404
    elif error.code == "AUTH_REQUIRED":
        status = 401
        headers["WWW-Authenticate"] = 'Bearer realm="realm-gateway"'
    elif error.code == "AUTH_DISABLED":
        status = 403
    else:
        status = 422
    return json_response(replies.error_json(error, batch_id=batch_id), status, headers)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RealmError("VALIDATION_BODY", f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RealmError("VALIDATION_BODY", "request body must be a JSON object")
    return data


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = data.get(name, default)
    if value is not default and not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise RealmError("VALIDATION_BODY", f"field '{name}' must be of type {names}")
    return value


async def start(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    result = await store.start_run(
        request.path_params["workflow"],
        _field(data, "params", dict, {}),
        _field(data, "idempotency_key", str, None),
        _field(data, "on_live_match", str, "use_existing"),
        _field(data, "on_terminal_match", str, "reuse"),
        _field(data, "on_params_mismatch", str, "flag"),
        request_id=_request_id(data),
    )
    return json_response(replies.start_json(result), 200 if result.deduped else 202)


async def start_batch(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    # Without a caller's batch id, one of ours, returned in the reply: a caller that
    # lost the reply can send the batch again with it and start nothing twice.
    batch_id = _field(data, "batch_id", str, None)
    if batch_id is None:
        batch_id = new_run_id()
    try:
        entries = await store.start_run_batch(
            request.path_params["workflow"],
            _field(data, "items", list, None) or [],
            _field(data, "on_live_match", str, "use_existing"),
            _field(data, "on_terminal_match", str, "reuse"),
            _field(data, "on_params_mismatch", str, "flag"),
            batch_id=batch_id,
        )
    except StoreUnavailable as exc:
        # The outcome is unknown: the reply names the batch, for the retry.
        return error_response(exc, batch_id=batch_id)
    return json_response(
        {"status": "ok", "batch_id": batch_id, "items": replies.batch_json(entries)}
    )


async def list_runs(request: Request, store: RunStore) -> Response:
    query = request.query_params
    runs, cursor = await store.list_runs(
        request.path_params["workflow"],
        key=query.get("key"),
        phase=query.get("phase"),
        limit=parse_limit(query.get("limit", "50")),
        cursor=check_cursor(query.get("cursor")),
    )
    return json_response({"runs": [r.as_dict() for r in runs], "cursor": cursor})


async def get_run(request: Request, store: RunStore) -> Response:
    run = await store.get_run(request.path_params["run_id"])
    return json_response(run.as_dict())


def _request_id(data: dict[str, Any]) -> str | None:
    """The caller's id for this call: a resend with it learns what the first one did."""
    return _field(data, "request_id", str, None)


async def cancel_run(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    cancelled = await store.cancel_run(request.path_params["run_id"], op_id=_request_id(data))
    return json_response({"cancelled": cancelled})


async def cancel_key(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    key = _field(data, "idempotency_key", str, None)
    if key is None:
        raise RealmError("VALIDATION_BODY", "field 'idempotency_key' is required")
    cancelled = await store.cancel_key(
        request.path_params["workflow"], key, op_id=_request_id(data)
    )
    return json_response({"cancelled": cancelled})


MAX_CLAIM_COUNT = 100
# The runner name claims read with when the caller names none (the stream's consumer).
DEFAULT_RUNNER = "api"


async def claim_steps(request: Request, store: RunStore) -> Response:
    """Take up to ``count`` ready steps of a workflow, each with a lease (RUNNERS_SPEC)."""
    data = await _body(request)
    runner = _field(data, "runner", str, DEFAULT_RUNNER)
    count = _field(data, "count", int, 1)
    seconds = _field(data, "lease_seconds", (int, float), None)
    if not runner or len(runner) > 200:
        raise RealmError("VALIDATION_BODY", "field 'runner' must be 1 to 200 characters")
    if isinstance(count, bool) or not 1 <= count <= MAX_CLAIM_COUNT:
        raise RealmError("VALIDATION_BODY", f"field 'count' must be 1 to {MAX_CLAIM_COUNT}")
    if seconds is not None and (isinstance(seconds, bool) or not 1 <= seconds <= 3600):
        raise RealmError("VALIDATION_BODY", "field 'lease_seconds' must be 1 to 3600")
    taken = await store.take_steps(
        request.path_params["workflow"], runner, count=count,
        lease_ms=None if seconds is None else int(seconds * 1000),
    )  # fmt: skip
    return json_response({"status": "ok", "steps": [_taken_json(t) for t in taken]})


def _taken_json(taken: TakenStep) -> dict[str, Any]:
    return {
        "run_id": taken.run_id,
        "workflow": taken.workflow,
        "step": taken.step,
        "attempt": taken.attempt,
        "params": taken.params,
        "output": taken.output,
        "lease": taken.lease,
        "lease_until_ms": taken.lease_until_ms,
    }


def _lease(data: dict[str, Any]) -> str | None:
    """The lease a runner claimed the step with (without one, no lease is checked)."""
    return _field(data, "lease", str, None)


async def complete_step(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    step = _field(data, "step", str, None)
    if step is None:
        raise RealmError("VALIDATION_BODY", "field 'step' is required")
    result = await store.complete_step(
        request.path_params["run_id"], step, lease=_lease(data), output=data.get("output"),
        op_id=_request_id(data),
    )  # fmt: skip
    return json_response(
        {
            "status": "ok",
            "run_id": result.run_id,
            "phase": result.phase,
            "next_step": result.next_step,
        }
    )


async def fail_run(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    error = _field(data, "error", str, "")
    if _field(data, "retry", bool, False):
        # One attempt of the step fails: it is taken again after a backoff, or the
        # run fails once the workflow's max_attempts are used.
        step = _field(data, "step", str, None)
        lease = _lease(data)
        if step is None or lease is None:
            raise RealmError("VALIDATION_BODY", "'retry' needs the fields 'step' and 'lease'")
        failure = await store.fail_step(
            request.path_params["run_id"], step, error, lease=lease, op_id=_request_id(data)
        )
        return json_response(
            {
                "status": "ok",
                "run_id": failure.run_id,
                "phase": failure.phase,
                "attempt": failure.attempt,
                "retry_at_ms": failure.retry_at_ms,
            }
        )
    run = await store.fail_run(
        request.path_params["run_id"], error, lease=_lease(data), op_id=_request_id(data)
    )
    return json_response({"status": "ok", **run.as_dict()})


async def reconcile_keys(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    report = await reconcile(
        store,
        workflow=_field(data, "workflow", str, None),
        dry_run=_field(data, "dry_run", bool, True),
        scan=_field(data, "scan", bool, False),
    )
    return json_response({"status": "ok", **report.as_dict()})


async def list_deliveries(request: Request, store: RunStore) -> Response:
    query = request.query_params
    since = query.get("since")
    where = deliveries.DeliveryFilter(
        path=query.get("path"),
        status=query.get("status"),
        outcome=query.get("outcome"),
        since_ms=None if since is None else parse_since(since, int(time.time() * 1000)),
    )
    page, cursor = await deliveries.list_deliveries(
        store,
        where,
        limit=parse_limit(query.get("limit", "50")),
        cursor=check_delivery_cursor(query.get("cursor")),
    )
    return json_response({"deliveries": page, "cursor": cursor})


async def get_delivery(request: Request, store: RunStore) -> Response:
    return json_response(await deliveries.get_delivery(store, request.path_params["delivery_id"]))


async def replay_delivery(request: Request, store: RunStore) -> Response:
    data = await _body(request)
    rerun = _field(data, "rerun", bool, False)
    # The configuration serving now: a reload since the delivery may have fixed a trigger.
    serving: Serving = request.state.serving
    record = await deliveries.replay(
        serving.store, serving.by_path, serving.config.settings, serving.version,
        request.path_params["delivery_id"], rerun=rerun,
    )  # fmt: skip
    return json_response(record)


def _guarded(
    handler: Handler, token: str | None, admission: Admission | None = None
) -> Callable[[Request], Awaitable[Response]]:
    """Bearer-token check (constant time), then the handler (in a slot of ``admission``
    when given: reads); coded errors become replies."""
    # surrogateescape: the environment's bytes as they were, even when not UTF-8.
    expected = token.encode("utf-8", "surrogateescape") if token else None

    async def endpoint(request: Request) -> Response:
        try:
            if expected is None:
                raise RealmError(
                    "AUTH_DISABLED",
                    "the admin API is off: set REALM_API_TOKEN in the gateway's environment "
                    "to enable it, then send 'Authorization: Bearer <token>'",
                )
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            # Starlette decodes header bytes as latin-1: encoding back gives the bytes
            # sent, compared with the token's UTF-8 bytes (a non-ASCII token matches).
            # Spaces and tabs around a field value are not part of it (RFC 9110).
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip(" \t").encode("latin-1"), expected
            ):
                raise RealmError("AUTH_REQUIRED", "send 'Authorization: Bearer <REALM_API_TOKEN>'")
            if admission is None:
                return await handler(request, request.state.store)
            async with admission:  # OVERLOADED when too many wait
                return await handler(request, request.state.store)
        except RealmError as exc:
            return error_response(exc)

    return endpoint


# (path, method, handler, summary): the OpenAPI document is built from this list too.
API_ROUTES: list[tuple[str, str, Handler, str]] = [
    ("/v1/workflows/{workflow}/runs", "POST", start, "Start a run, or return the key's run"),
    ("/v1/workflows/{workflow}/runs", "GET", list_runs, "List runs, newest first"),
    ("/v1/workflows/{workflow}/batch", "POST", start_batch, "Start several runs in one call"),
    (
        "/v1/workflows/{workflow}/cancel",
        "POST",
        cancel_key,
        "Cancel the live, scheduled and queued runs of a key",
    ),
    (
        "/v1/workflows/{workflow}/steps/claim",
        "POST",
        claim_steps,
        "Take ready steps, each with a lease",
    ),
    ("/v1/runs/{run_id}", "GET", get_run, "Get a run"),
    ("/v1/runs/{run_id}/cancel", "POST", cancel_run, "Cancel a run"),
    ("/v1/runs/{run_id}/complete", "POST", complete_step, "Complete the run's current step"),
    ("/v1/runs/{run_id}/fail", "POST", fail_run, "Fail a live run, or one attempt of its step"),
    ("/v1/reconcile", "POST", reconcile_keys, "Check and repair key pointers"),
    ("/v1/deliveries", "GET", list_deliveries, "List the delivery log, newest first"),
    ("/v1/deliveries/{delivery_id}", "GET", get_delivery, "Get one delivery's record"),
    (
        "/v1/deliveries/{delivery_id}/replay",
        "POST",
        replay_delivery,
        "Send a stored delivery through matching again",
    ),
]


def api_routes(token: str | None) -> list[Route]:
    reads = Admission()  # this worker's reads take turns (gateway/faces/admission.py)
    return [
        Route(
            path,
            _guarded(handler, token, reads if method == "GET" else None),
            methods=[method],
            name=handler.__name__,
        )
        for path, method, handler, _ in API_ROUTES
    ]
