"""``realm work``: a runner that takes the ready steps of workflows and runs their
handlers (gateway/runners/), stopping gracefully on SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from gateway.cli.common import (
    EXIT_CONFIG,
    load_config_or_exit,
    reports_errors,
    server_options,
    with_store,
)
from gateway.ingest.observe import setup_logging
from gateway.model.errors import ConfigError
from gateway.runners.handlers import build_handlers, parse_handlers
from gateway.runners.metrics import serve_runner_metrics
from gateway.runners.runner import Runner
from gateway.store.runstore import RunStore


@click.command("work")
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
    config = load_config_or_exit(config_path, with_triggers=False)
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
