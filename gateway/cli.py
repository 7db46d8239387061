"""The ``realm`` command. Parses flags, calls one typed function, prints its reply.

Exit codes: 0 ok, 1 refused (``status: error`` with a code), 2 usage,
3 bad config, 4 store unavailable (``triggers reload``: no listener to signal),
5 ``listen`` cannot bind its --host/--port.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import orjson

from gateway import replies
from gateway.config import Config, load_config
from gateway.connection import (
    DEFAULT_DATA_DIR,
    BadRedisUrl,
    check_redis_url,
    redis_client,
    redis_target,
)
from gateway.embedded import ServerNotFound
from gateway.errors import ConfigError, RealmError, StoreUnavailable
from gateway.paging import list_runs_across
from gateway.runs import LIVE_MATCH, PARAMS_MISMATCH, PHASES, TERMINAL_MATCH, Run, new_run_id
from gateway.store import RunStore

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
EXIT_UNAVAILABLE = 4
EXIT_ADDRESS = 5

F = TypeVar("F", bound=Callable[..., Any])


config_option = click.option(
    "--config", "config_path", default="triggers.yaml", show_default=True,
    envvar="REALM_CONFIG", type=click.Path(dir_okay=False),
    help="The triggers.yaml to use. [env: REALM_CONFIG]",
)  # fmt: skip


def _checked_redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """One line and exit 2 for a URL redis-py cannot use (it would raise a traceback
    later); the message shows the URL without its password."""
    if value is None:
        return None
    try:
        return check_redis_url(value)
    except BadRedisUrl as exc:
        error = click.ClickException(f"--redis-url: {exc}")
        error.exit_code = EXIT_USAGE
        raise error from None


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


def server_options(func: F) -> F:
    """--config, --redis-url and --data-dir: every command that opens the store."""
    return config_option(redis_url_option(data_dir_option(func)))


def store_options(func: F) -> F:
    """The server options and --json: the run commands."""
    json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
    return server_options(json_option(func))


T = TypeVar("T")


def with_store(
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    work: Callable[[RunStore], Awaitable[T]],
    *,
    starts: bool = False,
    with_triggers: bool = False,
) -> T:
    """Load the workflows, open the store (embedded or not), run ``work`` on it.

    Config errors and an unreachable store end the command with a clear
    message and their exit code; coded errors reach the caller. Every command
    checks the workflows' partitions against the store's record; ``starts`` (a
    command that starts runs) also records them the first time, so a command that
    only reads, or a dry run, writes nothing. ``with_triggers``: the triggers too,
    which needs their webhook secrets (a replay of a delivery).
    """
    config = _load_config(config_path, with_triggers=with_triggers)
    try:
        with redis_target(redis_url, data_dir) as target:
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


def _load_config(config_path: str, *, with_triggers: bool) -> Config:
    """The config, or its one-line error and exit code 3. Run commands load only
    the workflows, so they need none of the webhook secrets."""
    try:
        return load_config(config_path, with_triggers=with_triggers)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)


def reports_errors(func: F) -> F:
    """Print coded errors as DESIGN §4 says, with their exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except RealmError as exc:
            _report_error(exc, kwargs.get("as_json", False))

    return wrapper  # type: ignore[return-value]


def _report_error(exc: RealmError, as_json: bool, *, batch_id: str | None = None) -> NoReturn:
    if as_json:
        click.echo(orjson.dumps(replies.error_json(exc, batch_id=batch_id)).decode())
    else:
        click.echo(replies.error_text(exc, batch_id=batch_id))
    sys.exit(EXIT_UNAVAILABLE if isinstance(exc, StoreUnavailable) else EXIT_REFUSED)


def _emit(as_json: bool, text: str, data: dict[str, Any]) -> None:
    click.echo(orjson.dumps(data).decode() if as_json else text)


@click.group()
@click.version_option(package_name="realm-gateway")
def main() -> None:
    """Realm Gateway: verified webhooks become exactly-once workflow runs."""


@main.group()
def run() -> None:
    """Start and manage workflow runs."""


request_id_option = click.option(
    "--request-id", default=None,
    help="Your id for this call: running it again with the same id (after a lost reply "
         "or exit 4) reports what the first call did instead of acting again.",
)  # fmt: skip
params_mismatch_option = click.option(
    "--on-params-mismatch", type=click.Choice(PARAMS_MISMATCH), default="flag",
    show_default=True,
    help="A repeat whose params differ from the key's run: flag it, or reject it.",
)  # fmt: skip


def _read_params(value: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    source = "--params"
    if value.startswith("@"):
        source = value[1:]
        try:
            value = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {source}: {exc.strerror}") from None
    try:
        params = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise click.BadParameter(f"{source} must be a JSON object")
    return params


@run.command("start")
@click.argument("workflow")
@click.option("--params", "params_arg", help="JSON object, or @file.json.")
@click.option("--key", default=None, help="Idempotency key: a repeat with it starts no new run.")
@click.option(
    "--on-live-match",
    type=click.Choice(LIVE_MATCH),
    default="use_existing",
    show_default=True,
    help="What a repeat does while the key's run is live.",
)
@click.option(
    "--on-terminal-match",
    type=click.Choice(TERMINAL_MATCH),
    default="reuse",
    show_default=True,
    help="What a repeat does after the key's run ended.",
)
@params_mismatch_option
@request_id_option
@store_options
@reports_errors
def run_start(
    workflow: str,
    params_arg: str | None,
    key: str | None,
    on_live_match: Any,
    on_terminal_match: Any,
    on_params_mismatch: Any,
    request_id: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Start a run of WORKFLOW, or return the run its key already has."""
    params = _read_params(params_arg)
    result = with_store(
        config_path, redis_url, data_dir,
        lambda store: store.start_run(workflow, params, key, on_live_match, on_terminal_match,
                                      on_params_mismatch, request_id=request_id),
        starts=True,
    )  # fmt: skip
    _emit(as_json, replies.start_text(result), replies.start_json(result))


@run.command("show")
@click.argument("run_id")
@store_options
@reports_errors
def run_show(
    run_id: str, config_path: str, redis_url: str | None, data_dir: str, as_json: bool
) -> None:
    """Print a run's fields."""
    found = with_store(config_path, redis_url, data_dir, lambda store: store.get_run(run_id))
    _emit(as_json, replies.run_text(found), found.as_dict())


@run.command("list")
@click.option("--workflow", default=None, help="Only this workflow (default: every workflow).")
@click.option("--key", default=None, help="Only runs of this idempotency key (needs --workflow).")
@click.option("--phase", type=click.Choice(PHASES), default=None)
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--cursor", default=None, help="Where the previous page stopped, as it printed.")
@store_options
@reports_errors
def run_list(
    workflow: str | None,
    key: str | None,
    phase: str | None,
    limit: int,
    cursor: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """List runs, newest first, a page at a time."""
    if key and not workflow:
        raise click.UsageError("--key needs --workflow: a key belongs to one workflow")

    async def work(store: RunStore) -> tuple[list[Run], str | None]:
        # An unknown --workflow is NOT_FOUND_WORKFLOW before any cursor is read.
        names = (
            [store.config.workflow(workflow).name] if workflow else sorted(store.config.workflows)
        )
        return await list_runs_across(
            store, names, key=key, phase=phase, limit=limit, cursor=cursor
        )

    runs, next_cursor = with_store(config_path, redis_url, data_dir, work)
    if as_json:
        page = {"runs": [r.as_dict() for r in runs], "cursor": next_cursor}
        click.echo(orjson.dumps(page).decode())
        return
    if runs:
        click.echo(replies.RUN_LINE_HEADER)
    else:
        click.echo("no runs")
    for r in runs:
        click.echo(replies.run_line(r))
    if next_cursor is not None:
        click.echo(f"More runs exist: pass --cursor {next_cursor} for the next page.")


@run.command("cancel")
@click.argument("run_id", required=False)
@click.option("--workflow", default=None, help="With --key: cancel the key's live run.")
@click.option("--key", default=None)
@request_id_option
@store_options
@reports_errors
def run_cancel(
    run_id: str | None,
    workflow: str | None,
    key: str | None,
    request_id: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Cancel RUN_ID, or the live run of --workflow W --key K. Ended runs stay as they are."""
    if bool(run_id) == bool(workflow and key) or (workflow is None) != (key is None):
        raise click.UsageError("give either RUN_ID or both --workflow and --key")
    if run_id:
        count = with_store(
            config_path, redis_url, data_dir,
            lambda store: store.cancel_run(run_id, op_id=request_id),
        )  # fmt: skip
    else:
        assert workflow and key
        count = with_store(
            config_path, redis_url, data_dir,
            lambda store: store.cancel_key(workflow, key, op_id=request_id),
        )  # fmt: skip
    _emit(as_json, f"status: ok\ncancelled: {count}", {"status": "ok", "cancelled": count})


@run.command("complete")
@click.argument("run_id")
@click.option("--step", required=True, help="The step that finished (must be the current one).")
@request_id_option
@store_options
@reports_errors
def run_complete(
    run_id: str,
    step: str,
    request_id: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Record that RUN_ID's current step finished; queue the next step."""
    result = with_store(
        config_path, redis_url, data_dir,
        lambda store: store.complete_step(run_id, step, op_id=request_id),
    )  # fmt: skip
    data = {
        "status": "ok",
        "run_id": run_id,
        "phase": result.phase,
        "next_step": result.next_step,
        "message": replies.step_sentence(step, result),
    }
    _emit(as_json, replies.step_text(step, result), data)


@run.command("fail")
@click.argument("run_id")
@click.option("--error", "error_text", default="", help="Why it failed (stored with the run).")
@request_id_option
@store_options
@reports_errors
def run_fail(
    run_id: str,
    error_text: str,
    request_id: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """End a live run as failed."""
    found = with_store(
        config_path, redis_url, data_dir,
        lambda store: store.fail_run(run_id, error_text, op_id=request_id),
    )  # fmt: skip
    _emit(as_json, replies.fail_text(found), {"status": "ok", "run_id": run_id,
                                              "phase": found.phase,
                                              "message": f"Run '{run_id}' failed."})  # fmt: skip


pid_file_option = click.option(
    "--pid-file", default=None, envvar="REALM_PID_FILE", type=click.Path(dir_okay=False),
    help="Where `realm listen` writes its process id, for `realm triggers reload` "
    "[default: <data-dir>/listen.pid]. [env: REALM_PID_FILE]",
)  # fmt: skip


@main.command()
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
def listen(
    config_path: str,
    host: str,
    port: int,
    workers: int,
    redis_url: str | None,
    data_dir: str,
    pid_file: str | None,
) -> None:
    """Receive webhooks and turn verified deliveries into runs. SIGHUP (or `realm
    triggers reload`) reloads the config file without a restart."""
    from gateway.listen import CannotBind, serve
    from gateway.pidfile import PidFileError

    config = _load_config(config_path, with_triggers=True)
    try:
        serve(config, host=host, port=port, workers=workers, redis_url=redis_url,
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


@main.command("mcp")
@server_options
def mcp(config_path: str, redis_url: str | None, data_dir: str) -> None:
    """Serve the run tools to an MCP client over stdio."""
    import signal

    from gateway.mcp_server import serve_stdio

    config = _load_config(config_path, with_triggers=False)
    # A client may end the server with SIGTERM rather than by closing stdin: leave
    # through the `with` below, so the embedded server is released in order (and
    # stopped if this was its last user) instead of left for the next user to adopt.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with redis_target(redis_url, data_dir) as target:
            click.echo(f"using {target.description}", err=True)  # stdout is the protocol
            serve_stdio(config, target.url)
    except (ServerNotFound, RuntimeError) as exc:
        click.echo(f"error: cannot start the embedded server: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)


@main.group()
def triggers() -> None:
    """Check a triggers.yaml and try deliveries against it."""


@triggers.command("check")
@config_option
def triggers_check(config_path: str) -> None:
    """Validate the file and print its triggers."""
    from gateway.triggers import describe_event_id
    from gateway.verify import describe

    config = _load_config(config_path, with_triggers=True)
    rows = [("TRIGGER", "PATH", "WORKFLOW", "VERIFY", "EVENT ID", "ON LIVE", "ON TERMINAL")]
    for t in config.triggers.values():
        rows.append((t.name, t.path, t.workflow, describe(t.verify), describe_event_id(t),
                     t.on_live_match, t.on_terminal_match))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    click.echo(
        f"{config.file}: ok: {len(config.workflows)} workflow(s), {len(config.triggers)} trigger(s)"
    )


@triggers.command("test")
@click.option("--path", "route", required=True, help="The path the delivery is sent to.")
@click.option(
    "--body",
    "body_file",
    required=True,
    type=click.Path(dir_okay=False, exists=True),
    help="File holding the raw body, sent byte for byte.",
)
@click.option(
    "--header",
    "header_args",
    multiple=True,
    metavar="'Name: value'",
    help="A request header; repeat for more.",
)
@click.option(
    "--sign",
    is_flag=True,
    help="Sign the body with each trigger's configured secret, as its sender would.",
)
@store_options
def triggers_test(
    route: str,
    body_file: str,
    header_args: tuple[str, ...],
    sign: bool,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Dry run: which triggers match, what they extract, what a claim would decide.

    Nothing is written to the store.
    """
    from gateway.dryrun import dry_run, format_report

    config = _load_config(config_path, with_triggers=True)
    body = Path(body_file).read_bytes()
    headers: list[tuple[str, str]] = []
    for arg in header_args:
        name, sep, value = arg.partition(":")
        if not sep or not name.strip():
            raise click.BadParameter(f"{arg!r} is not 'Name: value'", param_hint="--header")
        headers.append((name.strip(), value.strip()))
    # Routes match the decoded path, as a request's is: '/a%2Db' is '/a-b'.
    route = urllib.parse.unquote(route)
    matching = [t for t in config.triggers.values() if t.path == route]
    if not matching:
        paths = ", ".join(sorted({t.path for t in config.triggers.values()})) or "none"
        click.echo(f"error: no trigger has path {route} (paths: {paths})", err=True)
        sys.exit(EXIT_USAGE)
    report = with_store(
        config_path, redis_url, data_dir,
        lambda store: dry_run(store, matching, headers, body, sign=sign),
    )  # fmt: skip
    if as_json:
        click.echo(orjson.dumps(report).decode())
    else:
        click.echo(format_report(report))


@triggers.command("reload")
@config_option
@data_dir_option
@pid_file_option
def triggers_reload(config_path: str, data_dir: str, pid_file: str | None) -> None:
    """Make a running `realm listen` reload its config file (sends it SIGHUP).

    The file is checked first: a broken one is refused here and the listener left
    alone. The secrets are the listener's to check, in its own environment; its log
    says whether it applied the file, and /readyz shows its config_version."""
    from gateway.pidfile import NoListener, pid_file_path, signal_listener
    from gateway.reload import load_without_secrets

    try:
        config = load_without_secrets(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}; the listener was not signalled", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        pid = signal_listener(pid_file_path(pid_file, data_dir))
    except NoListener as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
    click.echo(f"{config.file}: ok (version {config.version})")
    click.echo(
        f"sent SIGHUP to realm listen (pid {pid}): it reloads its config file; its log "
        "says whether it applied it, and /readyz shows its config_version"
    )


@run.command("batch")
@click.argument("workflow")
@click.option(
    "--items",
    "items_file",
    required=True,
    type=click.Path(dir_okay=False),
    help='JSON list of {"params": {...}, "idempotency_key": "..."}.',
)
@click.option(
    "--on-live-match", type=click.Choice(LIVE_MATCH), default="use_existing", show_default=True
)
@click.option(
    "--on-terminal-match", type=click.Choice(TERMINAL_MATCH), default="reuse", show_default=True
)
@params_mismatch_option
@click.option(
    "--batch-id", default=None,
    help="Your id for this batch (one is made and printed when absent): running the same "
         "batch again with it (after a lost reply or exit 4) starts nothing twice.",
)  # fmt: skip
@store_options
@reports_errors
def run_batch(
    workflow: str,
    items_file: str,
    on_live_match: Any,
    on_terminal_match: Any,
    on_params_mismatch: Any,
    batch_id: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Start several runs of WORKFLOW in one call; one line per item."""
    try:
        items = orjson.loads(Path(items_file).read_bytes())
    except OSError as exc:
        raise click.BadParameter(f"cannot read {items_file}: {exc.strerror}") from None
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"{items_file} is not valid JSON: {exc}") from None
    if not isinstance(items, list):
        raise click.BadParameter(f"{items_file} must hold a JSON list of items")
    given = new_run_id() if batch_id is None else batch_id
    try:
        entries = with_store(
            config_path, redis_url, data_dir,
            lambda store: store.start_run_batch(workflow, items, on_live_match,
                                                on_terminal_match, on_params_mismatch,
                                                batch_id=given),
            starts=True,
        )  # fmt: skip
    except StoreUnavailable as exc:
        # The outcome is unknown: name the batch, for the retry.
        _report_error(exc, as_json, batch_id=given)
    if as_json:
        reply = {"status": "ok", "batch_id": given, "items": replies.batch_json(entries)}
        click.echo(orjson.dumps(reply).decode())
        return
    click.echo(replies.batch_reply_text(given, entries))


@run.command("reconcile")
@click.option("--dry-run", is_flag=True, help="Report only; write nothing.")
@click.option("--workflow", default=None, help="Only this workflow (default: every workflow).")
@click.option(
    "--scan", is_flag=True,
    help="Find the keys by a SCAN of the whole keyspace, not the key index, and index them "
    "(once after upgrading from a gateway without the key index).",
)  # fmt: skip
@store_options
@reports_errors
def run_reconcile(
    dry_run: bool,
    workflow: str | None,
    scan: bool,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Check that every key points at the newest run of its group; repair it unless --dry-run."""
    from gateway.reconcile import count_runs, reconcile

    async def work(store: RunStore) -> Any:
        if not sys.stderr.isatty():
            step = 100_000
            shown = [0]

            def plain(groups: int, runs: int) -> None:
                if groups - shown[0] >= step:
                    shown[0] = groups
                    click.echo(f"reconcile: {groups} key group(s), {runs} run(s) checked",
                               err=True)  # fmt: skip

            return await reconcile(store, workflow=workflow, dry_run=dry_run, progress=plain,
                                   scan=scan)  # fmt: skip
        total = await count_runs(store, workflow)
        with click.progressbar(length=total, label="reconcile", file=sys.stderr,
                               show_pos=True) as bar:  # fmt: skip
            done = [0]

            def tick(groups: int, runs: int) -> None:
                bar.update(runs - done[0])
                done[0] = runs

            return await reconcile(store, workflow=workflow, dry_run=dry_run, progress=tick,
                                   scan=scan)  # fmt: skip

    report = with_store(config_path, redis_url, data_dir, work)
    _emit(as_json, report.text(), {"status": "ok", **report.as_dict()})


@main.command("work")
@click.argument("workflows", nargs=-1)
@click.option(
    "--concurrency", type=click.IntRange(1, 1000), default=4, show_default=True,
    help="Steps handled at once.",
)  # fmt: skip
@click.option(
    "--grace", type=click.FloatRange(0, 3600), default=30.0, show_default=True,
    help="Seconds a stop waits for the steps in hand before leaving them to their leases.",
)  # fmt: skip
@click.option("--drain", is_flag=True, help="Exit once no step is ready and none is in hand.")
@click.option(
    "--metrics-port", type=click.IntRange(1, 65535), default=None,
    help="Serve this runner's metrics on http://127.0.0.1:PORT/metrics.",
)  # fmt: skip
@server_options
@reports_errors
def work(
    workflows: tuple[str, ...],
    concurrency: int,
    grace: float,
    drain: bool,
    metrics_port: int | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
) -> None:
    """Run the step handlers of triggers.yaml (`handlers:`) on ready steps of WORKFLOW
    (default: every workflow with handlers). SIGTERM or Ctrl-C stops taking steps and
    finishes the ones in hand; a second one abandons them to their leases."""
    import signal

    from gateway.handlers import build_handlers, parse_handlers
    from gateway.observe import setup_logging
    from gateway.runner import Runner

    config = _load_config(config_path, with_triggers=False)
    names = list(workflows) or [w.name for w in config.workflows.values() if w.handlers]
    if not names:
        click.echo(f"error: {config.file}: no workflow has handlers: to run", err=True)
        sys.exit(EXIT_CONFIG)
    specs = {}
    try:
        for name in names:
            wf = config.workflow(name)
            if not wf.handlers:
                raise ConfigError(config.file, "has no handlers: nothing to run its steps",
                                  section="workflow", name=name, field="handlers")  # fmt: skip
            specs[name] = parse_handlers(wf.handlers, file=config.file, workflow=name,
                                         steps=wf.steps)  # fmt: skip
            missing = [s for s in wf.steps if s not in specs[name]]
            if missing:
                raise ConfigError(config.file, f"no handler for step(s) {', '.join(missing)}",
                                  section="workflow", name=name, field="handlers")  # fmt: skip
        handler_set = build_handlers(specs, file=config.file)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    setup_logging()
    if metrics_port is not None:
        from gateway.metrics import serve_runner_metrics

        serve_runner_metrics(metrics_port)

    async def serve(store: RunStore) -> None:
        runner = Runner(store, names, handler_set.handlers, concurrency=concurrency,
                        grace=grace)  # fmt: skip
        signals = [0]

        def on_signal() -> None:
            signals[0] += 1
            if signals[0] == 1:
                click.echo("work: stopping: finishing the steps in hand", err=True)
                runner.stop()
            else:
                runner.abandon()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        click.echo(f"work: {runner.runner_id} taking steps of {', '.join(names)} "
                   f"(concurrency {concurrency})", err=True)  # fmt: skip
        try:
            await runner.run(until_idle=drain)
        finally:
            await handler_set.aclose()
        counts = ", ".join(f"{n} {k}" for k, n in runner.counts.items())
        click.echo(f"work: stopped ({counts})", err=True)

    with_store(config_path, redis_url, data_dir, serve)


# Last: that module builds its commands from this one's helpers.
from gateway.cli_deliveries import deliveries  # noqa: E402

main.add_command(deliveries)
