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
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    config_option,
    data_dir_option,
    load_config_or_exit,
    pid_file_option,
    reports_errors,
    store_options,
    with_store,
)
from gateway.ingest.github_hooks import shared_delivery_warnings
from gateway.ingest.triggers import describe_event_id
from gateway.loading import load_config, load_config_without_secrets, secret_variables
from gateway.model.errors import ConfigError
from gateway.model.words import noun, plural
from gateway.serving.pidfile import (
    NoListener,
    SeveralListeners,
    answer_path,
    find_pid_file,
    is_running,
    last_generation,
    listener_pid,
    signal_listener,
    wait_for_answer,
)
from gateway.signatures.spec import describe

# How long `realm triggers reload` waits for the listener's answer, by default: a
# reload takes a read of the file, a check against Redis (at most settings.redis_timeout
# per command), and with several workers the wait for any still starting.
RELOAD_TIMEOUT = 30.0


@click.group()
def triggers() -> None:
    """Check a triggers.yaml and try deliveries against it."""


@triggers.command("check")
@config_option
@click.option(
    "--no-secrets",
    is_flag=True,
    help="Check everything but the secrets: their variables need not be set (for CI).",
)
def triggers_check(config_path: str, no_secrets: bool) -> None:
    """Validate the file and print its triggers."""
    try:
        config = (
            load_config_without_secrets(config_path) if no_secrets else load_config(config_path)
        )
    except ConfigError as exc:
        # A CI job that lints the file has no production secrets: say how it can.
        hint = ""
        if not no_secrets and _only_secrets_missing(config_path):
            hint = "; --no-secrets checks all but the secrets"
        click.echo(f"error: {exc}{hint}", err=True)
        sys.exit(EXIT_CONFIG)
    rows = [("TRIGGER", "PATH", "WORKFLOW", "VERIFY", "EVENT ID", "ON LIVE", "ON TERMINAL")]
    for t in config.triggers.values():
        rows.append((t.name, t.path, t.workflow, describe(t.verify), describe_event_id(t),
                     t.on_live_match, t.on_terminal_match))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    workflows = plural(len(config.workflows), "workflow")
    click.echo(f"{config.file}: ok: {workflows}, {plural(len(config.triggers), 'trigger')}")
    # A file that loads but would fold two hooks' copies of one event into one run:
    # said, not refused (the exit code stays 0), as realm listen says it at start-up.
    for warning in shared_delivery_warnings(config.triggers.values()):
        click.echo(f"warning: {config.file}: {warning}", err=True)
    variables = secret_variables(config)
    if no_secrets and variables:
        # What only the environment it runs in can tell: said, so that a green check
        # in CI is not read as "the secrets are in place".
        these = noun(len(variables), "this variable is", "these variables are")
        click.echo(f"not checked (--no-secrets): that {these} set where the triggers are served:")
        for name, users in variables.items():
            click.echo(f"  {name} ({noun(len(users), 'trigger')} {', '.join(users)})")


def _only_secrets_missing(config_path: str) -> bool:
    """Whether the file passes every check but the secrets' (its refusal was about
    their variables: unset, empty, or not in the format a scheme needs)."""
    try:
        load_config_without_secrets(config_path)
    except ConfigError:
        return False
    return True


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
@reports_errors  # an unreachable store: its coded error and exit 4, not a traceback
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

    Nothing is written to the store. Exits 1 when the listener would answer a 4xx
    (a signature that fails, params that fail their schema), 4 when Redis did not
    answer.
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
    status = report["status"]
    click.echo(f"the listener would answer {status}", err=True)
    # A script or CI job checking a sample delivery learns of a refusal by the exit code.
    if status >= 500:
        sys.exit(EXIT_UNAVAILABLE)
    if status >= 400:
        sys.exit(EXIT_REFUSED)


@triggers.command("reload")
@config_option
@data_dir_option
@pid_file_option
@click.option(
    "--port", type=click.IntRange(0, 65535), default=None, envvar="REALM_PORT",
    help="The --port of the listener to reload, when several keep their pid files in the "
    "data folder. [env: REALM_PORT]",
)  # fmt: skip
@click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=RELOAD_TIMEOUT,
    show_default=True, help="Seconds to wait for the listener's answer.",
)  # fmt: skip
def triggers_reload(
    config_path: str, data_dir: str, pid_file: str | None, port: int | None, timeout: float
) -> None:
    """Make a running `realm listen` reload its config file, and say what it did.

    The file is checked first: a broken one is refused here and the listener left
    alone (the secrets are the listener's to check, in its own environment). Then the
    listener is sent SIGHUP and its answer awaited: exit 0 once it serves the file, 3
    if it refused it (the reason is printed), 4 if there is no listener to signal or
    it did not answer in time."""
    try:
        config = load_config_without_secrets(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}; the listener was not signalled", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        path = find_pid_file(pid_file, data_dir, port)
        pid = listener_pid(path)
        answers = answer_path(path)
        before = last_generation(answers, pid)  # the answer to wait for comes after it
        signal_listener(pid)
    except SeveralListeners as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except NoListener as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
    click.echo(f"{config.file}: ok (version {config.version})")
    answer = wait_for_answer(
        answers, pid, after=before, file_version=config.version, timeout=timeout
    )
    if answer is None:
        if is_running(pid):
            click.echo(f"error: sent SIGHUP to realm listen (pid {pid}), which did not answer "
                       f"within {timeout:g} s; its log says whether it applied the file",
                       err=True)  # fmt: skip
        else:
            click.echo(f"error: realm listen (pid {pid}) stopped before it answered", err=True)
        sys.exit(EXIT_UNAVAILABLE)
    if not answer.applied:
        click.echo(f"error: realm listen (pid {pid}) refused the file: {answer.error}; it "
                   f"still serves version {answer.version}", err=True)  # fmt: skip
        sys.exit(EXIT_CONFIG)
    click.echo(f"realm listen (pid {pid}) applied it: it serves version {answer.version}")
