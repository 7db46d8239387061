"""``realm triggers``: check a triggers.yaml, try a delivery against it without writing
anything, and make a running ``realm listen`` reload it."""

from __future__ import annotations

import sys
import urllib.parse
from pathlib import Path

import click
import orjson

from gateway.cli.common import (
    EXIT_CONFIG,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    config_option,
    data_dir_option,
    load_config_or_exit,
    pid_file_option,
    store_options,
    with_store,
)
from gateway.ingest.triggers import describe_event_id
from gateway.model.errors import ConfigError
from gateway.serving.pidfile import NoListener, pid_file_path, signal_listener
from gateway.signatures.spec import describe


@click.group()
def triggers() -> None:
    """Check a triggers.yaml and try deliveries against it."""


@triggers.command("check")
@config_option
def triggers_check(config_path: str) -> None:
    """Validate the file and print its triggers."""
    config = load_config_or_exit(config_path, with_triggers=True)
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
    # The dry run goes through the listener's delivery code, and with it starlette and
    # anyio: some 60 ms that every other command need not wait.
    from gateway.ingest.dryrun import dry_run, format_report

    config = load_config_or_exit(config_path, with_triggers=True)
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
    # Not at the top: that module registers the listener's reload counter, which would
    # then show on the metrics page of `realm work --metrics-port` too.
    from gateway.serving.reload import load_without_secrets

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
