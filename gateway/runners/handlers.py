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
"output"}`` (``output``: the previous step's). A ``command:`` reads it on stdin, with
``REALM_RUN_ID``, ``REALM_WORKFLOW``, ``REALM_STEP`` and ``REALM_ATTEMPT`` in its
environment; exit 0 is success (stdout is the output: JSON when it parses, else the
text), another exit code a failure (the tail of stderr is the error), and a timeout a
failure (its process group is killed). An ``http:`` handler receives it as a POST
signed with Standard Webhooks (``webhook-id`` is stable for a run, step and attempt);
2xx is success (a JSON body is the output), 4xx a failure that ends the run at once
(no retry: the request itself was refused), 5xx, 408, 429 or a timeout a failure that
is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.model.errors import ConfigError

if TYPE_CHECKING:
    from gateway.store.runs import TakenStep

HANDLER_FIELDS = {"command", "http", "secret_env", "timeout"}
DEFAULT_TIMEOUT = 60.0  # seconds a handler may take, unless it says otherwise
MAX_TIMEOUT = 24 * 3600.0
# What a handler may hand back: the store refuses outputs over 64 KiB (encoded); a
# text stdout is cut below that. stdout past MAX_STDOUT is read and dropped, so a
# chatty command cannot fill the runner's memory.
MAX_TEXT_OUTPUT = 60_000
MAX_STDOUT = 1024 * 1024
ERROR_TAIL = 2000  # characters of stderr (or of a reply body) kept as the error
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
    raw: object, *, file: str, workflow: str, steps: tuple[str, ...] | list[str]
) -> dict[str, HandlerSpec]:
    """A workflow's ``handlers:`` mapping → one spec per step. Raises a one-line ConfigError."""

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
            specs[step] = CommandHandler(argv=tuple(argv), timeout=timeout)
            continue
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
class HandlerSet:
    """The handlers of ``realm work``: callables for the Runner, plus what they share
    (one HTTP client, closed with ``aclose``)."""

    handlers: dict[str, Handler] = field(default_factory=dict)
    _client: Any = None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def build_handlers(
    specs: Mapping[str, Mapping[str, HandlerSpec]],
    *,
    file: str,
    env: Mapping[str, str] | None = None,
) -> HandlerSet:
    """Per workflow, per step spec → Runner handlers keyed ``workflow:step``. An http
    handler's secret must be set (and be a whsec_ secret): a one-line ConfigError if not."""
    from gateway.signatures.spec import VerifySpec

    env = os.environ if env is None else env
    out = HandlerSet()
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
                signer = VerifySpec(scheme="standard", secret_env=(spec.secret_env,),
                                    secrets=(value,))  # fmt: skip
            except ValueError:
                raise ConfigError(
                    file, f"{spec.secret_env} does not hold a whsec_ secret (whsec_ + base64)",
                    section="workflow", name=workflow, field=field_name,
                ) from None  # fmt: skip
            out.handlers[key] = _http_handler(spec, signer, out)
    return out


# --------------------------------------------------------------------------- command


def _command_handler(spec: CommandHandler) -> Handler:
    async def handle(step: TakenStep) -> Any:
        return await run_command(spec, step)

    return handle


async def run_command(spec: CommandHandler, step: TakenStep) -> Any:
    env = dict(os.environ)
    env.update(
        REALM_RUN_ID=step.run_id,
        REALM_WORKFLOW=step.workflow,
        REALM_STEP=step.step,
        REALM_ATTEMPT=str(step.attempt),
    )
    try:
        # A session of its own: a timeout or a stop kills the command's whole process
        # group, not just the shell that started it.
        proc = await asyncio.create_subprocess_exec(
            *spec.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise HandlerFailed(f"cannot start {spec.argv[0]}: {exc.strerror or exc}") from None
    try:
        stdout, stderr, _ = await asyncio.wait_for(
            asyncio.gather(_read_head(proc.stdout), _read_tail(proc.stderr), _feed(proc, step)),
            spec.timeout,
        )
        code = await proc.wait()
    except TimeoutError:
        await _kill_group(proc)
        raise HandlerFailed(f"timed out after {spec.timeout:g}s") from None
    except BaseException:
        await _kill_group(proc)  # cancelled (a stop past its grace, a run cancelled)
        raise
    if code != 0:
        why = f"exit {code}" if code > 0 else f"killed by signal {-code}"
        tail = stderr.decode("utf-8", "replace").strip()[-ERROR_TAIL:]
        raise HandlerFailed(f"{why}: {tail}" if tail else why)
    return parse_output(stdout)


async def _feed(proc: asyncio.subprocess.Process, step: TakenStep) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(step_document(step))
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command does not read its stdin: that is its business


async def _read_head(stream: asyncio.StreamReader | None) -> bytes:
    """At most MAX_STDOUT bytes; the rest is read and dropped, so the command never
    blocks on a full pipe and the runner's memory stays bounded."""
    assert stream is not None
    head = bytearray()
    while chunk := await stream.read(65536):
        if len(head) <= MAX_STDOUT:
            head += chunk
    return bytes(head[: MAX_STDOUT + 1])


async def _read_tail(stream: asyncio.StreamReader | None) -> bytes:
    assert stream is not None
    tail = b""
    while chunk := await stream.read(65536):
        tail = (tail + chunk)[-4 * ERROR_TAIL :]
    return tail


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), 5)


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


def _http_handler(spec: HttpHandler, signer: Any, shared: HandlerSet) -> Handler:
    from gateway.signatures.sign import sign

    async def handle(step: TakenStep) -> Any:
        import httpx

        if shared._client is None:
            shared._client = httpx.AsyncClient(follow_redirects=False)
        body = step_document(step)
        headers = sign(signer, body, time.time(), event_id=webhook_id(step))
        headers["Content-Type"] = "application/json"
        where = _shown_url(spec.url)

        async def post() -> tuple[int, bytes]:
            async with shared._client.stream(
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
