"""``realm work``: a runner that takes the ready steps of workflows and runs their
handlers (gateway/runners/), stopping gracefully on SIGTERM or Ctrl-C, and reading
triggers.yaml's handlers again on SIGHUP."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Sequence

import click

from gateway.cli.common import (
    EXIT_CONFIG,
    load_config_or_exit,
    log_format_option,
    reports_errors,
    server_options,
    with_store,
)
from gateway.ingest.observe import setup_logging
from gateway.loading import load_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, RealmError, StoreUnavailable
from gateway.model.words import plural
from gateway.runners.handlers import HandlerSet, HandlerSpec, build_handlers, parse_handlers
from gateway.runners.metrics import serve_runner_metrics
from gateway.runners.runner import Runner
from gateway.store.runstore import RunStore

# Its lines go where the runner's go, in the same format (--log-format).
log = logging.getLogger("realm")

# --drain: a run failed at a step of this runner's, or a step it failed was left
# waiting for its retry.
EXIT_STEPS_FAILED = 1
# What the runner's connections were built with: a reload cannot change them.
RESTART_SETTINGS = ("key_prefix", "redis_timeout", "durability")


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
@click.option(
    "--drain", is_flag=True,
    help="Exit once no step is ready, none is in hand and none it failed waits for a retry; "
    f"exit {EXIT_STEPS_FAILED} if a run failed.",
)  # fmt: skip
@click.option(
    "--metrics-port", type=click.IntRange(1, 65535), default=None,
    help="Serve this runner's metrics on http://127.0.0.1:PORT/metrics.",
)  # fmt: skip
@server_options
@log_format_option
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
    log_format: str,
) -> None:
    """Run the step handlers of triggers.yaml (`handlers:`) on ready steps of WORKFLOW
    (default: every workflow with handlers). A step without a handler is left to
    another runner. SIGTERM or Ctrl-C stops taking steps and finishes the ones in hand;
    a second one abandons them to their leases. SIGHUP reads the handlers again."""
    # A SIGHUP before the loop can reload (its default action would end the process):
    # noted, and acted on once it can.
    early_hangup = threading.Event()
    signal.signal(signal.SIGHUP, lambda signum, frame: early_hangup.set())
    config = load_config_or_exit(config_path, with_triggers=False)
    try:
        names, specs = handler_specs(config, workflows)
        handler_set = build_handlers(specs, file=config.file)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    setup_logging(log_format)
    if metrics_port is not None:
        serve_runner_metrics(metrics_port)

    async def serve(store: RunStore) -> int:
        runner = Runner(store, names, handler_set.handlers, concurrency=concurrency,
                        grace=grace)  # fmt: skip
        reloads = Reloads(runner, config_path, workflows, handler_set)
        signals = [0]

        def on_signal() -> None:
            signals[0] += 1
            if signals[0] == 1:
                log.info("work: stopping: finishing the steps in hand")
                runner.stop()
            else:
                runner.abandon()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        loop.add_signal_handler(signal.SIGHUP, reloads.request)
        if early_hangup.is_set():
            reloads.request()
        log.info("work: %s taking steps of %s (concurrency %d)", runner.runner_id,
                 ", ".join(names), concurrency)  # fmt: skip
        try:
            await runner.run(until_idle=drain)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not the default: it would end us
            await reloads.finish()
            await handler_set.aclose()  # the HTTP client every version shares
        counts = ", ".join(f"{n} {k}" for k, n in runner.counts.items())
        log.info("work: stopped (%s)", counts)
        if not drain:
            return 0
        if runner.waiting_retries:
            log.info("work: %s this runner failed still %s for a retry",
                     plural(runner.waiting_retries, "step"),
                     "waits" if runner.waiting_retries == 1 else "wait")  # fmt: skip
        if runner.runs_failed:
            log.info("work: %s failed", plural(runner.runs_failed, "run"))
        return EXIT_STEPS_FAILED if runner.runs_failed or runner.waiting_retries else 0

    sys.exit(with_store(config_path, redis_url, data_dir, serve, logs=True))


def handler_specs(
    config: Config, workflows: Sequence[str]
) -> tuple[list[str], dict[str, dict[str, HandlerSpec]]]:
    """The workflows to take steps of (``workflows``, or every one with handlers) and
    their handlers' specs. ConfigError when there is nothing to run."""
    names = list(workflows) or [w.name for w in config.workflows.values() if w.handlers]
    if not names:
        raise ConfigError(config.file, "no workflow has handlers: to run")
    specs = {}
    for name in names:
        wf = config.workflow(name)
        if not wf.handlers:
            raise ConfigError(config.file, "has no handlers: nothing to run its steps",
                              section="workflow", name=name, field="handlers")  # fmt: skip
        specs[name] = parse_handlers(wf.handlers, file=config.file, workflow=name, steps=wf.steps)
    return names, specs


class Reloads:
    """SIGHUP: triggers.yaml read again, and the runner given its new handlers between
    two takes; a file that does not load, or changes what only a restart can, is
    refused in one log line and the handlers in use are kept. One reload at a time: a
    SIGHUP during one makes one more after it, so the last reads the file as it is."""

    def __init__(
        self, runner: Runner, path: str, workflows: Sequence[str], handler_set: HandlerSet
    ) -> None:
        self.runner = runner
        self.path = path
        self.workflows = workflows  # as given on the command line: none means all
        self.handler_set = handler_set
        self.config = runner.store.config
        self._pending = False
        self._task: asyncio.Task[None] | None = None

    def request(self) -> None:
        self._pending = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._reload_while_asked())

    async def finish(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _reload_while_asked(self) -> None:
        while self._pending:
            self._pending = False
            try:
                await self._reload()
            except ConfigError as exc:
                self._refused(str(exc))
            except RealmError as exc:  # a workflow named on the command line is gone
                self._refused(f"{self.path}: {exc.message}")
            except Exception as exc:
                # The type only: the text of an unexpected error may quote anything.
                self._refused(f"{self.path}: unexpected {type(exc).__name__}")

    async def _reload(self) -> None:
        config = load_config(self.path, with_triggers=False)
        changed = [
            f"settings.{name}" for name in RESTART_SETTINGS
            if getattr(config.settings, name) != getattr(self.config.settings, name)
        ]  # fmt: skip
        if changed:
            raise ConfigError(config.file, f"{', '.join(changed)} changed; restart realm work "
                              "to apply")  # fmt: skip
        names, specs = handler_specs(config, self.workflows)
        store = self.runner.store.with_config(config)
        try:
            await store.check_layout(record=False)  # the partitions the data is stored with
        except StoreUnavailable as exc:
            raise ConfigError(config.file, "the store could not be asked whether the workflows' "
                              f"partitions fit their data ({exc.message}); send SIGHUP again "
                              "once it answers") from None  # fmt: skip
        handlers = build_handlers(specs, file=config.file, reuse=self.handler_set)
        try:
            self.runner.reconfigure(handlers.handlers, workflows=names, store=store)
        except ValueError as exc:
            raise ConfigError(config.file, str(exc)) from None
        self.config = config
        log.info("work: reloaded %s (version %s): taking steps of %s", config.file,
                 config.version, ", ".join(names))  # fmt: skip

    def _refused(self, error: str) -> None:
        log.error("work: reload refused, the handlers in use kept: %s", error)
