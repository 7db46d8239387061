"""The gateway's ASGI app: webhook POSTs (gateway/webhooks.py) in front of a Starlette
app for the admin API, health, metrics and OpenAPI; the lifespan owns Redis."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import metrics
from gateway.api import api_routes, json_response
from gateway.config import Config, load_config
from gateway.connection import redis_client
from gateway.deadlines import Deadlines
from gateway.observe import DeliveryLog, setup_logging
from gateway.openapi import openapi_document
from gateway.store import RunStore
from gateway.triggers import Trigger
from gateway.webhooks import Webhooks

log = logging.getLogger("realm")


def create_app(config: Config, redis_url: str, *, api_token: str | None = None) -> Webhooks:
    """The gateway app. ``api_token`` enables the admin API; without it, /v1 answers 403."""
    delivery_log = DeliveryLog()
    deadlines = Deadlines()
    by_path: dict[str, list[Trigger]] = defaultdict(list)
    for trigger in config.triggers.values():
        by_path[trigger.path].append(trigger)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        client = redis_client(redis_url, config.settings.redis_timeout)
        store = RunStore(client, config, pipelined=True)
        try:
            await store.load_scripts()
        except Exception as exc:
            log.warning("scripts not loaded at start-up (%s); will load on first use", exc)
        flusher = asyncio.create_task(delivery_log.flush_every())
        sweeper = asyncio.create_task(deadlines.sweep())
        try:
            yield {"store": store}
        finally:
            flusher.cancel()
            sweeper.cancel()
            delivery_log.flush()
            store.close()
            await client.aclose()

    async def post_only(request: Request) -> Response:
        # POSTs to a trigger path never get here: Webhooks answers them first.
        raise HTTPException(405)

    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(request: Request) -> Response:
        store: RunStore = request.state.store
        try:
            await store.ping()
            await store.load_scripts()
        except Exception as exc:
            return json_response({"status": "error", "message": str(exc)}, 503)
        return json_response({"status": "ok"})

    document = openapi_document(list(by_path))

    async def openapi(request: Request) -> Response:
        return json_response(document)

    async def metrics_text(request: Request) -> Response:
        delivery_log.flush()  # this worker's counts; the others flush every 0.2 s
        text, content_type = metrics.render()
        return Response(text, headers={"Content-Type": content_type})

    routes = [Route(path, post_only, methods=["POST"]) for path in by_path]
    routes += api_routes(api_token)
    routes += [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/openapi.json", openapi),
        Route("/metrics", metrics_text),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    return Webhooks(app, by_path, config.settings, delivery_log, deadlines)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "NOT_FOUND_ROUTE", 405: "METHOD_NOT_ALLOWED"}
    message = {404: f"no route {request.url.path}", 405: "webhook routes take POST only"}
    return json_response(
        {
            "status": "error",
            "code": codes.get(exc.status_code, "HTTP_ERROR"),
            "message": message.get(exc.status_code, exc.detail),
        },
        exc.status_code,
        dict(exc.headers or {}),
    )


def app_from_env() -> Webhooks:
    """The app for uvicorn's worker processes, which get their settings by environment."""
    setup_logging()
    config = load_config(os.environ.get("REALM_CONFIG", "triggers.yaml"))
    app = create_app(
        config, os.environ["REALM_REDIS_URL"], api_token=os.environ.get("REALM_API_TOKEN") or None
    )
    _tune_gc()
    return app


def _tune_gc() -> None:
    """A delivery allocates a few hundred objects (its parsed body, mostly), almost all
    freed by reference counting; with CPython's default thresholds the cycle
    collector still ran every few deliveries and re-scanned everything loaded at
    start-up. Freezing what exists now, and collecting the youngest generation
    every 50 000 allocations instead of 700, took 20 % off a delivery's CPU time
    (measured in-process: 87 -> 69 us)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
