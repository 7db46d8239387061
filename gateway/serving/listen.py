"""``realm listen``: checks the config, picks the Redis, then serves the app with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

import redis
import uvicorn

from gateway.ingest.github_hooks import shared_delivery_warnings
from gateway.ingest.observe import setup_logging
from gateway.ingest.triggers import describe_event_id
from gateway.link.connection import ping_url, redis_client, redis_target, unreachable
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, StoreUnavailable
from gateway.serving.app import SPOOL_DIR_ENV, serving_app
from gateway.serving.pidfile import answer_path, pid_file_kept
from gateway.serving.reload import AcceptedText, Answers, Reloads, defer_hangups, read_file
from gateway.serving.workers import ACCEPTED_ENV, SUPERVISOR_ENV, WORKER_NAME, Supervisor
from gateway.signatures.spec import describe
from gateway.store.runstore import RunStore

# How long SIGTERM waits for in-flight deliveries before closing connections.
GRACEFUL_SHUTDOWN_SECONDS = 30
# How long an idle keep-alive connection is kept open (uvicorn's default is 5 s).
KEEP_ALIVE_SECONDS = 75
# The app of each of several workers (it reads its settings from the environment).
APP = "gateway.serving.workers:worker_app"

log = logging.getLogger("realm")


class CannotBind(Exception):
    """The address to listen on is taken or not allowed: not a config error."""


def serve(
    config: Config,
    *,
    text: str,
    host: str,
    port: int,
    workers: int,
    redis_url: str | None,
    data_dir: str,
    pid_file: str | None = None,
) -> None:
    """Serve ``config`` (parsed from ``text``, the file's text) until SIGTERM or Ctrl-C;
    an embedded server started here stops afterwards. SIGHUP reloads the config file
    (gateway/serving/reload.py); this process's id is written to ``pid_file`` (default:
    ``<data_dir>/listen@<host>:<port>.pid``) for ``realm triggers reload``, which
    reads its answer next to it.

    Raises ``CannotBind`` before anything starts when ``host``/``port`` cannot be bound,
    ``PidFileError`` when the ``pid_file`` given cannot be written."""
    setup_logging()
    # Until the app handles SIGHUP, one (a reload racing the start) must not end the
    # process, as its default action would: it reloads once it can.
    defer_hangups()
    check_bindable(host, port)
    spool_dir = writable_spool(config, data_dir)
    with (
        # After the bind check: a listener that cannot start leaves another's file alone.
        pid_file_kept(pid_file, data_dir, host, port) as pid_path,
        redis_target(redis_url, data_dir) as target,
        tempfile.TemporaryDirectory(prefix="realm-listen-") as private,
    ):
        echo = log.info  # the banner is log lines too, in the one format (--log-format)
        echo(f"realm listen: http://{host}:{port} ({workers} worker{'s' * (workers > 1)})")
        echo(f"store: {target.description}")
        if os.environ.get("REALM_API_TOKEN"):  # what app_from_env reads
            echo("/v1 (admin API) and /ui (inspector): on, behind REALM_API_TOKEN")
        else:
            echo("/v1 (admin API) and /ui (inspector): off; set REALM_API_TOKEN to turn them on")
        for trigger in config.triggers.values():
            if trigger.verify.scheme == "none":
                log.warning(
                    "trigger '%s' has verify: none: its deliveries are not authenticated",
                    trigger.name,
                )
            echo(
                f"  POST {trigger.path}  → {trigger.workflow}  "
                f"[{trigger.name}; {describe(trigger.verify)}; event id: "
                f"{describe_event_id(trigger)}]"
            )
        if not config.triggers:
            echo("  (no triggers in the config: only /healthz and /readyz are served)")
        for warning in shared_delivery_warnings(config.triggers.values()):
            log.warning(warning)
        if reachable(target.url, config.settings.redis_timeout):
            # A changed `partitions` would move a workflow's keys: refused before serving.
            asyncio.run(check_layout(config, target.url))
        # Absolute, but through its symbolic links, never resolved: a Kubernetes
        # ConfigMap volume swaps a link to a new folder and removes the old one.
        config_file = os.path.abspath(config.file)
        if config_file != config.file:  # (its errors and log lines name this path)
            config = parse_config(text, file=config_file)
        answers = Answers(answer_path(pid_path) if pid_path else None)
        # Workers are separate processes: they read their settings from here.
        os.environ["REALM_CONFIG"] = config_file
        os.environ["REALM_REDIS_URL"] = target.url
        if config.settings.spool is not None and spool_dir is not None:
            os.environ[SPOOL_DIR_ENV] = spool_dir
            megabytes = config.settings.spool.max_bytes // 1024**2
            echo(
                f"spool: {spool_dir} (up to {megabytes} MiB): deliveries Redis "
                "cannot take in time are kept there, answered 202, and claimed once it answers"
            )
        else:
            os.environ.pop(SPOOL_DIR_ENV, None)
            echo("spool: off; deliveries Redis cannot take in time get 503")
        accepted = AcceptedText(Path(private) / "accepted.yaml")
        if workers > 1:
            # Each worker writes its metrics here; /metrics sums them (gateway/serving/metrics.py).
            # One process keeps them in memory: cheaper, and nothing to sum.
            metrics_dir = Path(private) / "metrics"
            metrics_dir.mkdir()
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
            # What the workers serve: the text checked above, whatever the file holds now.
            accepted.write(text)
            os.environ[ACCEPTED_ENV] = str(accepted.path)
            os.environ[SUPERVISOR_ENV] = str(os.getpid())
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then restores the handlers
        # it found and raises the signal again. With Python's defaults that kills
        # the process (exit -15, or a KeyboardInterrupt traceback) before the
        # embedded server is stopped: make the re-raised signal a no-op instead.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        options: dict[str, Any] = dict(
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_config=None,
            # httptools, with a cap on each request's head (431).
            http="gateway.ingest.edge:BoundedHttpToolsProtocol",
            access_log=False,  # the app logs one JSON line per delivery instead
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            # Longer than a load balancer's idle timeout (AWS ALB: 60 s): else the
            # gateway may close an idle connection just as the balancer (or a sender
            # reusing it) writes a request on it, which then fails unanswered.
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            server_header=False,
            # Client addresses are never used, so skip uvicorn's X-Forwarded-For
            # rewriting on every request.
            proxy_headers=False,
        )
        if workers == 1:
            # One process, serving the config checked above: its lifespan reloads on
            # SIGHUP itself, and answers.
            app = serving_app(config, target.url, Reloads(answers=answers))
            uvicorn.run(app, **{**options, "factory": False})
            return
        # Several: what uvicorn.run does for them, with a supervisor of our own
        # (gateway/serving/workers.py).
        uv_config = uvicorn.Config(APP, **options)
        sock = uv_config.bind_socket()
        # (No KeyboardInterrupt to catch, as uvicorn.run does: the supervisor handles SIGINT.)
        Supervisor(uv_config, [sock], config=config, config_file=config_file,
                   redis_url=target.url, accepted=accepted, answers=answers).run()  # fmt: skip


def read_config(path: str) -> tuple[str, Config]:
    """The file's text and its config, triggers included (ConfigError)."""
    text = read_file(path)
    return text, parse_config(text, file=path)


def writable_spool(config: Config, data_dir: str) -> str | None:
    """The spool's folder (absolute; None: the spool is off), made and checked for
    writing now: a worker that finds it read-only at its first delivery would be too
    late to say so. Raises ConfigError naming the folder and the ways out."""
    spool = config.settings.spool
    if spool is None:
        return None
    folder = os.path.abspath(spool.dir or os.path.join(data_dir, "spool"))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            config.file,
            f"cannot write the spool folder {folder} ({exc.strerror}): give the gateway a "
            "writable, persistent folder there (a volume), set settings.spool.dir to one, "
            "or turn the spool off with 'spool: false'",
            section="settings",
            field="spool.dir",
        ) from None
    return folder


def check_bindable(host: str, port: int) -> None:
    """Bind ``host:port`` once, as uvicorn will, to report a port in use in words of
    the command's own options (uvicorn would log an errno and exit 1). A race with
    another process between this check and uvicorn's bind is left to uvicorn."""
    if port == 0:
        return  # any free port
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)  # fmt: skip
    except socket.gaierror as exc:
        raise CannotBind(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # As asyncio's create_server: a port in TIME_WAIT is free to use.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise CannotBind(f"--port {port} is already in use on {host}: "
                                     f"{_who_listens(port)}") from None  # fmt: skip
                if exc.errno == errno.EACCES:
                    raise CannotBind(
                        f"--port {port} on {host}: permission denied (ports below 1024 "
                        "need privileges); choose another --port"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL and family == socket.AF_INET6:
                    continue  # IPv6 off on this machine; asyncio skips it too
                raise CannotBind(f"--host {host} --port {port}: {exc.strerror}") from None


def _who_listens(port: int) -> str:
    """The end of the port-in-use error: the processes of this user that listen on
    ``port``, named, when /proc tells (workers a killed listener left behind are said
    to be that)."""
    holders = listening_processes(port)
    if not holders:
        return "another process listens there; stop it or choose another --port"
    one = len(holders) == 1
    named = ", ".join(f"{pid} ({name})" for pid, name in holders)
    kill = "kill " + " ".join(str(pid) for pid, _ in holders)
    whose = ""
    if all(name == WORKER_NAME.decode() for _, name in holders):
        whose = f", {'a worker' if one else 'workers'} of a `realm listen` that is gone"
    return (
        f"{'process' if one else 'processes'} {named} {'listens' if one else 'listen'} "
        f"there{whose}; stop {'it' if one else 'them'} ({kill}) or choose another --port"
    )


def listening_processes(port: int) -> list[tuple[int, str]]:
    """(pid, name) of each process that listens on TCP ``port`` and whose open files
    this user may see, from /proc (empty where there is none)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # local address "ADDR:PORT" in hex; state 0A is LISTEN
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(f"socket:[{fields[9]}]")
    found = []
    if not inodes:
        return found
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                name = (proc / "comm").read_text().strip()
                found.append((int(proc.name), name))
        except OSError:
            continue  # another user's, or gone
    return sorted(found)


def reachable(url: str, timeout: float) -> bool:
    """Whether the store answers at start-up; if not, one loud line. The gateway starts
    anyway (its Redis may come up later, as in a container start), answering 503
    until it does: a listener that looks healthy while it refuses every delivery
    would be worse."""
    try:
        # Every primary of a cluster; the client redis_client makes for any scheme.
        asyncio.run(ping_url(url, timeout))
        return True
    except redis.RedisError as exc:
        # The words every command uses for it (gateway/link/connection.py).
        log.error(
            "error: %s. Starting anyway: webhooks and /v1 answer 503 STORE_UNAVAILABLE "
            "and /readyz 503 until it does", unreachable(exc, url),
        )  # fmt: skip
        return False


async def check_layout(config: Config, url: str) -> None:
    """RunStore.check_layout on a client of its own (raises ConfigError)."""
    client = redis_client(url, config.settings.redis_timeout)
    try:
        await RunStore(client, config).check_layout()
    except StoreUnavailable as exc:
        log.error("error: could not check the workflows' partitions: %s", exc.message)
    finally:
        await client.aclose()
