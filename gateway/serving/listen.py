"""``realm listen``: checks the config, picks the Redis, then serves the app with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

import click
import redis
import uvicorn
from uvicorn.supervisors import Multiprocess

from gateway.ingest.observe import setup_logging
from gateway.ingest.triggers import describe_event_id
from gateway.link.connection import ping_url, redact_url, redis_client, redis_target
from gateway.model.config import Config
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.serving.pidfile import pid_file_kept
from gateway.serving.reload import (
    check_partitions_at,
    count_in_supervisor,
    defer_hangups,
    layout_changes,
    load_for_reload,
    log_line,
    refused,
)
from gateway.signatures.spec import describe
from gateway.store.runstore import RunStore

# How long SIGTERM waits for in-flight deliveries before closing connections.
GRACEFUL_SHUTDOWN_SECONDS = 30
# How long an idle keep-alive connection is kept open (uvicorn's default is 5 s).
KEEP_ALIVE_SECONDS = 75
# The app every worker serves (it reads its settings from the environment).
APP = "gateway.serving.app:app_from_env"

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
    pid_file: str | None = None,
) -> None:
    """Serve until SIGTERM or Ctrl-C; an embedded server started here stops afterwards.
    SIGHUP reloads the config file (gateway/serving/reload.py); this process's id is written to
    ``pid_file`` (default: ``<data_dir>/listen.pid``) for ``realm triggers reload``.

    Raises ``CannotBind`` before anything starts when ``host``/``port`` cannot be bound,
    ``PidFileError`` when the ``pid_file`` given cannot be written."""
    setup_logging()
    # Until the app handles SIGHUP, one (a reload racing the start) must not end the
    # process, as its default action would: one worker reloads once it can, several
    # read the file as they start.
    defer_hangups()
    check_bindable(host, port)
    with (
        # After the bind check: a listener that cannot start leaves another's file alone.
        pid_file_kept(pid_file, data_dir),
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
        config_file = str(Path(config.file).resolve())
        os.environ["REALM_CONFIG"] = config_file
        os.environ["REALM_REDIS_URL"] = target.url
        if workers > 1:
            # Each worker writes its metrics here; /metrics sums them (gateway/serving/metrics.py).
            # One process keeps them in memory: cheaper, and nothing to sum.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then restores the handlers
        # it found and raises the signal again. With Python's defaults that kills
        # the process (exit -15, or a KeyboardInterrupt traceback) before the
        # embedded server is stopped: make the re-raised signal a no-op instead.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        options: dict[str, Any] = dict(
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_config=None,
            # httptools, with a cap on each request's head (431).
            http="gateway.ingest.edge:BoundedHttpToolsProtocol",
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
        if workers == 1:
            # One process: the app's lifespan reloads on SIGHUP itself.
            uvicorn.run(APP, **options)
            return
        # Several: what uvicorn.run does for them, with a supervisor of our own (below).
        uv_config = uvicorn.Config(APP, **options)
        sock = uv_config.bind_socket()
        # (No KeyboardInterrupt to catch, as uvicorn.run does: the supervisor handles SIGINT.)
        Supervisor(uv_config, [sock], config=config, config_file=config_file,
                   redis_url=target.url).run()  # fmt: skip


class Supervisor(Multiprocess):
    """uvicorn's supervisor of worker processes, but SIGHUP reloads the config in each
    worker rather than replacing the workers (uvicorn's way, which cuts their open
    connections). The file is checked here first, so that a refused one is logged
    once, not once per worker; a file that passes is reloaded by each worker's
    lifespan (gateway/serving/reload.py), which checks it again and logs its own line."""

    def __init__(
        self,
        uv_config: uvicorn.Config,
        sockets: list[socket.socket],
        *,
        config: Config,
        config_file: str,
        redis_url: str,
    ) -> None:
        super().__init__(uv_config, sockets)
        self.running = config  # what the workers were last asked to serve
        self.config_file = config_file
        self.redis_url = redis_url

    def handle_signals(self) -> None:
        # SIGHUPs queued since the last look (every 0.5 s) would all read the same
        # file: one reload does.
        for _ in range(self.signal_queue.count(signal.SIGHUP) - 1):
            self.signal_queue.remove(signal.SIGHUP)
        super().handle_signals()

    def handle_hup(self) -> None:
        try:
            new = load_for_reload(self.config_file, self.running.settings)
            if layout_changes(self.running, new):
                asyncio.run(check_partitions_at(self.redis_url, new, self.running))
        except ConfigError as exc:
            refused(self.config_file, self.running.version, str(exc), count=False)
            count_in_supervisor("refused")
            return
        for process in self.processes:
            # A worker still starting would die of SIGHUP until its app defers it
            # (gateway/serving/reload.py defer_hangups); one that has started reloads.
            if not process.wait_until_ready(self.config.timeout_worker_healthcheck,
                                            self.should_exit):  # fmt: skip
                if not self.should_exit.is_set():
                    log_line("not_forwarded", self.config_file, self.running.version,
                             error=f"worker {process.pid} did not answer; it serves what "
                                   "it read at its start")  # fmt: skip
                continue
            assert process.pid is not None
            with contextlib.suppress(ProcessLookupError):  # it died: its successor reads the file
                os.kill(process.pid, signal.SIGHUP)
        self.running = new


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
