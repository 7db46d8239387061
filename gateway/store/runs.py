"""Runs and the inputs that start them: types, limits and checks (no I/O).

The run store (gateway/store/runstore.py) turns these into script calls; the CLI, the
HTTP API and MCP print them (gateway/ingest/replies.py).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.model.config import Workflow
from gateway.model.errors import RealmError
from gateway.model.words import noun

LiveMatch = Literal["use_existing", "fail", "cancel_existing", "queue"]
TerminalMatch = Literal["reuse", "reject", "rerun_if_failed", "rerun"]
ParamsMismatch = Literal["flag", "reject"]
Phase = Literal["running", "completed", "failed", "cancelled", "queued", "scheduled"]

LIVE_MATCH: tuple[str, ...] = ("use_existing", "fail", "cancel_existing", "queue")
TERMINAL_MATCH: tuple[str, ...] = ("reuse", "reject", "rerun_if_failed", "rerun")
PARAMS_MISMATCH: tuple[str, ...] = ("flag", "reject")
PHASES: tuple[str, ...] = ("running", "completed", "failed", "cancelled", "queued", "scheduled")
# Phases of a run that has not started: it waits in its key's queue, or for its due time.
WAITING = ("queued", "scheduled")
MAX_KEY_BYTES = 1024
MAX_BATCH_ITEMS = 10_000
# Runs that may wait in one key's queue unless a trigger's `queue.max` says otherwise.
DEFAULT_QUEUE_MAX = 100
KEEP = ("all", "newest")


@dataclass(frozen=True)
class Flow:
    """How a start waits instead of starting at once (see start_run.lua's ARGV[15]).

    ``limit``: live runs per key under on_live_match ``queue`` before a start queues;
    ``queue_max``: runs that may wait (keep ``all``); ``keep``: ``all``, or ``newest``
    (one waits: a later start cancels it and waits instead); ``debounce_ms``: the run
    is scheduled that long after the start, and each later start of its key while it is
    scheduled replaces its params and pushes it back, never past ``max_wait_ms`` (0: no
    bound) from its creation; ``delay_ms``: every run is scheduled that long after its
    start."""

    limit: int = 1
    queue_max: int = DEFAULT_QUEUE_MAX
    keep: str = "all"
    debounce_ms: int = 0
    max_wait_ms: int = 0
    delay_ms: int = 0

    def argument(self) -> str:
        return (
            f"{self.limit} {self.queue_max} {self.keep} {self.debounce_ms} "
            f"{self.max_wait_ms} {self.delay_ms}"
        )

    @property
    def schedules(self) -> bool:
        return self.debounce_ms > 0 or self.delay_ms > 0


@dataclass(frozen=True)
class StartResult:
    """What a start decided. ``deduped`` is False exactly when this call started ``run_id``."""

    run_id: str
    workflow: str
    deduped: bool
    phase: str
    next_step: str | None
    rerun_of: str | None = None
    params_mismatch: bool = False
    # Which setting made this start supersede ``rerun_of``: on_live_match or on_terminal_match.
    superseded_by: str | None = None
    # A scheduled run's due time (server ms): a debounced or delayed start.
    due_ms: int | None = None
    # This start moved the key's scheduled run (debounce): its params are now this start's.
    debounced: bool = False


@dataclass(frozen=True)
class BatchEntry:
    """One item's outcome in a batch start: a result, or the refusal for that item."""

    index: int
    idempotency_key: str | None
    result: StartResult | None = None
    error: RealmError | None = None


@dataclass(frozen=True)
class TakenStep:
    """A ready step handed to a runner under a lease (RunStore.take_steps)."""

    run_id: str
    workflow: str
    step: str
    attempt: int  # 1 on the first try
    params: Mapping[str, Any]
    output: Any  # the previous step's output; None for the first step
    lease: str  # the token to pass back to complete_step, fail_step, extend_lease
    lease_until_ms: int  # server time
    entry_id: str  # the stream entry


@dataclass(frozen=True)
class StepFailure:
    """What a failed attempt led to (RunStore.fail_step): a retry, or the run failed."""

    run_id: str
    phase: str  # 'running' while a retry is due; 'failed' after the last attempt
    attempt: int
    retry_at_ms: int | None


# A step's output is stored on the run and handed to the next step: bounded.
MAX_OUTPUT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Run:
    id: str
    workflow: str
    key: str | None
    phase: str
    step: str | None
    steps: tuple[str, ...]
    params: Mapping[str, Any]
    created_ms: int
    updated_ms: int
    ended_ms: int | None
    rerun_of: str | None
    error: str | None
    due_ms: int | None = None  # a scheduled run's due time (server ms)

    @property
    def next_step(self) -> str | None:
        """The step a runner should do next; None once the run has ended."""
        return self.step if self.phase == "running" else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.id,
            "workflow": self.workflow,
            "idempotency_key": self.key,
            "phase": self.phase,
            "next_step": self.next_step,
            "steps": list(self.steps),
            "params": dict(self.params),
            "created_ms": self.created_ms,
            "updated_ms": self.updated_ms,
            "ended_ms": self.ended_ms,
            "rerun_of": self.rerun_of,
            "error": self.error,
            **({"due_ms": self.due_ms} if self.due_ms is not None else {}),
        }


@dataclass(frozen=True)
class StepResult:
    run_id: str
    phase: str
    next_step: str | None


def canonical_params(params: Mapping[str, Any]) -> bytes:
    """Params as stored and compared: JSON with sorted keys, no whitespace."""
    return orjson.dumps(params, option=orjson.OPT_SORT_KEYS)


def fingerprint_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_from_hash(data: Mapping[bytes, bytes]) -> Run:
    f = {text_of(k): text_of(v) for k, v in data.items()}
    ended, due = f.get("ended_ms"), f.get("due_ms")
    return Run(
        id=f["id"],
        workflow=f["workflow"],
        key=f.get("key") or None,
        phase=f["phase"],
        step=f.get("step") or None,
        steps=tuple(orjson.loads(f.get("steps", "[]"))),
        params=orjson.loads(f.get("params", "{}")),
        created_ms=int(f.get("created_ms", 0)),
        updated_ms=int(f.get("updated_ms", 0)),
        ended_ms=int(ended) if ended else None,
        rerun_of=f.get("rerun_of") or None,
        error=f.get("error") or None,
        due_ms=int(due) if due and f["phase"] == "scheduled" else None,
    )


def prepare_items(
    wf: Workflow, items: Sequence[Any]
) -> tuple[list[tuple[str | None, bytes, str]], list[tuple[int, str]]]:
    """Each item as (key, params JSON, fingerprint), and every item that fails, why."""
    prepared: list[tuple[str | None, bytes, str]] = []
    failures: list[tuple[int, str]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            failures.append((i, "must be an object with 'params' and 'idempotency_key'"))
            continue
        unknown = sorted(set(item) - {"params", "idempotency_key"})
        params = item.get("params", {})
        key = item.get("idempotency_key")
        reasons: list[str] = []
        if unknown:
            reasons.append(f"unknown {noun(len(unknown), 'field')} {unknown}")
        if key is not None and (
            not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES
        ):
            reasons.append(f"idempotency_key must be a non-empty string of at most "
                           f"{MAX_KEY_BYTES} bytes")  # fmt: skip
        if not isinstance(params, Mapping):
            reasons.append("params must be a JSON object")
        else:
            reasons += wf.params_errors(params)
        if reasons:
            failures.append((i, "; ".join(reasons)))
            continue
        try:
            params_json = canonical_params(params)
        except TypeError as exc:
            failures.append((i, f"params must be JSON: {exc}"))
            continue
        prepared.append((key, params_json, fingerprint_of(params_json)))
    return prepared, failures


def encode_params(params: Mapping[str, Any]) -> bytes:
    if not isinstance(params, Mapping):
        raise RealmError("VALIDATION_PARAMS", "params must be a JSON object")
    try:
        return canonical_params(params)
    except TypeError as exc:
        raise RealmError("VALIDATION_PARAMS", f"params must be JSON: {exc}") from None


def check_policies(live: str, terminal: str, mismatch: str) -> None:
    for name, value, allowed in (
        ("on_live_match", live, LIVE_MATCH),
        ("on_terminal_match", terminal, TERMINAL_MATCH),
        ("on_params_mismatch", mismatch, PARAMS_MISMATCH),
    ):
        if value not in allowed:
            raise RealmError(
                "VALIDATION_PARAMS", f"{name} must be one of {', '.join(allowed)} (got {value!r})"
            )


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES:
        raise RealmError(
            "VALIDATION_PARAMS",
            f"idempotency_key must be a non-empty string of at most {MAX_KEY_BYTES} bytes",
        )


MAX_REQUEST_ID_BYTES = 200
# Batch run ids are UUIDs derived from the batch id (RFC 4122 version 5), in a
# namespace of the gateway's own, so a retried batch names the same runs.
_BATCH_NAMESPACE = uuid.UUID("5b0f6f0e-3c1d-4a52-9d7e-6a1f2b8c4d31")


def check_request_id(value: str, field: str = "request_id") -> None:
    """A caller's id for one call (a start's request id, a batch id)."""
    if not isinstance(value, str) or not value or len(value.encode()) > MAX_REQUEST_ID_BYTES:
        raise RealmError(
            "VALIDATION_PARAMS",
            f"{field} must be a non-empty string of at most {MAX_REQUEST_ID_BYTES} bytes",
        )


def batch_run_id(workflow: str, batch_id: str, index: int) -> str:
    """The run id of item ``index`` of batch ``batch_id``: the same on every retry."""
    return str(uuid.uuid5(_BATCH_NAMESPACE, f"{workflow}\n{batch_id}\n{index}"))


class _RandomPool:
    """Random bytes from ``os.urandom``, fetched 4 KiB at a time: one system call per
    256 run ids rather than one per id (measured: a few per cent of a delivery)."""

    SIZE = 4096

    def __init__(self) -> None:
        self._data = b""
        self._pos = 0
        # A forked child must not hand out the ids its parent already has.
        os.register_at_fork(after_in_child=self._drop)

    def take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            self._data, self._pos = os.urandom(self.SIZE), 0
        chunk = self._data[self._pos : self._pos + n]
        self._pos += n
        return chunk

    def _drop(self) -> None:
        self._data, self._pos = b"", 0


_random = _RandomPool()


def new_run_id() -> str:
    """A random (version 4) UUID, as text. Formatted here rather than by
    ``str(uuid.uuid4())``, which builds a UUID object on the way and makes a system
    call for its 16 bytes: a third of the cost, on every run start."""
    raw = bytearray(_random.take(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def check_run_id(run_id: str) -> None:
    try:
        uuid.UUID(run_id)
    except (ValueError, TypeError, AttributeError):
        raise RealmError("NOT_FOUND_RUN", f"No run '{run_id}': run ids are UUIDs.") from None


def text_of(value: Any) -> str:
    """A Redis reply value as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
