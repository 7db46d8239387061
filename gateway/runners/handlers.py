"""Step handlers named in ``triggers.yaml`` (``handlers:`` under a workflow), for ``realm work``.

```yaml
workflows:
  nightly-sync:
    steps: [fetch, sync]
    handlers:
      fetch: {command: ["sh", "-c", "..."], timeout: 30s}
      sync: {http: "http://127.0.0.1:9000/sync", secret_env: SYNC_HOOK_SECRET, timeout: 10s}
```

Both kinds get the same JSON: ``{"run_id", "workflow", "step", "attempt", "params",
"output"}`` (``output``: the previous step's). A ``command:`` reads it on stdin, in a
minimal environment (``command_env``): PATH, HOME, the locale, TZ, TMPDIR,
``REALM_RUN_ID``, ``REALM_WORKFLOW``, ``REALM_STEP`` and ``REALM_ATTEMPT``, and the
variables its ``env:`` lists; never the gateway's own (the API token, the Redis URL) nor
a secret the file names. Exit 0 is success (stdout is the output: JSON when it parses,
else the text), another exit code a failure (the tail of stderr is the error), and a
timeout a failure (its process group is killed). The command's exit is its end, not
its pipes closing: a command that closed its stdout, or left a process in the
background holding it, ends when its own process does. An ``http:`` handler receives
it as a POST signed with Standard Webhooks (``webhook-id`` is stable for a run, step
and attempt); 2xx is success (a JSON body is the output), 4xx a failure that ends the
run at once (no retry: the request itself was refused), 5xx, 408, 429 or a timeout a
failure that is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import re
import signal
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.model.errors import ConfigError

if TYPE_CHECKING:
    from gateway.store.runs import TakenStep

HANDLER_FIELDS = {"command", "env", "http", "secret_env", "timeout"}
DEFAULT_TIMEOUT = 60.0  # seconds a handler may take, unless it says otherwise
MAX_TIMEOUT = 24 * 3600.0
# What a handler may hand back: the store refuses outputs over 64 KiB (encoded); a
# text stdout is cut below that. stdout past MAX_STDOUT is read and dropped, so a
# chatty command cannot fill the runner's memory.
MAX_TEXT_OUTPUT = 60_000
MAX_STDOUT = 1024 * 1024
ERROR_TAIL = 2000  # characters of stderr (or of a reply body) kept as the error
# After a command exits, how long what it wrote may take to come out of its pipes: a
# process it left in the background may hold them open for ever.
PIPE_GRACE = 0.5
# What a command's environment holds of the runner's, besides what its `env:` lists:
# enough to find programs and files and to speak the right language, and no credential.
PASSED_ENV = frozenset({"PATH", "HOME", "LANG", "TZ", "TMPDIR"})
PASSED_ENV_PREFIXES = ("LC_",)  # LC_ALL, LC_CTYPE, ...
# The gateway's own variables hold its credentials (REALM_API_TOKEN, REALM_REDIS_URL):
# never passed from the runner's environment, and refused in an `env:` list.
OWN_ENV_PREFIX = "REALM_"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class HandlerFailed(Exception):
    """A handler's failure; the step is retried while attempts are left."""


class PermanentFailure(HandlerFailed):
    """A failure that no retry can mend (an HTTP handler's 4xx): the run fails at once."""


@dataclass(frozen=True)
class CommandHandler:
    argv: tuple[str, ...]
    timeout: float = DEFAULT_TIMEOUT
    env: tuple[str, ...] = ()  # names of more variables of the runner's to pass on


@dataclass(frozen=True)
class HttpHandler:
    url: str
    secret_env: str
    timeout: float = DEFAULT_TIMEOUT


HandlerSpec = CommandHandler | HttpHandler


def parse_duration(value: object) -> float:
    """``30s``, ``500ms``, ``2m``, ``1h`` or a number of seconds → seconds. Raises ValueError."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(value) if isinstance(value, str) else None
        if not match:
            raise ValueError(f"must be a duration like '30s', '500ms' or '2m' (got {value!r})")
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if not 0 < seconds <= MAX_TIMEOUT:
        raise ValueError(f"must be more than 0 and at most 24h (got {value!r})")
    return seconds


def parse_handlers(
    raw: object,
    *,
    file: str,
    workflow: str,
    steps: tuple[str, ...] | list[str],
    secrets: Collection[str] = (),
) -> dict[str, HandlerSpec]:
    """A workflow's ``handlers:`` mapping → one spec per step. Raises a one-line ConfigError.

    ``secrets``: the variables the file names as holding secrets (the triggers' and
    the http handlers' ``secret_env``), which a command's ``env:`` may not list."""

    def error(field_name: str, message: str) -> ConfigError:
        return ConfigError(file, message, section="workflow", name=workflow, field=field_name)

    if not isinstance(raw, dict) or not raw:
        raise error("handlers", "must be a mapping of step name → {command: [...]} or {http: URL}")
    specs: dict[str, HandlerSpec] = {}
    for step, spec in raw.items():
        where = f"handlers.{step}"
        if step not in steps:
            raise error(where, f"names no step of the workflow (steps: {', '.join(steps)})")
        if not isinstance(spec, dict):
            raise error(where, "must be a mapping with 'command' or 'http'")
        unknown = sorted(str(k) for k in spec if k not in HANDLER_FIELDS)
        if unknown:
            raise error(
                f"{where}.{unknown[0]}", f"unknown field; allowed: {sorted(HANDLER_FIELDS)}"
            )
        try:
            timeout = parse_duration(spec.get("timeout", DEFAULT_TIMEOUT))
        except ValueError as exc:
            raise error(f"{where}.timeout", str(exc)) from None
        if ("command" in spec) == ("http" in spec):
            raise error(where, "needs exactly one of 'command' and 'http'")
        if "command" in spec:
            argv = spec["command"]
            if (
                not isinstance(argv, list)
                or not argv
                or not all(isinstance(a, str) and "\0" not in a for a in argv)
                or not argv[0]
            ):
                raise error(
                    f"{where}.command",
                    'must be a non-empty list of strings, e.g. ["sh", "-c", "./fetch.sh"]',
                )
            if "secret_env" in spec:
                raise error(f"{where}.secret_env", "is for http handlers only")
            env = _parse_env(spec.get("env", []), secrets, functools.partial(error, f"{where}.env"))
            specs[step] = CommandHandler(argv=tuple(argv), timeout=timeout, env=env)
            continue
        if "env" in spec:
            raise error(f"{where}.env", "is for command handlers only")
        url = spec["http"]
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise error(f"{where}.http", "must be an http:// or https:// URL")
        secret_env = spec.get("secret_env")
        if not isinstance(secret_env, str) or not _ENV_NAME.fullmatch(secret_env):
            # Not echoed: the likeliest mistake is the secret pasted in place of its name.
            raise error(
                f"{where}.secret_env",
                "is required: the name of the environment variable holding the whsec_ secret "
                "the request is signed with",
            )
        specs[step] = HttpHandler(url=url, secret_env=secret_env, timeout=timeout)
    return specs


def _parse_env(
    raw: object, secrets: Collection[str], error: Callable[[str], ConfigError]
) -> tuple[str, ...]:
    """A command's ``env:``: names of variables of the runner's to pass on."""
    if not isinstance(raw, list):
        raise error("must be a list of environment variable names, e.g. [AWS_PROFILE]")
    names: list[str] = []
    for name in raw:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            # Not echoed: the likeliest mistake is a value pasted in place of its name.
            raise error(
                "entries must be environment variable names (letters, digits and _, "
                "not starting with a digit), not values"
            )
        if name.startswith(OWN_ENV_PREFIX):
            raise error(
                f"{name}: the gateway's own variables ({OWN_ENV_PREFIX}...) are never passed "
                "to a command (they hold its API token and Redis URL); the step's "
                "REALM_RUN_ID, REALM_WORKFLOW, REALM_STEP and REALM_ATTEMPT always are"
            )
        if name in secrets:
            raise error(
                f"{name} holds a secret this file names (a secret_env); secrets are never "
                "passed to a command"
            )
        if name in names:
            raise error(f"{name} is listed twice")
        names.append(name)
    return tuple(names)


def step_document(step: TakenStep) -> bytes:
    """What every handler receives about its step, as JSON."""
    return orjson.dumps(
        {
            "run_id": step.run_id,
            "workflow": step.workflow,
            "step": step.step,
            "attempt": step.attempt,
            "params": step.params,
            "output": step.output,
        }
    )


Handler = Callable[["TakenStep"], Awaitable[Any]]


@dataclass
class _Shared:
    """What the handlers of every version of the file share: one HTTP client, opened
    on first use."""

    client: Any = None


@dataclass
class HandlerSet:
    """The handlers of ``realm work``: callables for the Runner, plus what they share
    (one HTTP client, closed with ``aclose``)."""

    handlers: dict[str, Handler] = field(default_factory=dict)
    _shared: _Shared = field(default_factory=_Shared)

    async def aclose(self) -> None:
        if self._shared.client is not None:
            await self._shared.client.aclose()
            self._shared.client = None


def build_handlers(
    specs: Mapping[str, Mapping[str, HandlerSpec]],
    *,
    file: str,
    env: Mapping[str, str] | None = None,
    reuse: HandlerSet | None = None,
) -> HandlerSet:
    """Per workflow, per step spec → Runner handlers keyed ``workflow:step``. An http
    handler's secret must be set (and be a whsec_ secret): a one-line ConfigError if not.
    ``reuse``: the set these replace (a reload), whose HTTP client they share."""
    from gateway.signatures.spec import VerifySpec

    env = os.environ if env is None else env
    out = HandlerSet(_shared=reuse._shared if reuse is not None else _Shared())
    for workflow, steps in specs.items():
        for step, spec in steps.items():
            key = f"{workflow}:{step}"
            if isinstance(spec, CommandHandler):
                out.handlers[key] = _command_handler(spec)
                continue
            value = env.get(spec.secret_env)
            field_name = f"handlers.{step}.secret_env"
            if not value:
                raise ConfigError(file, f"environment variable {spec.secret_env} is not set",
                                  section="workflow", name=workflow, field=field_name)  # fmt: skip
            try:
                if not value.startswith(("whsec_", "whsk_")):
                    # A public key (whpk_) verifies; it cannot sign a step's request.
                    raise ValueError("not a signing secret")
                signer = VerifySpec(scheme="standard", secret_env=(spec.secret_env,),
                                    secrets=(value,))  # fmt: skip
            except ValueError:
                raise ConfigError(
                    file, f"{spec.secret_env} does not hold a whsec_ secret (whsec_ + base64) "
                    "or a whsk_ signing key",
                    section="workflow", name=workflow, field=field_name,
                ) from None  # fmt: skip
            out.handlers[key] = _http_handler(spec, signer, out._shared)
    return out


# --------------------------------------------------------------------------- command


def _command_handler(spec: CommandHandler) -> Handler:
    async def handle(step: TakenStep) -> Any:
        return await run_command(spec, step)

    return handle


def command_env(
    spec: CommandHandler, step: TakenStep, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a command runs in: PASSED_ENV and the locale from the runner's
    (``environ``, by default its own), the variables the handler's ``env:`` names, and
    the step's ``REALM_*`` names. Nothing else: the runner's environment holds its
    credentials and the webhooks' secrets, and a failing command that prints its
    environment would store them in the run's error."""
    environ = os.environ if environ is None else environ
    env = {
        name: value
        for name, value in environ.items()
        if name in PASSED_ENV or name.startswith(PASSED_ENV_PREFIXES)
    }
    for name in spec.env:
        # Checked at load; a spec built in Python is held to the same rule here.
        if name in environ and not name.startswith(OWN_ENV_PREFIX):
            env[name] = environ[name]
    env.update(
        REALM_RUN_ID=step.run_id,
        REALM_WORKFLOW=step.workflow,
        REALM_STEP=step.step,
        REALM_ATTEMPT=str(step.attempt),
    )
    return env


class _Command(asyncio.SubprocessProtocol):
    """One command's pipes and exit, as the event loop reports them. Its output is kept
    as it arrives (stdout's head, stderr's tail, both bounded), so the command never
    blocks on a full pipe and nothing has to read the pipes to their end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.drained: asyncio.Future[None] = loop.create_future()  # stdout and stderr at EOF
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 1:
            if len(self.stdout) <= MAX_STDOUT:  # the rest is dropped
                self.stdout += data[: MAX_STDOUT + 1 - len(self.stdout)]
        elif fd == 2:
            self.stderr += data
            del self.stderr[: -4 * ERROR_TAIL]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open and not self.drained.done():
            self.drained.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


async def run_command(spec: CommandHandler, step: TakenStep) -> Any:
    loop = asyncio.get_running_loop()
    try:
        # A session of its own: a timeout or a stop kills the command's whole process
        # group, not just the shell that started it.
        transport, command = await loop.subprocess_exec(
            lambda: _Command(loop),
            *spec.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=command_env(spec, step),
            start_new_session=True,
        )
    except OSError as exc:
        raise HandlerFailed(f"cannot start {spec.argv[0]}: {exc.strerror or exc}") from None
    try:
        stdin = transport.get_pipe_transport(0)
        if isinstance(stdin, asyncio.WriteTransport):
            # Written as the command reads it, then closed. A command that does not
            # read its stdin is its own business (the write is dropped when it exits).
            stdin.write(step_document(step))
            stdin.close()
        # The end is the command's exit, never its pipes closing: a command that closed
        # its stdout and stderr (`exec >/dev/null 2>&1`) or left a process holding them
        # would otherwise never end, its lease extended for ever.
        await asyncio.wait({command.exited}, timeout=spec.timeout)
        if not command.exited.done():
            raise HandlerFailed(f"timed out after {spec.timeout:g}s")
        # What it wrote before exiting is in the pipes: read it, for a moment only.
        await asyncio.wait({command.drained}, timeout=PIPE_GRACE)
        code = transport.get_returncode()
    finally:
        # A timeout, or a cancel (a stop past its grace, the run cancelled): the whole
        # group goes. After a normal exit, what it left in the background stays.
        if not command.exited.done():
            _kill_group(transport.get_pid())
            await asyncio.wait({command.exited}, timeout=5)
        transport.close()
    assert code is not None
    if code != 0:
        why = f"exit {code}" if code > 0 else f"killed by signal {-code}"
        tail = command.stderr.decode("utf-8", "replace").strip()[-ERROR_TAIL:]
        raise HandlerFailed(f"{why}: {tail}" if tail else why)
    return parse_output(bytes(command.stdout))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def parse_output(data: bytes) -> Any:
    """stdout or a reply body → the step's output: JSON when it parses, else the text
    (cut short), None when empty."""
    text = data.strip()
    if not text:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        decoded = text.decode("utf-8", "replace")
        return decoded if len(decoded) <= MAX_TEXT_OUTPUT else decoded[:MAX_TEXT_OUTPUT]


# --------------------------------------------------------------------------- http


def webhook_id(step: TakenStep) -> str:
    """The same for every send of one attempt (a receiver may deduplicate on it),
    new for the next attempt."""
    digest = hashlib.sha256(f"{step.run_id}\0{step.step}\0{step.attempt}".encode()).hexdigest()
    return f"msg_{digest[:32]}"


def _shown_url(url: str) -> str:
    """The URL for errors and logs: no user, password or query (they may hold a token)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _http_handler(spec: HttpHandler, signer: Any, shared: _Shared) -> Handler:
    from gateway.signatures.sign import sign

    async def handle(step: TakenStep) -> Any:
        import httpx

        if shared.client is None:
            shared.client = httpx.AsyncClient(follow_redirects=False)
        body = step_document(step)
        headers = sign(signer, body, time.time(), event_id=webhook_id(step))
        headers["Content-Type"] = "application/json"
        where = _shown_url(spec.url)

        async def post() -> tuple[int, bytes]:
            async with shared.client.stream(
                "POST", spec.url, content=body, headers=headers, timeout=spec.timeout
            ) as reply:
                data = bytearray()
                async for chunk in reply.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_STDOUT:  # bounded: the rest is not read
                        break
                return reply.status_code, bytes(data)

        try:
            # httpx's timeout is per read; wait_for bounds the whole exchange.
            status, data = await asyncio.wait_for(post(), spec.timeout)
        except (TimeoutError, httpx.TimeoutException):
            raise HandlerFailed(f"{where}: no reply in {spec.timeout:g}s") from None
        except httpx.HTTPError as exc:
            raise HandlerFailed(f"{where}: {type(exc).__name__}: {exc}") from None
        if 200 <= status < 300:
            return parse_output(data)
        text = data[:ERROR_TAIL].decode("utf-8", "replace").strip()
        message = f"{where} answered {status}" + (f": {text}" if text else "")
        # 408 and 429 say "not now", not "never": those are retried like a 5xx.
        if 400 <= status < 500 and status not in (408, 429):
            raise PermanentFailure(message)
        raise HandlerFailed(message)

    return handle
