"""``realm run``: start runs (one or a batch), read them, end their steps, cancel or
fail them, and reconcile the key index with the runs it points at."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import orjson

from gateway.cli.common import emit, report_error, reports_errors, store_options, with_store
from gateway.ingest import replies
from gateway.model.errors import StoreUnavailable
from gateway.model.words import plural
from gateway.store.paging import list_runs_across
from gateway.store.reconcile import count_runs, reconcile
from gateway.store.runs import LIVE_MATCH, PARAMS_MISMATCH, PHASES, TERMINAL_MATCH, Run, new_run_id
from gateway.store.runstore import RunStore


@click.group()
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
    emit(as_json, replies.start_text(result), replies.start_json(result))


@run.command("show")
@click.argument("run_id")
@store_options
@reports_errors
def run_show(
    run_id: str, config_path: str, redis_url: str | None, data_dir: str, as_json: bool
) -> None:
    """Print a run's fields."""
    found = with_store(config_path, redis_url, data_dir, lambda store: store.get_run(run_id))
    emit(as_json, replies.run_text(found), found.as_dict())


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
    emit(as_json, f"status: ok\ncancelled: {count}", {"status": "ok", "cancelled": count})


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
    emit(as_json, replies.step_text(step, result), data)


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
    emit(as_json, replies.fail_text(found), {"status": "ok", "run_id": run_id,
                                              "phase": found.phase,
                                              "message": f"Run '{run_id}' failed."})  # fmt: skip


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
        report_error(exc, as_json, batch_id=given)
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

    async def work(store: RunStore) -> Any:
        if not sys.stderr.isatty():
            step = 100_000
            shown = [0]

            def plain(groups: int, runs: int) -> None:
                if groups - shown[0] >= step:
                    shown[0] = groups
                    click.echo(f"reconcile: {plural(groups, 'key group')}, "
                               f"{plural(runs, 'run')} checked", err=True)  # fmt: skip

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
    emit(as_json, report.text(), {"status": "ok", **report.as_dict()})
