"""``realm deliveries``: list, show and replay the delivery log (gateway/deliveries/log.py).

The log's module (and the triggers and metrics it imports) is imported by the commands
themselves: every ``realm`` command loads this module, and they would add 60 ms to each
one's start.
"""

from __future__ import annotations

import time
from typing import Any

import click
import orjson

from gateway.cli.common import reports_errors, store_options, usage_error, with_store
from gateway.deliveries.text import (
    SINCE_HELP,
    check_cursor,
    list_lines,
    parse_since,
    record_text,
    replay_text,
)
from gateway.ingest.served import Serving
from gateway.model.errors import RealmError
from gateway.store.runstore import RunStore


@click.group("deliveries")
def deliveries() -> None:
    """The delivery log: what `realm listen` answered, and replays of it."""


def _checked_filter(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    from gateway.deliveries.log import DeliveryFilter

    if value is None:
        return None
    try:
        if param.name == "since_ms":
            return parse_since(value, int(time.time() * 1000))
        DeliveryFilter(**{str(param.name): value}).check()
    except RealmError as exc:
        # The filter's messages start with the field's name ("since must be ..."): as
        # an option it is "--since must be ...".
        raise usage_error(f"--{exc.message}") from None
    return value


@deliveries.command("list")
@click.option(
    "--path", default=None, callback=_checked_filter, help="Only deliveries to this path."
)
@click.option(
    "--status", default=None, callback=_checked_filter,
    help="Only deliveries answered with this status (202) or class (4xx).",
)  # fmt: skip
@click.option(
    "--outcome", default=None, callback=_checked_filter,
    help="Only deliveries where at least one trigger had this outcome: started, queued, "
         "scheduled, deduplicated, refused, stale, rate_limited, handshake, ignored, unverified "
         "or accepted (spooled, not yet claimed).",
)  # fmt: skip
@click.option(
    "--since", "since_ms", default=None, callback=_checked_filter,
    help=f"Only deliveries received since then: {SINCE_HELP}.",
)  # fmt: skip
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--cursor", default=None, help="Where the previous page stopped, as it printed.")
@store_options
@reports_errors
def deliveries_list(
    path: str | None,
    status: str | None,
    outcome: str | None,
    since_ms: int | None,
    limit: int,
    cursor: str | None,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """List deliveries, newest first, a page at a time. Under a filter a page may be
    short (even empty) and still have a cursor: the next page looks further back."""
    from gateway.deliveries import log

    where = log.DeliveryFilter(path=path, status=status, outcome=outcome, since_ms=since_ms)
    check_cursor(cursor)

    async def work(store: RunStore) -> tuple[list[dict[str, Any]], str | None]:
        return await log.list_deliveries(store, where, limit=limit, cursor=cursor)

    summaries, next_cursor = with_store(config_path, redis_url, data_dir, work)
    if as_json:
        click.echo(orjson.dumps({"deliveries": summaries, "cursor": next_cursor}).decode())
        return
    for line in list_lines(summaries) or ["no deliveries"]:
        click.echo(line)
    if next_cursor is not None:
        click.echo(f"More deliveries may follow: pass --cursor {next_cursor} for the next page.")


@deliveries.command("show")
@click.argument("delivery_id")
@store_options
@reports_errors
def deliveries_show(
    delivery_id: str, config_path: str, redis_url: str | None, data_dir: str, as_json: bool
) -> None:
    """Print one delivery: its status, each trigger's outcome and why, the headers as
    kept (never a signature or token) and the body, pretty-printed when it is JSON."""
    from gateway.deliveries import log

    log.check_delivery_id(delivery_id)
    record = with_store(
        config_path, redis_url, data_dir, lambda store: log.get_delivery(store, delivery_id)
    )
    click.echo(orjson.dumps(record).decode() if as_json else record_text(record))


@deliveries.command("replay")
@click.argument("delivery_id")
@click.option(
    "--rerun", is_flag=True,
    help="Each matched trigger starts a new run (rerun_of the key's run; a live one is "
         "cancelled first), whatever its policies say.",
)  # fmt: skip
@store_options
@reports_errors
def deliveries_replay(
    delivery_id: str,
    rerun: bool,
    config_path: str,
    redis_url: str | None,
    data_dir: str,
    as_json: bool,
) -> None:
    """Send a stored delivery through matching again, with the triggers of --config as
    they are now (fixed since, say), and record it as a replay of DELIVERY_ID.

    Its signature is not kept: only the triggers that verified it on arrival, under the
    same verify spec as now, may start runs (the others answer unverified, saying why).
    The triggers are loaded as `realm listen` loads them: their webhook secrets must be
    set in the environment. By default the triggers' policies apply, so a replay of a
    delivery that started a run is deduplicated to that run; --rerun starts new ones."""
    from gateway.deliveries import log

    log.check_delivery_id(delivery_id)

    async def work(store: RunStore) -> dict[str, Any]:
        serving = Serving.of(store.config, store)
        return await log.replay(
            serving.store, serving.by_path, serving.config.settings, serving.version,
            delivery_id, rerun=rerun,
        )  # fmt: skip

    record = with_store(config_path, redis_url, data_dir, work, starts=True, with_triggers=True)
    click.echo(orjson.dumps(record).decode() if as_json else replay_text(record))
