"""The gateway's ASGI app: webhook POSTs (gateway/ingest/webhooks.py) in front of a Starlette
app for the admin API, health, metrics and OpenAPI; the lifespan owns Redis."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from redis import exceptions as redis_errors
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.deliveries.log import DeliveryRecorder
from gateway.faces.api import api_routes, error_response, json_response
from gateway.faces.openapi import openapi_document
from gateway.faces.ui import ui_routes
from gateway.ingest.deadlines import Deadlines
from gateway.ingest.delivery import RETRY_AFTER_SECONDS
from gateway.ingest.drain import Drainer
from gateway.ingest.observe import DeliveryLog, setup_logging
from gateway.ingest.served import Serving
from gateway.ingest.webhooks import Webhooks
from gateway.link.connection import redis_client
from gateway.loading import load_config
from gateway.model.config import Config
from gateway.model.errors import StoreUnavailable
from gateway.serving import metrics
from gateway.serving.reload import ReloadOnHangup, Reloads, defer_hangups
from gateway.spool.spool import Spool
from gateway.store.runstore import RunStore
from gateway.store.sweep import Sweeper

log = logging.getLogger("realm")


# The folder `realm listen` hands its workers for their spools (settings.spool.dir, or
# `spool` in the data folder), made absolute.
SPOOL_DIR_ENV = "REALM_SPOOL_DIR"


def create_app(
    config: Config,
    redis_url: str,
    *,
    api_token: str | None = None,
    reloads: Reloads | None = None,
    spool_dir: str | None = None,
) -> Webhooks:
    """The gateway app. ``api_token`` enables the admin API; without it, /v1 answers 403.
    ``reloads``: SIGHUP reloads the config, as it says (gateway/serving/reload.py).
    ``spool_dir``: where this worker spools deliveries Redis cannot take (with
    ``settings.spool`` on); None: no spool, such a delivery gets 503."""
    delivery_log = DeliveryLog()
    deadlines = Deadlines()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        client = redis_client(redis_url, config.settings.redis_timeout)
        store = RunStore(client, config, pipelined=True)
        webhooks.serving = Serving.of(config, store)
        recorder = webhooks.recorder = DeliveryRecorder(store, config.settings)
        try:
            await store.load_scripts()
        except Exception as exc:
            # `realm listen` has said it loudly if the store is unreachable; this is
            # the worker's own note. The type only: a reply may quote the server.
            log.warning(
                "scripts not loaded at start-up (%s); will load on first use", type(exc).__name__
            )
        flusher = asyncio.create_task(delivery_log.flush_every())
        sweeper = asyncio.create_task(deadlines.sweep())
        # Trims the run indexes and streams, so memory follows retention; every worker runs it, and
        # the workers and replicas share one walk (gateway/store/sweep.py). It first makes the
        # runners' group on every stream: a step nobody read yet is never trimmed.
        trimming = Sweeper(store)
        trimmer = asyncio.create_task(trimming.run())
        recording = asyncio.create_task(recorder.run())
        spool = draining = None
        if spool_dir is not None and config.settings.spool is not None:
            spool = webhooks.spool = Spool(spool_dir, config.settings.spool.max_bytes)
            drainer = Drainer(webhooks, spool, config.settings.spool.drain_rate)
            draining = asyncio.create_task(drainer.run())
        hangup = ReloadOnHangup(webhooks, config.file, trimming, reloads) if reloads else None
        if hangup is not None:
            hangup.install()
        try:
            yield {"store": store, "serving": webhooks.serving, "webhooks": webhooks}
        finally:
            if hangup is not None:
                await hangup.remove()
            flusher.cancel()
            sweeper.cancel()
            trimmer.cancel()
            recording.cancel()
            if draining is not None:
                draining.cancel()
            # Off Redis before close; the log's last records written first.
            await asyncio.gather(trimmer, recording, *filter(None, [draining]),
                                 return_exceptions=True)  # fmt: skip
            if spool is not None:
                webhooks.spool = None
                spool.close()
            await recorder.close()
            delivery_log.flush()
            store.close()
            await client.aclose()

    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"})

    # Whether the last /readyz failed, so a probe every few seconds logs a failure
    # once, when it starts, not at every probe.
    not_ready = [False]

    async def readyz(request: Request) -> Response:
        store: RunStore = request.state.store
        serving: Serving = request.state.serving
        try:
            await store.ping()
            await store.ensure_scripts()  # SCRIPT EXISTS; a load only of those missing
        except Exception as exc:
            # /readyz needs no token: the reply says what, never the server's words.
            if not not_ready[0]:
                log.error("/readyz: the store is not ready: %s", _describe(exc))
            not_ready[0] = True
            spool = webhooks.spool
            if spool is not None and spool.has_room():
                # Deliveries are kept meanwhile: a probe must not take this worker out
                # of the balancer because Redis blinked.
                return json_response({"status": "ok", "config_version": serving.version,
                                      "store": "unavailable", "spool": "accepting"})  # fmt: skip
            return _unavailable("the store (Redis) is not ready; the gateway log says why")
        if not_ready[0]:
            log.warning("/readyz: the store is ready again")
        not_ready[0] = False
        return json_response({"status": "ok", "config_version": serving.version})

    documents: dict[str, dict[str, Any]] = {}  # by config version: a reload adds paths

    async def openapi(request: Request) -> Response:
        serving: Serving = request.state.serving
        if serving.version not in documents:
            documents.clear()
            documents[serving.version] = openapi_document(list(serving.by_path))
        return json_response(documents[serving.version])

    queue_gauges = metrics.QueueGauges()

    async def metrics_text(request: Request) -> Response:
        delivery_log.flush()  # this worker's counts; the others flush every 0.2 s
        text, content_type = metrics.render()
        # The step streams, read from Redis at most once a second (bounded; never fails
        # the scrape).
        text += await queue_gauges.text(request.state.store)
        return Response(text, headers={"Content-Type": content_type})

    routes = api_routes(api_token)
    routes += ui_routes(api_token)  # /ui: the inspector, behind the same token
    routes += [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/openapi.json", openapi),
        Route("/metrics", metrics_text),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: _http_error,
            # Whatever route it comes from (/v1 answers its own coded errors first).
            StoreUnavailable: _store_error,
            redis_errors.ConnectionError: _store_error,
            redis_errors.TimeoutError: _store_error,
        },
    )
    webhooks = Webhooks(app, config.settings, delivery_log, deadlines)
    return webhooks


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "NOT_FOUND_ROUTE", 405: "METHOD_NOT_ALLOWED"}
    message = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}",
    }
    return json_response(
        {
            "status": "error",
            "code": codes.get(exc.status_code, "HTTP_ERROR"),
            "message": message.get(exc.status_code, exc.detail),
        },
        exc.status_code,
        dict(exc.headers or {}),
    )


def _unavailable(message: str) -> Response:
    return json_response(
        {"status": "error", "code": "STORE_UNAVAILABLE", "message": message},
        503,
        {"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


async def _store_error(request: Request, exc: Exception) -> Response:
    """Redis refused for now, or did not answer: the caller retries, never a 500."""
    if isinstance(exc, StoreUnavailable):
        return error_response(exc)  # STORE_UNAVAILABLE, or OVERLOADED: each its Retry-After
    log.error("%s %s: the store failed: %s", request.method, request.url.path, _describe(exc))
    return _unavailable("Redis is unavailable; retry")


def _describe(exc: BaseException) -> str:
    """An exception in one line for the log (the store's messages name no secret)."""
    message = exc.message if isinstance(exc, StoreUnavailable) else str(exc)
    text = " ".join(message.split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def app_from_env() -> Webhooks:
    """The app for uvicorn's worker processes, which get their settings by environment."""
    # A SIGHUP before the lifespan handles it (a reload racing this worker's start)
    # must not end the worker, as its default action would.
    defer_hangups()
    setup_logging()
    config = load_config(os.environ.get("REALM_CONFIG", "triggers.yaml"))
    return serving_app(config, os.environ["REALM_REDIS_URL"], Reloads())


def serving_app(config: Config, redis_url: str, reloads: Reloads) -> Webhooks:
    """The app a listener process serves (``REALM_API_TOKEN`` and the spool's folder
    from the environment), with the garbage collector tuned for serving."""
    app = create_app(config, redis_url, api_token=os.environ.get("REALM_API_TOKEN") or None,
                     reloads=reloads, spool_dir=os.environ.get(SPOOL_DIR_ENV) or None)  # fmt: skip
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
