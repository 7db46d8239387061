"""``realm listen``: checks the config, picks the Redis, then serves the app with uvicorn."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from pathlib import Path

import click
import uvicorn

from gateway.config import Config
from gateway.connection import redis_target
from gateway.observe import setup_logging
from gateway.triggers import describe_event_id
from gateway.verify import describe

# How long SIGTERM waits for in-flight deliveries before closing connections.
GRACEFUL_SHUTDOWN_SECONDS = 30


def serve(
    config: Config,
    *,
    host: str,
    port: int,
    workers: int,
    redis_url: str | None,
    data_dir: str,
) -> None:
    """Serve until SIGTERM or Ctrl-C; an embedded server started here stops afterwards."""
    setup_logging()
    with (
        redis_target(redis_url, data_dir) as target,
        tempfile.TemporaryDirectory(prefix="realm-metrics-") as metrics_dir,
    ):
        echo = lambda text: click.echo(text, err=True)  # noqa: E731
        echo(f"realm listen: http://{host}:{port} ({workers} worker{'s' * (workers > 1)})")
        echo(f"store: {target.description}")
        for trigger in config.triggers.values():
            if trigger.verify.scheme == "none":
                logging.getLogger("realm").warning(
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
            access_log=False,  # the app logs one JSON line per delivery instead
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            server_header=False,
            # Client addresses are never used, so skip uvicorn's X-Forwarded-For
            # rewriting on every request.
            proxy_headers=False,
        )
