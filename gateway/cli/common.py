"""What every ``realm`` command group shares: exit codes, the options that name the
config and the store, opening the store, and reporting coded errors.

Exit codes: 0 ok, 1 refused (``status: error`` with a code), 2 usage,
3 bad config (``triggers reload``: also a file the listener refused), 4 store
unavailable (``triggers reload``: no listener to signal, or no answer), 5 ``listen``
cannot bind its --host/--port.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import click
import orjson

from gateway.ingest import replies
from gateway.ingest.observe import LOG_FORMAT_ENV, LOG_FORMATS
from gateway.link.connection import (
    DEFAULT_DATA_DIR,
    BadRedisUrl,
    check_redis_url,
    redis_client,
    redis_target,
)
from gateway.link.embedded import ServerNotFound
from gateway.loading import load_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, RealmError, StoreUnavailable
from gateway.store.runstore import RunStore

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
EXIT_UNAVAILABLE = 4
EXIT_ADDRESS = 5

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("realm")
T = TypeVar("T")


config_option = click.option(
    "--config", "config_path", default="triggers.yaml", show_default=True,
    envvar="REALM_CONFIG", type=click.Path(dir_okay=False),
    help="The triggers.yaml to use. [env: REALM_CONFIG]",
)  # fmt: skip


def usage_error(message: str) -> click.ClickException:
    """A bad option or value: ``Error: <message>`` on one line, exit 2 as click's own."""
    error = click.ClickException(message)
    error.exit_code = EXIT_USAGE
    return error


def _checked_redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """One line and exit 2 for a URL redis-py cannot use (it would raise a traceback
    later); the message shows the URL without its password."""
    if value is None:
        return None
    try:
        return check_redis_url(value)
    except BadRedisUrl as exc:
        raise usage_error(f"--redis-url: {exc}") from None


redis_url_option = click.option(
    "--redis-url", envvar="REALM_REDIS_URL", default=None, callback=_checked_redis_url,
    help="redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// URL; without "
    "it, the embedded server. [env: REALM_REDIS_URL]",
)  # fmt: skip
data_dir_option = click.option(
    "--data-dir", envvar="REALM_DATA_DIR", default=DEFAULT_DATA_DIR, show_default=True,
    type=click.Path(file_okay=False),
    help="Data folder of the embedded server. [env: REALM_DATA_DIR]",
)  # fmt: skip
# `realm listen` writes the file and `realm triggers reload` reads it: one option for both.
pid_file_option = click.option(
    "--pid-file", default=None, envvar="REALM_PID_FILE", type=click.Path(dir_okay=False),
    help="Where `realm listen` writes its process id, for `realm triggers reload` "
    "[default: <data-dir>/listen@<host>:<port>.pid]. [env: REALM_PID_FILE]",
)  # fmt: skip

# The long-running commands (`realm listen`, `realm work`) log in one format throughout.
log_format_option = click.option(
    "--log-format", type=click.Choice(LOG_FORMATS), default=LOG_FORMATS[0],
    show_default=True, envvar=LOG_FORMAT_ENV,
    help="Log lines on stderr as JSON objects (with a timestamp) or as plain text. "
    f"[env: {LOG_FORMAT_ENV}]",
)  # fmt: skip


def server_options(func: F) -> F:
    """--config, --redis-url and --data-dir: every command that opens the store."""
    return config_option(redis_url_option(data_dir_option(func)))


def store_options(func: F) -> F:
    """The server options and --json: the run commands."""
    json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
    return server_options(json_option(func))


def with_store(
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    work: Callable[[RunStore], Awaitable[T]],
    *,
    starts: bool = False,
    with_triggers: bool = False,
    logs: bool = False,
) -> T:
    """Load the workflows, open the store (embedded or not), run ``work`` on it.

    Config errors and an unreachable store end the command with a clear
    message and their exit code; coded errors reach the caller. Every command
    checks the workflows' partitions against the store's record; ``starts`` (a
    command that starts runs) also records them the first time, so a command that
    only reads, or a dry run, writes nothing. ``with_triggers``: the triggers too,
    which needs their webhook secrets (a replay of a delivery). ``logs``: the command
    writes log lines (``realm work``), and the store it uses is said in one too.
    """
    config = load_config_or_exit(config_path, with_triggers=with_triggers)
    try:
        with redis_target(redis_url, data_dir) as target:
            if logs:
                log.info("using %s", target.description)
            else:
                click.echo(f"using {target.description}", err=True)

            async def run() -> T:
                client = redis_client(target.url, config.settings.redis_timeout)
                try:
                    store = RunStore(client, config)
                    await store.check_layout(record=starts)
                    return await work(store)
                finally:
                    await client.aclose()

            return asyncio.run(run())
    except ConfigError as exc:  # a layout the store's data does not match
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except (ServerNotFound, RuntimeError) as exc:
        if isinstance(exc, RealmError):
            raise
        click.echo(f"error: cannot start the embedded server: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)


def load_config_or_exit(config_path: str, *, with_triggers: bool) -> Config:
    """The config, or its one-line error and exit code 3. Run commands load only
    the workflows, so they need none of the webhook secrets."""
    try:
        return load_config(config_path, with_triggers=with_triggers)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)


def reports_errors(func: F) -> F:
    """Print coded errors in the reply format (``status: error``, then ``CODE: message``),
    with their exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except RealmError as exc:
            report_error(exc, kwargs.get("as_json", False))

    return wrapper  # type: ignore[return-value]


def report_error(exc: RealmError, as_json: bool, *, batch_id: str | None = None) -> NoReturn:
    """Print a coded error (as JSON with --json) and exit 4 if the store was
    unavailable, else 1. ``batch_id``: the batch whose outcome is unknown."""
    if as_json:
        click.echo(orjson.dumps(replies.error_json(exc, batch_id=batch_id)).decode())
    else:
        click.echo(replies.error_text(exc, batch_id=batch_id))
    sys.exit(EXIT_UNAVAILABLE if isinstance(exc, StoreUnavailable) else EXIT_REFUSED)


def emit(as_json: bool, text: str, data: dict[str, Any]) -> None:
    """Print a reply: ``data`` as one JSON object under --json, else ``text``."""
    click.echo(orjson.dumps(data).decode() if as_json else text)
