"""The Starlette app: one POST route per trigger path, health routes; the lifespan owns Redis."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import delivery, metrics
from gateway.api import api_routes
from gateway.config import Config, load_config
from gateway.connection import redis_client
from gateway.openapi import openapi_document
from gateway.store import RunStore
from gateway.triggers import Trigger

log = logging.getLogger("realm")


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def create_app(config: Config, redis_url: str, *, api_token: str | None = None) -> Starlette:
    """The gateway app. ``api_token`` enables the admin API; without it, /v1 answers 403."""
    by_path: dict[str, list[Trigger]] = defaultdict(list)
    for trigger in config.triggers.values():
        by_path[trigger.path].append(trigger)
    settings = config.settings
    max_body = settings.max_body_bytes
    # Deliveries past their body read and not yet answered, in this worker. Past the
    # limit a delivery gets 503 at once: a queue that grows without bound would only
    # turn a burst into timeouts for everyone.
    in_flight = 0

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        client = redis_client(redis_url, config.settings.redis_timeout)
        store = RunStore(client, config, coalesce=True)
        try:
            await store.load_scripts()
        except Exception as exc:
            log.warning("scripts not loaded at start-up (%s); will load on first use", exc)
        try:
            yield {"store": store}
        finally:
            await client.aclose()

    def webhook(triggers: list[Trigger]) -> Any:
        async def endpoint(request: Request) -> Response:
            nonlocal in_flight
            started = time.perf_counter()
            try:
                async with asyncio.timeout(settings.body_timeout):
                    body = await _read_body(request, max_body)
            except TimeoutError:
                body = b""
                reply = delivery.error_reply(
                    408, "VALIDATION_BODY_TIMEOUT",
                    f"the body did not arrive within {settings.body_timeout:g} s",
                )  # fmt: skip
            else:
                if body is None:
                    reply = delivery.error_reply(
                        413, "VALIDATION_BODY_TOO_LARGE", f"body is larger than {max_body} bytes"
                    )
                elif in_flight >= settings.max_in_flight:
                    reply = delivery.error_reply(
                        503, "OVERLOADED",
                        f"more than {settings.max_in_flight} deliveries in flight; retry",
                        **{"Retry-After": "1"},
                    )  # fmt: skip
                else:
                    in_flight += 1
                    try:
                        reply = await delivery.handle(
                            request.state.store,
                            triggers,
                            request.headers,
                            request.headers.get("content-type"),
                            body,
                        )
                    finally:
                        in_flight -= 1
            _observe(request.url.path, reply, started)
            return JSONResponse(reply.body, reply.status, headers=reply.headers)

        return endpoint

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        store: RunStore = request.state.store
        try:
            await store.ping()
            await store.load_scripts()
        except Exception as exc:
            return JSONResponse({"status": "error", "message": str(exc)}, 503)
        return JSONResponse({"status": "ok"})

    document = openapi_document(list(by_path))

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    async def metrics_text(request: Request) -> Response:
        text, content_type = metrics.render()
        return Response(text, headers={"Content-Type": content_type})

    routes = [Route(path, webhook(ts), methods=["POST"]) for path, ts in by_path.items()]
    routes += api_routes(api_token)
    routes += [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/openapi.json", openapi),
        Route("/metrics", metrics_text),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "NOT_FOUND_ROUTE", 405: "METHOD_NOT_ALLOWED"}
    message = {404: f"no route {request.url.path}", 405: "webhook routes take POST only"}
    return JSONResponse(
        {
            "status": "error",
            "code": codes.get(exc.status_code, "HTTP_ERROR"),
            "message": message.get(exc.status_code, exc.detail),
        },
        exc.status_code,
        headers=exc.headers,
    )


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The whole body, or None as soon as it is known to be over ``limit``:
    a declared length is refused before reading, a streamed one mid-way."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _observe(path: str, reply: delivery.Reply, started: float) -> None:
    """Metrics, and one JSON log line per delivery. Never a header, a secret, a
    signature or the body."""
    seconds = time.perf_counter() - started
    metrics.DELIVERIES.labels(path, str(reply.status)).inc()
    metrics.LATENCY.labels(path).observe(seconds)
    for r in reply.results:
        metrics.OUTCOMES.labels(r.trigger, r.workflow, r.outcome).inc()
    record: dict[str, Any] = {
        "event": "delivery",
        "path": path,
        "status": reply.status,
        "ms": round(seconds * 1000, 2),
    }
    if reply.results:
        record["results"] = [
            {
                "trigger": r.trigger,
                "workflow": r.workflow,
                "event_id": r.event_id,
                "outcome": r.outcome,
                "run_id": r.run_id,
                **({"code": r.code} if r.code else {}),
                **({"params_mismatch": True} if r.params_mismatch else {}),
            }
            for r in reply.results
        ]
    else:
        record["code"] = reply.body.get("code")
    mismatch = any(r.params_mismatch or r.code == "STATE_IDEMPOTENCY_KEY_CONFLICT"
                   for r in reply.results)  # fmt: skip
    level = logging.WARNING if mismatch or reply.status >= 500 else logging.INFO
    log.log(level, orjson.dumps(record).decode())


def app_from_env() -> Starlette:
    """The app for uvicorn's worker processes, which get their settings by environment."""
    config = load_config(os.environ.get("REALM_CONFIG", "triggers.yaml"))
    return create_app(
        config, os.environ["REALM_REDIS_URL"], api_token=os.environ.get("REALM_API_TOKEN") or None
    )
