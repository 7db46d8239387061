"""Hot reload of triggers.yaml: SIGHUP makes a running listener serve the file's new text.

A worker reloads on its event loop (``ReloadOnHangup``, installed by the app's
lifespan): the file is loaded and checked as at start-up, then against what only a
restart can change (the settings its Redis connections, body budget and HTTP parser
were built with) and against the store's record of each workflow's partitions. A
file that passes becomes a new ``Serving`` (gateway/ingest/served.py), swapped in with one
assignment: a delivery that arrived before the swap is handled to its end by the old
version, every later one by the new. A file that fails is refused and the old
version kept. Either way one JSON line on stderr says what happened and which
version serves.

With several workers the supervisor (gateway/serving/listen.py) checks the file first, so a
refused file is logged once rather than once per worker, and passes SIGHUP on to
the workers only when the file passes.

The environment is the one the listener started with: a trigger may use only the
secrets it already holds (a new ``secret_env`` variable needs a restart).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter, values

from gateway.ingest.served import Serving
from gateway.link.connection import redis_client
from gateway.loading import load_config
from gateway.model.config import Config, Durability, Settings
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.store.runstore import RunStore

if TYPE_CHECKING:
    from gateway.ingest.webhooks import Webhooks
    from gateway.store.sweep import Sweeper

log = logging.getLogger("realm")

CONFIG_RELOADS = Counter(
    "realm_config_reloads_total",
    "triggers.yaml reloads by a worker: applied, or refused (the old one kept)",
    ["result"],
)

# What a worker built from the config at start-up and keeps: its Redis connections
# (key prefix, timeout, durability), its body budget and its HTTP parser's head cap.
RESTART_SETTINGS = (
    "key_prefix",
    "redis_timeout",
    "durability",
    "max_buffered_body_bytes",
    "max_header_bytes",
)


@dataclass(frozen=True)
class Reloaded:
    """What one reload did. ``version`` is the one serving afterwards."""

    applied: bool
    version: str
    error: str | None = None


def check_restart_settings(running: Settings, config: Config) -> None:
    """Raise ConfigError naming each setting of ``config`` that only a restart applies."""
    changed = [
        f"settings.{name} changed (was {_shown(getattr(running, name))}, "
        f"now {_shown(getattr(config.settings, name))})"
        for name in RESTART_SETTINGS
        if getattr(running, name) != getattr(config.settings, name)
    ]
    if changed:
        them = "it" if len(changed) == 1 else "them"
        raise ConfigError(
            config.file, "; ".join(changed) + f"; restart the listener to apply {them}"
        )


def load_for_reload(path: str, running: Settings) -> Config:
    """The file's config if a reload may apply it, as far as can be told without Redis
    (ConfigError otherwise)."""
    config = load_config(path)
    check_restart_settings(running, config)
    return config


def layout_changes(old: Config, new: Config) -> list[str]:
    """The workflows of ``new`` whose partitions the store has to confirm: new names,
    and changed ``partitions``."""
    return sorted(
        name
        for name, wf in new.workflows.items()
        if name not in old.workflows or old.workflows[name].partitions != wf.partitions
    )


async def check_partitions(store: RunStore, old: Config, *, record: bool) -> None:
    """RunStore.check_layout for ``store`` (bound to the new config). When the store
    cannot be asked, only a file that adds workflows or changes partitions is refused:
    the others' layout is the one already serving."""
    try:
        await store.check_layout(record=record)
    except StoreUnavailable as exc:
        changed = layout_changes(old, store.config)
        if changed:
            raise ConfigError(
                store.config.file,
                f"workflow(s) {', '.join(changed)} are new or change partitions, and the "
                f"store could not be asked about their data ({exc.message}); reload again "
                "once it answers",
            ) from None


async def check_partitions_at(url: str, new: Config, old: Config) -> None:
    """check_partitions on a client of its own, recording nothing (the supervisor's
    check; each worker records when it applies the file)."""
    client = redis_client(url, new.settings.redis_timeout)
    try:
        await check_partitions(RunStore(client, new), old, record=False)
    finally:
        await client.aclose()


async def reload(webhooks: Webhooks, path: str) -> Reloaded:
    """Load ``path`` and serve it, or keep the version serving now; one log line."""
    serving = webhooks.serving
    assert serving is not None, "the app's lifespan sets webhooks.serving"
    try:
        config = load_for_reload(path, webhooks.settings)
        new = Serving.of(config, serving.store)
        await check_partitions(new.store, serving.config, record=True)
    except ConfigError as exc:
        return refused(path, serving.version, str(exc))
    except Exception as exc:
        # The type only: the text of an unexpected error may quote anything.
        return refused(path, serving.version, f"unexpected {type(exc).__name__}")
    webhooks.serving = new
    if webhooks.recorder is not None:
        webhooks.recorder.settings = config.settings
    log_line("applied", path, new.version, from_version=serving.version)
    CONFIG_RELOADS.labels("applied").inc()
    return Reloaded(True, new.version)


def refused(path: str, version: str, error: str, *, count: bool = True) -> Reloaded:
    """Log and count a refused file; ``version`` keeps serving."""
    log_line("refused", path, version, error=error)
    if count:
        CONFIG_RELOADS.labels("refused").inc()
    return Reloaded(False, version, error)


def log_line(result: str, path: str, version: str, **fields: Any) -> None:
    """The one line of a reload: what happened, the file, the version serving now. An
    error is a ConfigError's line, which names variables, never their values."""
    record = {"event": "config_reload", "level": "info" if result == "applied" else "error",
              "result": result, "file": path, "version": version, **fields,
              "pid": os.getpid()}  # fmt: skip
    text = orjson.dumps(record).decode()
    if result == "applied":
        log.info("%s", text)
    else:
        log.error("%s", text)


def count_in_supervisor(result: str) -> None:
    """Count a reload the supervisor of several workers refused in CONFIG_RELOADS.

    The supervisor imported prometheus_client before ``realm listen`` pointed it at the
    workers' metrics folder, so its own counters live in its memory and no scrape
    sees them; the count is written to the folder as a worker's would be."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        CONFIG_RELOADS.labels(result).inc()
        return
    _supervisor_counter(result).inc(1)


@functools.cache
def _supervisor_counter(result: str) -> Any:
    family = CONFIG_RELOADS.describe()[0]
    value_class = values.MultiProcessValue()
    return value_class("counter", family.name, family.name + "_total", ("result",), (result,),
                       family.documentation)  # fmt: skip


# A SIGHUP that arrived while this process was starting, before the app could reload:
# noted, and acted on once it can. (Signal handling is per process, and so is this.)
_hangup_while_starting = threading.Event()


def defer_hangups() -> None:
    """Until the app's lifespan handles SIGHUP, note one rather than die of it (its
    default action), for ReloadOnHangup.install to act on."""
    signal.signal(signal.SIGHUP, lambda signum, frame: _hangup_while_starting.set())


class ReloadOnHangup:
    """SIGHUP on a worker's event loop reloads ``path``. Reloads run one at a time, in
    order: a SIGHUP that arrives during one makes one more after it, so the last
    signal always reads the file as it is after the last write."""

    def __init__(self, webhooks: Webhooks, path: str, sweeper: Sweeper | None = None) -> None:
        self.webhooks = webhooks
        self.path = path
        self.sweeper = sweeper
        self._pending = False
        self._task: asyncio.Task[None] | None = None

    def install(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.request)
        if _hangup_while_starting.is_set():  # see defer_hangups
            _hangup_while_starting.clear()
            self.request()

    def request(self) -> None:
        self._pending = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._reload_while_asked())

    async def _reload_while_asked(self) -> None:
        while self._pending:
            self._pending = False
            outcome = await reload(self.webhooks, self.path)
            if outcome.applied and self.sweeper is not None and self.webhooks.serving:
                # The sweep follows the workflows of the version serving (from its next tick).
                self.sweeper.store = self.webhooks.serving.store

    async def remove(self) -> None:
        """Stop reloading (at shutdown); a late SIGHUP is ignored, not fatal."""
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        # asyncio restores the default action, which would end the process.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _StandInSecrets(Mapping[str, str]):
    """An environment in which every variable is set, to a stand-in secret (one that
    also fits the Standard Webhooks format): the file is checked, not the environment
    of the shell it is checked from."""

    _STAND_IN = "whsec_c3RhbmQtaW4="

    def __getitem__(self, name: str) -> str:
        return self._STAND_IN

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def load_without_secrets(path: str) -> Config:
    """``realm triggers reload``'s check of the file before it signals a listener: all
    but the secrets, which the listener checks in its own environment."""
    return load_config(path, env=_StandInSecrets())


def _shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, Durability):
        return (
            f"{{replicas: {value.replicas}, fsync: {str(value.fsync).lower()}, "
            f"timeout: {value.timeout:g}}}"
        )
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return repr(value)
    return str(value)
