"""``realm listen``: checks the config, picks the Redis, then serves the app with uvicorn."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import tempfile
from pathlib import Path

import click
import redis
import uvicorn

from gateway.config import Config
from gateway.connection import ping_url, redact_url, redis_client, redis_target
from gateway.errors import StoreUnavailable
from gateway.observe import setup_logging
from gateway.store import RunStore
from gateway.triggers import describe_event_id
from gateway.verify import describe

# How long SIGTERM waits for in-flight deliveries before closing connections.
GRACEFUL_SHUTDOWN_SECONDS = 30
# How long an idle keep-alive connection is kept open (uvicorn's default is 5 s).
KEEP_ALIVE_SECONDS = 75

log = logging.getLogger("realm")


class CannotBind(Exception):
    """The address to listen on is taken or not allowed: not a config error."""


def serve(
    config: Config,
    *,
    host: str,
    port: int,
    workers: int,
    redis_url: str | None,
    data_dir: str,
) -> None:
    """Serve until SIGTERM or Ctrl-C; an embedded server started here stops afterwards.

    Raises ``CannotBind`` before anything starts when ``host``/``port`` cannot be bound."""
    setup_logging()
    check_bindable(host, port)
    with (
        redis_target(redis_url, data_dir) as target,
        tempfile.TemporaryDirectory(prefix="realm-metrics-") as metrics_dir,
    ):
        echo = lambda text: click.echo(text, err=True)  # noqa: E731
        echo(f"realm listen: http://{host}:{port} ({workers} worker{'s' * (workers > 1)})")
        echo(f"store: {target.description}")
        for trigger in config.triggers.values():
            if trigger.verify.scheme == "none":
                log.warning(
                    "trigger '%s' has verify: none: its deliveries are not authenticated",
                    trigger.name,
                )
            echo(
                f"  POST {trigger.path}  → {trigger.workflow}  "
                f"[{trigger.name}; {describe(trigger.verify)}; event id: "
                f"{describe_event_id(trigger)}]"
            )
        if not config.triggers:
            echo("  (no triggers in the config: only /healthz and /readyz are served)")
        if reachable(target.url, config.settings.redis_timeout):
            # A changed `partitions` would move a workflow's keys: refused before serving.
            asyncio.run(check_layout(config, target.url))
        # Workers are separate processes: they read their settings from here.
        os.environ["REALM_CONFIG"] = str(Path(config.file).resolve())
        os.environ["REALM_REDIS_URL"] = target.url
        if workers > 1:
            # Each worker writes its metrics here; /metrics sums them (gateway/metrics.py).
            # One process keeps them in memory: cheaper, and nothing to sum.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then restores the handlers
        # it found and raises the signal again. With Python's defaults that kills
        # the process (exit -15, or a KeyboardInterrupt traceback) before the
        # embedded server is stopped: make the re-raised signal a no-op instead.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        uvicorn.run(
            "gateway.app:app_from_env",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_config=None,
            # httptools, with a cap on each request's head (431).
            http="gateway.edge:BoundedHttpToolsProtocol",
            access_log=False,  # the app logs one JSON line per delivery instead
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            # Longer than a load balancer's idle timeout (AWS ALB: 60 s): else the
            # gateway may close an idle connection just as the balancer (or a sender
            # reusing it) writes a request on it, which then fails unanswered.
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            server_header=False,
            # Client addresses are never used, so skip uvicorn's X-Forwarded-For
            # rewriting on every request.
            proxy_headers=False,
        )


def check_bindable(host: str, port: int) -> None:
    """Bind ``host:port`` once, as uvicorn will, to report a port in use in words of
    the command's own options (uvicorn would log an errno and exit 1). A race with
    another process between this check and uvicorn's bind is left to uvicorn."""
    if port == 0:
        return  # any free port
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)  # fmt: skip
    except socket.gaierror as exc:
        raise CannotBind(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # As asyncio's create_server: a port in TIME_WAIT is free to use.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise CannotBind(
                        f"--port {port} is already in use on {host}: another process "
                        "listens there; stop it or choose another --port"
                    ) from None
                if exc.errno == errno.EACCES:
                    raise CannotBind(
                        f"--port {port} on {host}: permission denied (ports below 1024 "
                        "need privileges); choose another --port"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL and family == socket.AF_INET6:
                    continue  # IPv6 off on this machine; asyncio skips it too
                raise CannotBind(f"--host {host} --port {port}: {exc.strerror}") from None


def reachable(url: str, timeout: float) -> bool:
    """Whether the store answers at start-up; if not, one loud line. The gateway starts
    anyway (its Redis may come up later, as in a container start), answering 503
    until it does: a listener that looks healthy while it refuses every delivery
    would be worse."""
    try:
        # Every primary of a cluster; the client redis_client makes for any scheme.
        asyncio.run(ping_url(url, timeout))
        return True
    except redis.RedisError as exc:
        log.error(
            "error: the store (Redis at %s) is unavailable: %s. Starting anyway: "
            "webhooks and /v1 answer 503 STORE_UNAVAILABLE and /readyz 503 until it does",
            redact_url(url), _reason(exc),
        )  # fmt: skip
        return False


async def check_layout(config: Config, url: str) -> None:
    """RunStore.check_layout on a client of its own (raises ConfigError)."""
    client = redis_client(url, config.settings.redis_timeout)
    try:
        await RunStore(client, config).check_layout()
    except StoreUnavailable as exc:
        log.error("error: could not check the workflows' partitions: %s", exc.message)
    finally:
        await client.aclose()


def _reason(exc: BaseException) -> str:
    # One line, and never the URL (redis-py's messages name the host and port).
    text = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
    return text[:300]
