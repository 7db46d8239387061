"""Hot reload of triggers.yaml: SIGHUP makes a running listener serve the file's new text.

The file is loaded and checked as at start-up, then against what only a restart can
change (the settings the Redis connections, body budget and HTTP parser were built
with) and against the store's record of each workflow's partitions, which it records
for new workflows. A file that passes becomes a new ``Serving``
(gateway/ingest/served.py), swapped in with one assignment on the worker's event loop:
a delivery that arrived before the swap is handled to its end by the old version,
every later one by the new. A file that fails is refused and the old version kept.
Either way one JSON line on stderr says what happened and which version serves, and
the listener answers ``realm triggers reload`` (gateway/serving/pidfile.py).

One worker (``ReloadOnHangup`` with plain ``Reloads()``) does all of that itself.

Several workers: the supervisor (gateway/serving/workers.py) is the only one that
decides. It reads the file once, runs every check once (the one against Redis
included), and, if the file passes, writes the text it accepted to a file of its own
(``AcceptedText``) before it signals the workers. A worker applies that text, not the
file on disk, and asks Redis nothing: what could differ between the workers (a
transient Redis error met by one of them, the file rewritten between two reads) is
settled once, so a reload applies in every worker or in none. The same text is what a
worker started later serves (one that replaces a worker that died): never a file the
listener refused, say one with a new ``key_prefix`` or ``partitions``, whose runs
would land in another keyspace. A two-phase apply (workers prepare, then commit) was
the alternative; it needs a reply channel from each worker and still has to decide
what a worker that fails to commit serves.

The environment is the one the listener started with: a trigger may use only the
secrets it already holds (a new ``secret_env`` variable needs a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter, values

from gateway.ingest.served import Serving
from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.config import Config, Durability, Settings
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.model.words import noun
from gateway.serving.pidfile import Answer, write_answer
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
    "spool",
)


@dataclass(frozen=True)
class Reloaded:
    """What one reload did. ``version`` is the one serving afterwards;
    ``file_version`` the version of the text read (None: the file could not be read)."""

    applied: bool
    version: str
    error: str | None = None
    file_version: str | None = None


def read_file(path: str) -> str:
    """The config file's text (ConfigError, worded as load_config's, if unreadable)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, f"cannot read file: {exc}") from None


def text_version(text: str) -> str:
    """A text's config version, as gateway.loading computes it for a file that parses."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


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


def parse_for_reload(text: str, path: str, running: Settings) -> Config:
    """The config of ``text`` (the file ``path``'s) if a reload may apply it, as far as
    can be told without Redis (ConfigError otherwise)."""
    config = parse_config(text, file=path)
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


async def check_partitions(store: RunStore, old: Config) -> None:
    """RunStore.check_layout for ``store`` (bound to the new config), recording the
    partitions of new workflows. When the store cannot be asked, only a file that adds
    workflows or changes partitions is refused: the others' layout is the one already
    serving."""
    try:
        await store.check_layout(record=True)
    except StoreUnavailable as exc:
        changed = layout_changes(old, store.config)
        if changed:
            raise ConfigError(
                store.config.file,
                f"{noun(len(changed), 'workflow')} {', '.join(changed)} "
                f"{noun(len(changed), 'is new or changes', 'are new or change')} partitions, "
                f"and the store could not be asked about their data ({exc.message}); reload again "
                "once it answers",
            ) from None


async def check_partitions_at(url: str, new: Config, old: Config) -> None:
    """check_partitions on a client of its own (the supervisor's check)."""
    client = redis_client(url, new.settings.redis_timeout)
    try:
        await check_partitions(RunStore(client, new), old)
    finally:
        await client.aclose()


class AcceptedText:
    """The text of the config a supervisor of several workers last accepted, in a file
    of its own (in the listener's private temporary folder): what every worker serves,
    whenever it starts or reloads. The supervisor writes it; workers read it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._text: str | None = None  # the supervisor's copy

    def write(self, text: str) -> None:
        """Replace the file whole (write, then rename): a worker never reads half a text."""
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, self.path)
        self._text = text

    def restore_if_missing(self) -> None:
        """Write the file again if something removed it (a cleaner of old temporary
        files, after days without a reload): a worker started next must find it."""
        if self._text is not None and not self.path.exists():
            with contextlib.suppress(OSError):
                self.write(self._text)

    def read(self) -> str:
        return read_file(str(self.path))


class Answers:
    """The listener's answers to ``realm triggers reload``, numbered (pidfile.Answer),
    written by the process whose id is in the pid file. No path: none written."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.generation = 0

    def answer(self, outcome: Reloaded) -> None:
        self.generation += 1
        if self.path is not None:
            write_answer(self.path, Answer(
                pid=os.getpid(), generation=self.generation,
                result="applied" if outcome.applied else "refused",
                file_version=outcome.file_version, version=outcome.version, error=outcome.error,
            ))  # fmt: skip


@dataclass(frozen=True)
class Reloads:
    """How a worker's SIGHUP reloads. ``accepted``: under a supervisor, the text it
    accepted, applied with no check against Redis; None: the file itself, every check
    made here (one worker). ``answers``: this process answers ``realm triggers reload``."""

    accepted: AcceptedText | None = None
    answers: Answers | None = None


async def reload(webhooks: Webhooks, path: str) -> Reloaded:
    """Load ``path`` and serve it after every check, or keep the version serving now;
    one log line."""
    serving = webhooks.serving
    assert serving is not None, "the app's lifespan sets webhooks.serving"
    file_version = None
    try:
        text = read_file(path)
        file_version = text_version(text)
        config = parse_for_reload(text, path, webhooks.settings)
        new = Serving.of(config, serving.store)
        await check_partitions(new.store, serving.config)
    except ConfigError as exc:
        return refused(path, serving.version, str(exc), file_version=file_version)
    except Exception as exc:
        # The type only: the text of an unexpected error may quote anything.
        error = f"unexpected {type(exc).__name__}"
        return refused(path, serving.version, error, file_version=file_version)
    return _swap(webhooks, new, path, file_version)


async def apply_accepted(webhooks: Webhooks, path: str, accepted: AcceptedText) -> Reloaded:
    """Serve the text the supervisor accepted for ``path``. It passed every check
    there, in the same environment: nothing here depends on Redis, so every worker
    comes to the same result."""
    serving = webhooks.serving
    assert serving is not None, "the app's lifespan sets webhooks.serving"
    try:
        text = accepted.read()
        config = parse_for_reload(text, path, webhooks.settings)
        new = Serving.of(config, serving.store)
    except ConfigError as exc:
        return refused(path, serving.version, str(exc))
    except Exception as exc:
        return refused(path, serving.version, f"unexpected {type(exc).__name__}")
    return _swap(webhooks, new, path, new.version)


def _swap(webhooks: Webhooks, new: Serving, path: str, file_version: str | None) -> Reloaded:
    old = webhooks.serving
    assert old is not None
    webhooks.serving = new
    if webhooks.recorder is not None:
        webhooks.recorder.settings = new.config.settings
    log_line("applied", path, new.version, from_version=old.version)
    CONFIG_RELOADS.labels("applied").inc()
    return Reloaded(True, new.version, file_version=file_version)


def refused(
    path: str, version: str, error: str, *, count: bool = True, file_version: str | None = None
) -> Reloaded:
    """Log and count a refused file; ``version`` keeps serving."""
    log_line("refused", path, version, error=error)
    if count:
        CONFIG_RELOADS.labels("refused").inc()
    return Reloaded(False, version, error, file_version)


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
    """Until the app's lifespan (or the supervisor) handles SIGHUP, note one rather
    than die of it (its default action), for ReloadOnHangup.install (or the
    supervisor) to act on."""
    signal.signal(signal.SIGHUP, lambda signum, frame: _hangup_while_starting.set())


def hangup_while_starting() -> bool:
    """Whether a SIGHUP came while this process started (and forget it)."""
    came = _hangup_while_starting.is_set()
    _hangup_while_starting.clear()
    return came


class ReloadOnHangup:
    """SIGHUP on a worker's event loop reloads ``path`` (as ``reloads`` says). Reloads
    run one at a time, in order: a SIGHUP that arrives during one makes one more after
    it, so the last signal always reads the file as it is after the last write."""

    def __init__(
        self,
        webhooks: Webhooks,
        path: str,
        sweeper: Sweeper | None = None,
        reloads: Reloads | None = None,
    ) -> None:
        self.webhooks = webhooks
        self.path = path
        self.sweeper = sweeper
        self.reloads = reloads or Reloads()
        self._pending = False
        self._task: asyncio.Task[None] | None = None

    def install(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.request)
        if hangup_while_starting():  # see defer_hangups
            self.request()

    def request(self) -> None:
        self._pending = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._reload_while_asked())

    async def _reload_while_asked(self) -> None:
        accepted, answers = self.reloads.accepted, self.reloads.answers
        while self._pending:
            self._pending = False
            if accepted is not None:
                outcome = await apply_accepted(self.webhooks, self.path, accepted)
            else:
                outcome = await reload(self.webhooks, self.path)
            if outcome.applied and self.sweeper is not None and self.webhooks.serving:
                # The sweep follows the workflows of the version serving (from its next
                # tick), whose streams get the runners' group now.
                await self.sweeper.follow(self.webhooks.serving.store)
            if answers is not None:
                answers.answer(outcome)

    async def remove(self) -> None:
        """Stop reloading (at shutdown); a late SIGHUP is ignored, not fatal."""
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        # asyncio restores the default action, which would end the process.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


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
