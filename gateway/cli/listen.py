"""``realm listen``: serve the webhook endpoints (gateway/serving/listen.py) and map
what stops it from starting to the CLI's exit codes."""

from __future__ import annotations

import sys

import click

from gateway.cli.common import (
    EXIT_ADDRESS,
    EXIT_CONFIG,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    log_format_option,
    pid_file_option,
    server_options,
)
from gateway.ingest.observe import setup_logging
from gateway.link.embedded import ServerNotFound
from gateway.model.errors import ConfigError
from gateway.serving.pidfile import PidFileError


@click.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    envvar="REALM_HOST",
    help="Address to bind. [env: REALM_HOST]",
)
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    envvar="REALM_PORT",
    help="Port to bind. [env: REALM_PORT]",
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    envvar="REALM_WORKERS",
    help="Worker processes. [env: REALM_WORKERS]",
)
@server_options
@pid_file_option
@log_format_option
def listen(
    config_path: str,
    host: str,
    port: int,
    workers: int,
    redis_url: str | None,
    data_dir: str,
    pid_file: str | None,
    log_format: str,
) -> None:
    """Receive webhooks and turn verified deliveries into runs. SIGHUP (or `realm
    triggers reload`) reloads the config file without a restart."""
    # uvicorn and the app: some 70 ms that every other command need not wait.
    from gateway.serving.listen import CannotBind, read_config, serve

    try:
        # The text too: the listener serves the text checked here, whatever the file
        # holds by the time its workers start.
        text, config = read_config(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    setup_logging(log_format)  # before serve(): every line from here on, workers' too
    try:
        serve(config, text=text, host=host, port=port, workers=workers, redis_url=redis_url,
              data_dir=data_dir, pid_file=pid_file)  # fmt: skip
    except CannotBind as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_ADDRESS)
    except PidFileError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except ConfigError as exc:  # a layout the store's data does not match
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except (ServerNotFound, RuntimeError) as exc:
        click.echo(f"error: cannot start the embedded server: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
