"""``realm recover github | stripe``: deliveries that never reached the gateway, found
through the senders' APIs and brought here (gateway/recover/).

The recovery modules (and httpx with them) are imported by the commands themselves:
every ``realm`` command loads this module.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click
import orjson

from gateway.cli.common import (
    EXIT_CONFIG,
    EXIT_REFUSED,
    EXIT_USAGE,
    reports_errors,
    server_options,
    usage_error,
    with_store,
)
from gateway.deliveries.text import parse_since
from gateway.model.errors import ConfigError, RealmError

if TYPE_CHECKING:
    from gateway.model.config import Config
    from gateway.recover.check import Route
    from gateway.recover.summary import Summary
    from gateway.store.runstore import RunStore

F = TypeVar("F", bound=Callable[..., Any])

SINCE_DEFAULT = "2h"
_REPO = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+")
_TOKEN = re.compile(r"[\x21-\x7e]+")
_ORG = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")


def _checked_since(ctx: click.Context, param: click.Parameter, value: str) -> datetime:
    try:
        ms = parse_since(value, int(time.time() * 1000))
    except RealmError as exc:
        raise usage_error(f"--{exc.message}") from None
    return datetime.fromtimestamp(ms / 1000, UTC)


def _checked_api_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from gateway.recover.http import check_api_url

    try:
        return check_api_url(value)
    except ValueError as exc:
        raise usage_error(f"--api-url {exc}") from None


def recover_options(func: F) -> F:
    """What both commands take: --path, --since, --dry-run, --include-delivered, --json
    and the server options."""
    for option in reversed([
        click.option(
            "--path", default=None,
            help="The trigger path whose triggers decide what is missing [default: the one "
            "path with triggers of the sender's verify scheme].",
        ),
        click.option(
            "--since", default=SINCE_DEFAULT, show_default=True, callback=_checked_since,
            help="How far back to look: a duration like 30m, 2h or 3d, or an ISO 8601 time.",
        ),
        click.option(
            "--dry-run", is_flag=True, help="Print what would be done; change nothing."
        ),
        click.option(
            "--include-delivered", is_flag=True,
            help="Also check what the sender counts as delivered (after a gateway node "
            "was lost with its spool).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON summary."),
    ]):  # fmt: skip
        func = option(func)
    return server_options(func)


def _token(name: str, command: str) -> str:
    """The token in ``name``, or one line naming what is wrong with it (never its value)
    and exit 2."""
    token = os.environ.get(name, "").strip()
    if not token:
        problem = "is not set"
    elif not _TOKEN.fullmatch(token):
        # It goes in a header: a character that cannot is a paste gone wrong.
        problem = "holds a character no token has (a space, a line break, non-ASCII)"
    else:
        return token
    click.echo(
        f"error: {name} {problem}: `realm recover {command}` needs it to call the "
        "sender's API (see docs/recover.md for what it must allow)",
        err=True,
    )
    sys.exit(EXIT_USAGE)


def _route(config_path: str, scheme: str, path: str | None) -> tuple[Config, Route]:
    """The config (its triggers with placeholder secrets: no signature is checked, so
    none of the webhook secrets is needed) and the path whose triggers decide."""
    from gateway.loading import load_config_without_secrets
    from gateway.recover.check import PathError, pick_route

    try:
        config = load_config_without_secrets(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        return config, pick_route(config, scheme, path)
    except PathError as exc:
        raise usage_error(f"--path: {exc}") from None


def _finish(summary: Summary, records: str, as_json: bool) -> None:
    """The summary (after the item lines), and exit 1 when anything failed."""
    if summary.error is not None:
        click.echo(f"error: {summary.error}", err=True)
    if as_json:
        click.echo(orjson.dumps(summary.as_json()).decode())
    else:
        click.echo(summary.line(records))
    if summary.failed:
        sys.exit(EXIT_REFUSED)


def _run(
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    config: Config,
    work: Callable[[RunStore], Awaitable[Summary]],
    *,
    starts: bool,
) -> Summary:
    """``work`` on the store, bound to ``config`` (the one with the triggers).
    ``starts``: the command may start runs (so the workflows' layout is recorded)."""

    async def bound(store: RunStore) -> Summary:
        return await work(store.with_config(config))

    return with_store(config_path, redis_url, data_dir, bound, starts=starts)


def _shown(as_json: bool, dry_run: bool) -> Callable[[Any], None]:
    from gateway.recover.summary import SHOWN, item_line

    def show(item: Any) -> None:
        if not as_json and item.outcome in SHOWN:
            click.echo(item_line(item, dry_run))

    return show


@click.group("recover")
def recover() -> None:
    """Deliveries that never reached the gateway, recovered from the senders' APIs."""


@recover.command("github")
@click.option("--repo", default=None, metavar="OWNER/REPO", help="A repository's webhook.")
@click.option("--org", default=None, metavar="ORG", help="An organisation's webhook.")
@click.option(
    "--app", is_flag=True,
    help="The GitHub App's webhook: GITHUB_TOKEN must hold the app's JWT.",
)  # fmt: skip
@click.option(
    "--hook", "hook_id", type=click.IntRange(min=1), default=None, metavar="ID",
    help="The webhook's id (with --repo or --org).",
)  # fmt: skip
@click.option(
    "--api-url", default="https://api.github.com", show_default=True,
    callback=_checked_api_url,
    help="GitHub's REST API; GitHub Enterprise Server: https://HOST/api/v3.",
)  # fmt: skip
@click.option(
    "--rate", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
    help="Redeliveries asked for per second, at most.",
)  # fmt: skip
@recover_options
@reports_errors
def recover_github(
    repo: str | None,
    org: str | None,
    app: bool,
    hook_id: int | None,
    api_url: str,
    rate: float,
    path: str | None,
    since: datetime,
    dry_run: bool,
    include_delivered: bool,
    as_json: bool,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
) -> None:
    """Redeliver a GitHub webhook's failed deliveries that never reached the gateway.

    Lists the hook's deliveries since --since (GitHub keeps them for a few days). An
    event with no successful attempt is walked through the triggers of --path as a
    dry run; when a claim would start a run, the event never arrived here, and GitHub
    is asked to redeliver it (it then arrives signed, like any delivery). A redelivery
    asked for in the last 10 minutes is left to finish. Safe to run on a schedule.

    The token is read from GITHUB_TOKEN: a token that may read and write the hook
    (scope admin:repo_hook, or "Webhooks" read and write; an organisation's hook:
    admin:org_hook); with --app, the app's JWT. No webhook secret is needed.

    Exit codes: 0 nothing failed, 1 something failed (or GitHub refused the token or
    did not know the hook), 2 usage (no GITHUB_TOKEN), 3 bad config, 4 store
    unavailable.
    """
    from gateway.recover import github
    from gateway.recover.http import Api

    hook = _hook(repo, org, app, hook_id)
    token = _token("GITHUB_TOKEN", "github")
    config, route = _route(config_path, github.SCHEME, path)

    async def work(store: RunStore) -> Summary:
        async with Api("GitHub", api_url, token, headers=github.HEADERS, rate=rate) as api:
            return await github.recover(
                api, store, hook, route, since, dry_run=dry_run,
                include_delivered=include_delivered, shown=_shown(as_json, dry_run),
            )  # fmt: skip

    summary = _run(config_path, redis_url, data_dir, config, work, starts=False)
    _finish(summary, "delivery", as_json)


def _hook(repo: str | None, org: str | None, app: bool, hook_id: int | None) -> Any:
    from gateway.recover.github import Hook

    chosen = [name for name, given in (("--repo", repo), ("--org", org), ("--app", app)) if given]
    if len(chosen) != 1:
        problem = "none was given" if not chosen else f"got {' and '.join(chosen)}"
        raise usage_error(f"give one of --repo OWNER/REPO, --org ORG or --app ({problem})")
    if app:
        if hook_id is not None:
            raise usage_error("--hook: a GitHub App has one webhook; leave --hook out with --app")
        return Hook("app")
    if hook_id is None:
        raise usage_error(f"--hook: the webhook's id is required with {chosen[0]}")
    if repo is not None and not _REPO.fullmatch(repo):
        raise usage_error(f"--repo must be OWNER/REPO (got {repo!r})")
    if org is not None and not _ORG.fullmatch(org):
        raise usage_error(f"--org must be an organisation's login (got {org!r})")
    return Hook("repo" if repo else "org", repo or org, hook_id)


@recover.command("stripe")
@click.option(
    "--api-url", default="https://api.stripe.com", show_default=True,
    callback=_checked_api_url, help="Stripe's API.",
)  # fmt: skip
@recover_options
@reports_errors
def recover_stripe(
    api_url: str,
    path: str | None,
    since: datetime,
    dry_run: bool,
    include_delivered: bool,
    as_json: bool,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
) -> None:
    """Claim the Stripe events whose delivery failed and that never reached the gateway.

    Lists the events created since --since whose delivery has not succeeded. Each is
    walked through the triggers of --path as the delivery it would have been (the
    event as the JSON body); one whose claim would start a run is claimed here. It
    comes from Stripe's API under the secret key, so it is trusted: no webhook
    secret is needed. Safe to run on a schedule.

    The key is read from STRIPE_API_KEY (a secret key, or a restricted key with read
    access to Events).

    Exit codes: 0 nothing failed, 1 something failed (or Stripe refused the key), 2
    usage (no STRIPE_API_KEY), 3 bad config, 4 store unavailable.
    """
    from gateway.recover import stripe
    from gateway.recover.http import Api

    token = _token("STRIPE_API_KEY", "stripe")
    config, route = _route(config_path, stripe.SCHEME, path)
    epoch = int(since.timestamp())

    async def work(store: RunStore) -> Summary:
        async with Api("Stripe", api_url, token) as api:
            return await stripe.recover(
                api, store, route, epoch, dry_run=dry_run,
                include_delivered=include_delivered, shown=_shown(as_json, dry_run),
            )  # fmt: skip

    summary = _run(config_path, redis_url, data_dir, config, work, starts=not dry_run)
    _finish(summary, "event", as_json)
