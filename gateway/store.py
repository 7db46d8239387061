"""Typed async wrappers over the Lua scripts: the run-start semantics of DESIGN §3.

Expected outcomes (a new run, a deduplicated one) are values; refusals by
policy and bad input raise ``RealmError`` with the code of DESIGN §4; Redis
trouble raises ``StoreUnavailable`` (the caller answers 503 and the sender
retries, which deduplicates).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson
from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from gateway.cluster_client import ping_every_primary
from gateway.config import Config, Workflow
from gateway.durability import confirmed_script
from gateway.errors import ConfigError, RealmError, StoreUnavailable
from gateway.keys import Keys, partition_keys, partition_of, partition_of_run, run_id_in
from gateway.pipeline import script_pipeline
from gateway.policy import Decision, KeyState, decide
from gateway.runs import (
    MAX_BATCH_ITEMS,
    MAX_OUTPUT_BYTES,
    PHASES,
    BatchEntry,
    LiveMatch,
    ParamsMismatch,
    Run,
    StartResult,
    StepFailure,
    StepResult,
    TakenStep,
    TerminalMatch,
    batch_run_id,
    check_key,
    check_policies,
    check_request_id,
    check_run_id,
    encode_params,
    fingerprint_of,
    new_run_id,
    prepare_items,
    run_from_hash,
    text_of,
)
from gateway.scripts import Scripts
from gateway.sentinel import sentinel_pipeline

# Script calls one start may make: each `need_run` reply names a run the next call
# must pass, and a concurrent start on the same key can move it again in between.
# Each round of calls lets one of the racing starts through, so a start needs at most
# one call more than the starts racing it; the deadline bounds the rest.
MAX_CLAIM_CALLS = 256
# The runners' consumer group on every stream (the Lua scripts name it too).
RUNNERS_GROUP = "runners"
# An entry pending this long is looked at again (XAUTOCLAIM); take_step.lua hands it
# out only when the run's lease on it has lapsed or its retry is due.
AUTOCLAIM_IDLE_MS = 1_000
# Reads of one stream per take_steps call (stale entries are skipped in between).
TAKE_ROUNDS = 16
# A failed attempt's backoff doubles up to this; an error text is kept up to this.
MAX_BACKOFF_MS = 300_000
MAX_ERROR_CHARS = 4_000

T = TypeVar("T")


@dataclass(frozen=True)
class Marker:
    """A marker key a start reads and writes in its claim (see start_run.lua): ``mode``
    is ``same`` (a request id), ``dedupe`` (an event id) or ``replay`` (a body digest,
    tagged with the event id it came with)."""

    name: Callable[[Keys], str]  # the marker's key, in the claim's partition
    mode: str
    tag: str = ""


class RunStore:
    """Run starts and run state for the workflows of one config, in one Redis."""

    def __init__(
        self,
        redis: Redis,
        config: Config,
        *,
        timeout: float | None = None,
        pipelined: bool = False,
    ) -> None:
        """``pipelined``: send run starts on one pipelined connection of the store's
        own (see gateway/pipeline.py); worth it under concurrent load, as in the
        listener."""
        self.redis = redis
        self.config = config
        self.prefix = config.settings.key_prefix
        self.timeout = config.settings.redis_timeout if timeout is None else timeout
        self.scripts = Scripts(redis)
        # settings.durability: a mutating script counts only once its writes are
        # confirmed on replicas (gateway/pipeline.py). A cluster's scripts then always
        # go through the pipeline (redis-py would send WAIT to every node).
        self._durability = config.settings.durability
        self._pipeline = script_pipeline(redis, self.timeout, pipelined, self._durability)
        if pipelined and self._pipeline is None:
            # Under Sentinel: a pipeline that asks the sentinels for the primary on
            # every (re)connect and leaves a demoted one (gateway/sentinel.py).
            self._pipeline = sentinel_pipeline(redis, self.timeout, self._durability)
        self._groups: set[str] = set()  # workflows whose runner groups exist
        self._autoclaim: dict[str, str] = {}  # per stream: where XAUTOCLAIM goes on
        self._keys = {
            name: partition_keys(self.prefix, name, wf.partitions)
            for name, wf in config.workflows.items()
        }

    def with_config(self, config: Config) -> RunStore:
        """This store serving another version of the config (a reload), on the same
        connections. What the connections depend on (the key prefix, the timeout,
        durability) must be unchanged: gateway/reload.py refuses a file that changes it."""
        other = copy.copy(self)
        other.config = config
        other._keys = {
            name: partition_keys(self.prefix, name, wf.partitions)
            for name, wf in config.workflows.items()
        }
        return other

    def keys(self, workflow: str) -> Keys:
        """The Keys of an unpartitioned workflow (of partition 0 of a partitioned one)."""
        return self.partitions(workflow)[0]

    def partitions(self, workflow: str) -> list[Keys]:
        """The Keys of each of the workflow's partitions (one unless ``partitions: N``)."""
        return self._keys.get(workflow) or [Keys(self.prefix, workflow)]

    def keys_for_key(self, workflow: str, key: str) -> Keys:
        """The partition an idempotency key lives in: always the same one."""
        parts = self.partitions(workflow)
        return parts[partition_of(key, len(parts))]

    def keys_for_run(self, workflow: str, run_id: str) -> Keys:
        """The partition a run lives in, named by its id."""
        parts = self.partitions(workflow)
        return parts[partition_of_run(run_id, len(parts))]

    # -- starting runs -----------------------------------------------------------------

    async def start_run(
        self,
        workflow: str,
        params: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        on_live_match: LiveMatch = "use_existing",
        on_terminal_match: TerminalMatch = "reuse",
        on_params_mismatch: ParamsMismatch = "flag",
        *,
        fingerprint: str | None = None,
        run_id: str | None = None,
        bounded: bool = True,
        request_id: str | None = None,
        markers: Sequence[Marker] = (),
    ) -> StartResult:
        """Start a run, or return the run that owns ``idempotency_key`` (DESIGN §3).

        ``fingerprint`` is what a repeat is compared with to flag a params
        mismatch; by default the digest of the canonical params. ``run_id`` is
        for callers that must choose the id themselves; by default a new UUID.
        ``request_id``: a retry with the same id (within the workflow's retention)
        gets the first call's result, whatever happened to the key meanwhile; a call
        that was refused recorded nothing, so its retry is decided afresh.
        ``markers`` (see ``event_marker`` and ``replay_marker``): events and bodies
        this start answers for, so that their redelivery is deduplicated.
        ``bounded=False`` skips the store's deadline, for a caller that bounds the
        call with a timer of its own (the webhook path, one timer per delivery).
        """
        wf = self.config.workflow(workflow)
        params = {} if params is None else params
        check_policies(on_live_match, on_terminal_match, on_params_mismatch)
        wf.check_params(params)
        params_json = encode_params(params)
        if idempotency_key is not None:
            check_key(idempotency_key)
        parts = self.partitions(workflow)
        if request_id is not None:
            check_request_id(request_id)
        # The partition: the key's (always the same one), else a request id's (its
        # retry must find the first call's record), else any, to spread the load.
        if idempotency_key is not None:
            keys = self.keys_for_key(workflow, idempotency_key)
        elif request_id is not None:
            keys = parts[partition_of(request_id, len(parts))]
        elif run_id is not None:
            keys = self.keys_for_run(workflow, run_id)
        else:
            keys = random.choice(parts)
        if request_id is not None:
            markers = [*markers, Marker(lambda k: k.request(request_id), "same")]
        if run_id is None:
            new_id = new_run_id()
            if keys.partition is not None:
                new_id = run_id_in(new_id, keys.partition)
        elif keys.partition is not None and self.keys_for_run(workflow, run_id) != keys:
            raise RealmError(
                "VALIDATION_PARAMS",
                f"run_id must end in {keys.partition:04x}: the partition of its key",
            )
        else:
            new_id = run_id
        run_key = keys.run(new_id)
        if idempotency_key is None:
            pointer = keyruns = run_key
        else:
            pointer, keyruns = keys.pointer(idempotency_key), keys.key_runs(idempotency_key)
        head = [run_key, keys.runs(), keys.stream(), pointer, keyruns]
        tail = [m.name(keys) for m in markers]
        argv: list[Any] = [
            new_id,
            workflow,
            idempotency_key or "",
            params_json,
            fingerprint or fingerprint_of(params_json),
            wf.steps_json,
            on_live_match,
            on_terminal_match,
            on_params_mismatch,
            wf.retention_ms,
            wf.steps[0],
        ]
        marks = [x for m in markers for x in (m.mode, m.tag)]
        async with self.deadline() if bounded else contextlib.nullcontext():
            named = {"pointer": "", "marker": ""}
            for _ in range(MAX_CLAIM_CALLS):
                # A repeat needs the hash of the run it names, and keys are never
                # built inside Lua: the script answers `need_run` naming it, and this
                # call goes again with it (one more round trip, on repeats only).
                cur, mrun = named["pointer"], named["marker"]
                script_keys = [
                    *head,
                    keys.run(cur) if cur else run_key,
                    keys.run(mrun) if mrun else run_key,
                    keys.key_index(),
                    *tail,
                ]
                reply = await self._retrying(
                    lambda k=script_keys, a=[*argv, cur, mrun, *marks]: self._run_script(
                        self.scripts.start_run, k, a
                    )
                )
                if reply[0] != b"need_run":
                    break
                named[text_of(reply[2])] = text_of(reply[1])
            else:
                # Concurrent starts kept moving the key between two calls.
                raise StoreUnavailable(
                    f"the key kept moving under concurrent starts ({MAX_CLAIM_CALLS} calls); retry"
                )
        return _start_result(workflow, idempotency_key, on_live_match, on_terminal_match, reply)

    def event_marker(self, workflow: str, trigger: str, event_id: str) -> Marker:
        """A redelivery of this event (to this trigger) gets the run the first delivery
        got, deduplicated, whatever the key's policy says about other events."""
        return Marker(lambda k: k.event(trigger, event_id), "dedupe")

    def replay_marker(self, workflow: str, trigger: str, digest: str, event_id: str) -> Marker:
        """The replay guard: this verified body seen again under another event id is
        deduplicated onto the first one's run; under the same event id, the key's
        policy decides (a real redelivery)."""
        return Marker(lambda k: k.body(trigger, digest), "replay", event_id)

    async def start_run_batch(
        self,
        workflow: str,
        items: Sequence[Mapping[str, Any]],
        on_live_match: LiveMatch = "use_existing",
        on_terminal_match: TerminalMatch = "reuse",
        on_params_mismatch: ParamsMismatch = "flag",
        *,
        batch_id: str | None = None,
    ) -> list[BatchEntry]:
        """Start many runs of one workflow; one entry per item, in order.

        Every item is checked first: if any fails, nothing starts
        (``VALIDATION_BATCH_ITEMS``). A key repeated within the batch is
        deduplicated against its first item. All items of a workflow share one
        hash slot, so the whole batch is one script call: all or nothing. A
        partitioned workflow takes one such call per partition its items fall in;
        if one fails, the batch is StoreUnavailable (503) and its retry with the same
        ``batch_id`` completes it.
        ``batch_id``: item i's run id (and partition, for a keyless item) is derived
        from it, so a retry of the same batch after an unknown outcome (503) starts
        nothing twice.
        """
        wf = self.config.workflow(workflow)
        check_policies(on_live_match, on_terminal_match, on_params_mismatch)
        if batch_id is not None:
            check_request_id(batch_id, "batch_id")
        if not isinstance(items, Sequence) or isinstance(items, str | bytes):
            raise RealmError("VALIDATION_BATCH_ITEMS", "items must be a list")
        if not 1 <= len(items) <= MAX_BATCH_ITEMS:
            raise RealmError(
                "VALIDATION_BATCH_ITEMS", f"a batch holds 1 to {MAX_BATCH_ITEMS} items"
            )
        prepared, failures = prepare_items(wf, items)
        if failures:
            raise RealmError(
                "VALIDATION_BATCH_ITEMS",
                f"start_run_batch: {len(failures)} item(s) failed schema validation\n"
                + "".join(f"  - item {i}: {reason}\n" for i, reason in failures)
                + "One or more items failed schema validation. No runs were created.",
            )

        first_of: dict[str, int] = {}
        to_send: list[int] = []
        for i, (key, _, _) in enumerate(prepared):
            if key is None or key not in first_of:
                if key is not None:
                    first_of[key] = i
                to_send.append(i)
        # Each item's partition: its key's, else one its batch id names (a retry
        # must land where the first try did), else any. One call per partition.
        parts = self.partitions(workflow)
        by_partition: dict[int, list[int]] = {}
        ids: dict[int, str] = {}
        for i in to_send:
            key = prepared[i][0]
            if key is not None:
                p = partition_of(key, len(parts))
            elif batch_id is not None:
                p = partition_of(f"{batch_id}\n{i}", len(parts))
            else:
                p = random.randrange(len(parts))
            by_partition.setdefault(p, []).append(i)
            run_id = batch_run_id(workflow, batch_id, i) if batch_id else new_run_id()
            ids[i] = run_id if parts[p].partition is None else run_id_in(run_id, p)
        outcomes: dict[int, StartResult | RealmError] = {}
        common = [workflow, wf.steps_json, on_live_match, on_terminal_match,
                  on_params_mismatch, wf.retention_ms, wf.steps[0]]  # fmt: skip
        async with self.deadline():
            for p, items_here in sorted(by_partition.items()):
                reply = await self._batch_call(parts[p], items_here, prepared, ids, common)
                for n, i in enumerate(items_here):
                    group = reply[6 * n : 6 * n + 6]
                    try:
                        outcomes[i] = _start_result(
                            workflow, prepared[i][0], on_live_match, on_terminal_match, group
                        )
                    except StoreUnavailable:
                        raise
                    except RealmError as exc:
                        outcomes[i] = exc

        entries: list[BatchEntry] = []
        for i, (key, _, _) in enumerate(prepared):
            first = first_of.get(key, i) if key is not None else i
            outcome = outcomes[first]
            if isinstance(outcome, StartResult) and first != i:
                outcome = replace(
                    outcome, deduped=True, rerun_of=None, superseded_by=None,
                    params_mismatch=prepared[i][2] != prepared[first][2],
                )  # fmt: skip
            if isinstance(outcome, RealmError):
                entries.append(BatchEntry(i, key, error=outcome))
            else:
                entries.append(BatchEntry(i, key, result=outcome))
        return entries

    async def _batch_call(
        self,
        keys: Keys,
        to_send: list[int],
        prepared: list[tuple[str | None, bytes, str]],
        ids: dict[int, str],
        common: list[Any],
    ) -> list[Any]:
        """start_batch.lua for the items of one partition: one atomic call (after the
        `need_run` rounds that name the runs its repeats point at, which write nothing)."""
        named: dict[int, str] = {}
        for _ in range(MAX_CLAIM_CALLS):
            script_keys = [keys.runs(), keys.stream(), keys.key_index()]
            argv: list[Any] = list(common)
            for i in to_send:
                key, params_json, fingerprint = prepared[i]
                run_key = keys.run(ids[i])
                if key is None:
                    script_keys += [run_key, run_key, run_key, run_key]
                else:
                    script_keys += [run_key, keys.pointer(key), keys.key_runs(key),
                                    keys.run(named[i]) if i in named else run_key]  # fmt: skip
                argv += [ids[i], key or "", params_json, fingerprint, named.get(i, "")]
            reply = await self._retrying(
                lambda k=script_keys, a=argv: self._run_script(self.scripts.start_batch, k, a)
            )
            if reply[0] != b"need_run":
                return reply
            # Nothing was written: name the runs the repeats point at, and go again.
            for n in range(1, len(reply), 2):
                named[to_send[int(reply[n]) - 1]] = text_of(reply[n + 1])
        raise StoreUnavailable(
            f"keys kept moving under concurrent starts ({MAX_CLAIM_CALLS} calls); retry"
        )

    async def preview_start(
        self,
        workflow: str,
        idempotency_key: str | None,
        on_live_match: str,
        on_terminal_match: str,
        on_params_mismatch: str,
        fingerprint: str,
        markers: Sequence[Marker] = (),
    ) -> tuple[Decision, KeyState | None]:
        """What ``start_run`` would decide now, and the key's state; writes nothing.
        A marker that the claim would find (a redelivered event, a replayed body)
        decides first, as in the script: the run it names, deduplicated."""
        self.config.workflow(workflow)
        keys = (
            self.keys(workflow)
            if idempotency_key is None
            else self.keys_for_key(workflow, idempotency_key)
        )
        async with self.deadline():
            for marker in markers:
                run, tag = await self._retrying(
                    lambda m=marker: self.redis.hmget(m.name(keys), ["run", "tag"])
                )
                if run is None or (marker.mode == "replay" and text_of(tag) == marker.tag):
                    continue
                run_key = keys.run(text_of(run))
                phase = await self._retrying(lambda k=run_key: self.redis.hget(k, "phase"))
                if phase is not None:
                    return "existing", KeyState(text_of(run), text_of(phase), "")
        if idempotency_key is None:
            return "start", None
        pointer = keys.pointer(idempotency_key)
        async with self.deadline():
            run, phase, fp = await self._retrying(
                lambda: self.redis.hmget(pointer, ["run", "phase", "fp"])
            )
        state = None if run is None else KeyState(text_of(run), text_of(phase), text_of(fp))
        return (
            decide(state, on_live_match, on_terminal_match, on_params_mismatch, fingerprint),
            state,
        )

    # -- reading runs ------------------------------------------------------------------

    async def get_run(self, run_id: str, workflow: str | None = None) -> Run:
        """The run with this id; ``NOT_FOUND_RUN`` if no workflow has it."""
        check_run_id(run_id)
        names = [workflow] if workflow else list(self.config.workflows)
        if workflow:
            self.config.workflow(workflow)
        run_keys = [self.keys_for_run(name, run_id).run(run_id) for name in names]
        async with self.deadline():
            found = await self._retrying(lambda: self._hgetall_many(run_keys))
        for data in found:
            if data:
                return run_from_hash(data)
        raise _run_not_found(run_id)

    async def list_runs(
        self,
        workflow: str,
        key: str | None = None,
        phase: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Run], str | None]:
        """Runs of a workflow, newest first, optionally of one key and one phase.

        Returns the page and the cursor for the next one (None when done). The cursor
        names a position, the last run shown (its index score and id): runs started
        while a caller pages come before it and never shift a later page, so every
        run is seen once. Runs that expired are skipped; the sweep drops them from
        the indexes."""
        return await self.list_runs_of([workflow], key, phase, limit, cursor)

    async def list_runs_of(
        self,
        workflows: Sequence[str],
        key: str | None = None,
        phase: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[Run], str | None]:
        """``list_runs`` over several workflows at once, merged newest first: every
        index is scored by start time (µs, the server's clock), so one position is a
        position in all of them."""
        for workflow in workflows:
            self.config.workflow(workflow)
        if phase is not None and phase not in PHASES:
            raise RealmError("VALIDATION_PARAMS", f"phase must be one of {', '.join(PHASES)}")
        if not 1 <= limit <= 1000:
            raise RealmError("VALIDATION_PARAMS", "limit must be between 1 and 1000")
        after = parse_position(cursor)
        sources = [
            (keys, keys.runs() if key is None else keys.key_runs(key))
            for workflow in workflows
            for keys in (
                self.partitions(workflow) if key is None else [self.keys_for_key(workflow, key)]
            )
        ]
        async with self.deadline():
            return await _RunPager(self, sources, phase, limit, after).page()

    # -- moving runs on ----------------------------------------------------------------

    async def complete_step(
        self,
        run_id: str,
        step: str,
        *,
        lease: str | None = None,
        output: Any = None,
        entry_id: str = "",
        op_id: str | None = None,
    ) -> StepResult:
        """Record that ``step`` finished; the run moves to its next step or completes.

        ``lease``: a runner's token (RunStore.take_steps); the result is recorded only
        while that lease is the run's (else STATE_STEP_NOT_CURRENT: another runner took
        the step after the lease lapsed). Without one, an operator's report, no lease
        is checked. ``output`` (JSON, at most MAX_OUTPUT_BYTES) is stored on the run and
        handed to the next step. A result for a run that ended (STATE_RUN_NOT_LIVE) or
        moved past the step (STATE_STEP_NOT_CURRENT) is discarded.

        ``op_id`` names this call (by default a new one): a resend after a lost reply,
        by the store or by a caller passing the same id within a few minutes, reports
        what the first attempt did."""
        output_json = "" if output is None else _encode_output(output)
        run, wf, keys = await self._located(run_id)
        op = keys.op(_op_id(op_id))
        script_keys = [keys.run(run_id), keys.stream(), op, *self._key_keys(keys, run)]
        argv = [run_id, step, wf.retention_ms, lease or "", output_json, entry_id]
        async with self.deadline():
            reply = await self._retrying(
                lambda: self._run_script(self.scripts.complete_step, script_keys, argv)
            )
        outcome, phase, current = (text_of(x) for x in reply[:3])
        _raise_refusal(run_id, step, outcome, phase, current)
        return StepResult(run_id, phase, current if outcome == "advanced" else None)

    # -- runners -----------------------------------------------------------------------

    async def ensure_groups(self, workflow: str) -> None:
        """Create the runners' consumer group on each of the workflow's streams (from
        their first entry, so steps queued before any runner came are handed out).
        Idempotent; ``take_steps`` calls it once per workflow."""
        async with self.deadline():
            for keys in self.partitions(workflow):
                try:
                    await self._retrying(
                        lambda k=keys: self.redis.xgroup_create(
                            k.stream(), RUNNERS_GROUP, id="0", mkstream=True
                        )
                    )
                except redis_errors.ResponseError as exc:
                    if not str(exc).startswith("BUSYGROUP"):
                        raise
        self._groups.add(workflow)

    async def take_steps(
        self,
        workflow: str,
        runner: str,
        *,
        count: int = 1,
        lease_ms: int | None = None,
    ) -> list[TakenStep]:
        """Up to ``count`` ready steps of ``workflow`` for ``runner``, each under a lease
        (``lease_ms``, by default the workflow's ``lease``): first steps whose lease
        lapsed or whose retry is due (XAUTOCLAIM), then new ones (XREADGROUP). A step of
        a run that ended or moved on is acknowledged and never handed out; one whose
        lease is held is left alone. Non-blocking: [] when nothing is ready."""
        wf = self.config.workflow(workflow)
        if not 1 <= count <= 1000:
            raise RealmError("VALIDATION_PARAMS", "count must be between 1 and 1000")
        if workflow not in self._groups:
            await self.ensure_groups(workflow)
        lease_ms = wf.lease_ms if lease_ms is None else lease_ms
        taken: list[TakenStep] = []
        parts = self.partitions(workflow)
        start = random.randrange(len(parts))  # runners spread over the partitions
        async with self.deadline():
            for keys in parts[start:] + parts[:start]:
                # Entries of ended runs are acknowledged and skipped: read on past
                # them (bounded), so stale entries never hide a ready step.
                for _ in range(TAKE_ROUNDS):
                    if len(taken) >= count:
                        break
                    entries = await self._claim_entries(keys, runner, count - len(taken))
                    if not entries:
                        break
                    for entry_id, fields in entries:
                        step = await self._take(keys, workflow, entry_id, fields, lease_ms)
                        if step is not None:
                            taken.append(step)
        return taken

    async def _claim_entries(
        self, keys: Keys, runner: str, count: int
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        stream = keys.stream()
        # Entries pending past a short idle time: a lapsed lease or a due retry (the
        # run's lease_until decides, in take_step.lua). The cursor goes on where this
        # process left off, so a long list of held leases does not hide later ones.
        cursor = self._autoclaim.get(stream, "0-0")
        reply = await self._retrying(
            lambda: self.redis.xautoclaim(
                stream, RUNNERS_GROUP, runner, AUTOCLAIM_IDLE_MS, start_id=cursor, count=count
            )
        )
        self._autoclaim[stream] = text_of(reply[0])
        entries = [(text_of(i), f) for i, f in reply[1] if f]
        if len(entries) < count:
            read = await self._retrying(
                lambda: self.redis.xreadgroup(
                    RUNNERS_GROUP, runner, {stream: ">"}, count=count - len(entries)
                )
            )
            for _, found in read or []:
                entries += [(text_of(i), f) for i, f in found if f]
        return entries

    async def _take(
        self,
        keys: Keys,
        workflow: str,
        entry_id: str,
        fields: Mapping[bytes, bytes],
        lease_ms: int,
    ) -> TakenStep | None:
        run_id, step = text_of(fields.get(b"run_id", b"")), text_of(fields.get(b"step", b""))
        token = new_run_id()
        reply = await self._retrying(
            lambda: self._run_script(
                self.scripts.take_step,
                [keys.run(run_id), keys.stream()],
                [entry_id, step, token, lease_ms],
            )
        )
        outcome, attempt, params, output, until = (text_of(x) for x in reply)
        if outcome != "taken":
            return None
        return TakenStep(
            run_id=run_id,
            workflow=workflow,
            step=step,
            attempt=int(attempt),
            params=orjson.loads(params) if params else {},
            output=orjson.loads(output) if output else None,
            lease=token,
            lease_until_ms=int(until),
            entry_id=entry_id,
        )

    async def fail_step(
        self,
        run_id: str,
        step: str,
        error: str,
        *,
        lease: str,
        entry_id: str = "",
        op_id: str | None = None,
    ) -> StepFailure:
        """A runner's attempt at ``step`` failed with ``error``: while attempts are left
        (the workflow's ``max_attempts``), the step is taken again after a backoff
        (``retry_backoff``, doubling each attempt, at most 5 minutes); after the last,
        the run fails with the error. Discarded like complete_step's results."""
        run, wf, keys = await self._located(run_id)
        script_keys = [keys.run(run_id), keys.stream(), keys.op(_op_id(op_id)),
                       *self._key_keys(keys, run)]  # fmt: skip
        argv = [run_id, step, wf.retention_ms, lease, error[:MAX_ERROR_CHARS], wf.max_attempts,
                wf.retry_backoff_ms, MAX_BACKOFF_MS, entry_id]  # fmt: skip
        async with self.deadline():
            reply = await self._retrying(
                lambda: self._run_script(self.scripts.step_failed, script_keys, argv)
            )
        outcome, phase, current, attempt, retry_at = (text_of(x) for x in reply)
        _raise_refusal(run_id, step, outcome, phase, current)
        return StepFailure(
            run_id, phase, int(attempt), int(retry_at) if outcome == "retry" else None
        )

    async def extend_lease(
        self, run_id: str, step: str, lease: str, lease_ms: int | None = None, entry_id: str = ""
    ) -> int:
        """Keep a step in hand (a heartbeat): the lease lasts ``lease_ms`` (by default the
        workflow's ``lease``) from now. Returns the new deadline (server ms); refused
        like complete_step when the step is no longer this runner's."""
        _, wf, keys = await self._located(run_id)
        ms = wf.lease_ms if lease_ms is None else lease_ms
        async with self.deadline():
            reply = await self._retrying(
                lambda: self._run_script(
                    self.scripts.extend_lease,
                    [keys.run(run_id), keys.stream()],
                    [step, lease, ms, entry_id],
                )
            )
        outcome, phase, current, until = (text_of(x) for x in reply)
        _raise_refusal(run_id, step, outcome, phase, current)
        return int(until)

    async def fail_run(
        self,
        run_id: str,
        error: str = "",
        *,
        lease: str | None = None,
        op_id: str | None = None,
    ) -> Run:
        """End a live run as failed. A run that already ended is refused: STATE_RUN_NOT_LIVE.
        ``lease``: a runner's token; refused (STATE_STEP_NOT_CURRENT) when another runner
        holds the step. ``op_id``: as for ``complete_step``."""
        outcome, phase = await self._end_run(run_id, "failed", error, op_id, lease or "")
        if outcome == "not_live":
            raise _not_live(run_id, phase)
        if outcome == "lease_lost":
            raise _lease_lost(run_id)
        return await self.get_run(run_id)

    async def cancel_run(self, run_id: str, *, op_id: str | None = None) -> int:
        """Cancel a live run: 1. An ended run is left as it is: 0, never an error.
        ``op_id``: as for ``complete_step``."""
        outcome, _ = await self._end_run(run_id, "cancelled", "", op_id, "")
        return 1 if outcome == "ended" else 0

    async def cancel_key(self, workflow: str, key: str, *, op_id: str | None = None) -> int:
        """Cancel the live run that ``key`` points at: 1, or 0 when there is none.
        ``op_id``: as for ``complete_step``."""
        self.config.workflow(workflow)
        check_key(key)
        wf = self.config.workflows[workflow]
        keys = self.keys_for_key(workflow, key)
        pointer = keys.pointer(key)
        op = keys.op(_op_id(op_id))
        async with self.deadline():
            for _ in range(MAX_CLAIM_CALLS):  # until the key stays put between read and script
                run_id = await self._retrying(lambda: self.redis.hget(pointer, "run"))
                if run_id is None:
                    return 0
                expected = text_of(run_id)
                reply = await self._retrying(
                    lambda expected=expected: self._run_script(
                        self.scripts.cancel_key,
                        [pointer, keys.key_runs(key), keys.run(expected), op],
                        [expected, wf.retention_ms],
                    )
                )
                outcome = text_of(reply[0])
                if outcome != "moved":
                    return 1 if outcome == "cancelled" else 0
        raise StoreUnavailable(
            f"the key kept moving under concurrent starts ({MAX_CLAIM_CALLS} calls); retry"
        )

    async def check_layout(self, *, record: bool = True) -> None:
        """Refuse a ``partitions`` that differs from the one the workflow's data is stored
        with (ConfigError): its keys would be looked for under other hash tags, and
        every promise about them lost. There is no migration: change N on an empty
        workflow, or under a new workflow name. With ``record`` (the listener, a CLI
        command that starts runs) the first use records N; without, nothing is
        written (a dry run, a read)."""
        async with self.deadline():
            for name, wf in self.config.workflows.items():
                meta = Keys(self.prefix, name).meta()
                stored = await self._retrying(lambda m=meta: self.redis.hget(m, "partitions"))
                if stored is None:
                    # No record yet: data stored before partitions existed is in {wf}.
                    if wf.partitions > 1:
                        old = Keys(self.prefix, name).runs()
                        if await self._retrying(lambda k=old: self.redis.exists(k)):
                            stored = b"1"
                    if stored is None and record:
                        await self._retrying(
                            lambda m=meta, n=wf.partitions: self.redis.hsetnx(m, "partitions", n)
                        )
                        stored = await self._retrying(
                            lambda m=meta: self.redis.hget(m, "partitions")
                        )
                if stored is not None and int(stored) != wf.partitions:
                    raise ConfigError(
                        self.config.file,
                        f"the store holds this workflow's data with partitions: "
                        f"{int(stored)}; changing it to {wf.partitions} is refused (there is "
                        "no migration: keep it, or use a new workflow name)",
                        section="workflow",
                        name=name,
                        field="partitions",
                    )

    async def ping(self) -> None:
        """The server answers; on a cluster, every primary does (each slot has a home)."""
        async with self.deadline():
            await self._retrying(lambda: ping_every_primary(self.redis))

    def close(self) -> None:
        """Close the store's own pipelined connection (the client is the caller's)."""
        if self._pipeline is not None:
            self._pipeline.close()

    async def load_scripts(self) -> None:
        """Load every script now, so a broken script or server fails at start-up."""
        async with self.deadline():
            for script in self.scripts.all():
                await self._retrying(lambda script=script: self.redis.script_load(script.script))

    # -- internals ---------------------------------------------------------------------

    async def _end_run(
        self, run_id: str, phase: str, error: str, op_id: str | None, lease: str
    ) -> tuple[str, str]:
        run, wf, keys = await self._located(run_id)
        script_keys = [keys.run(run_id), keys.op(_op_id(op_id)), keys.stream(),
                       *self._key_keys(keys, run)]  # fmt: skip
        argv = [run_id, phase, wf.retention_ms, error, lease]
        async with self.deadline():
            reply = await self._retrying(
                lambda: self._run_script(self.scripts.end_run, script_keys, argv)
            )
        outcome, final = text_of(reply[0]), text_of(reply[1])
        if outcome == "not_found":
            raise _run_not_found(run_id)
        return outcome, final

    async def _located(self, run_id: str) -> tuple[Run, Workflow, Keys]:
        """A run, its workflow and its partition's keys: what every call on a run by id
        needs (the workflow is known only from the run)."""
        run = await self.get_run(run_id)
        return run, self.config.workflow(run.workflow), self.keys_for_run(run.workflow, run_id)

    async def _run_script(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        if self._pipeline is not None:
            return await self._pipeline.evalsha(script, keys, args)
        if self._durability is not None:
            return await confirmed_script(self.redis, script, keys, args, self._durability)
        return await script(keys, args)

    async def _hgetall_many(self, names: list[str]) -> list[dict[bytes, bytes]]:
        # A fresh pipeline per try: a failed pipeline forgets its commands.
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(name)
            return await pipe.execute()

    @staticmethod
    def _key_keys(keys: Keys, run: Run) -> list[str]:
        return [] if not run.key else [keys.pointer(run.key), keys.key_runs(run.key)]

    def deadline(self) -> _Deadline:
        """One bound on a whole operation: never a hang, whatever Redis does.
        (``async with store.deadline():`` raises StoreUnavailable when it passes.)"""
        return _Deadline(self.timeout)

    async def call(self, call: Callable[[], Awaitable[T]]) -> T:
        """One Redis call of a caller outside the store (the delivery log), with the
        store's retries and its mapping of "not now" errors to StoreUnavailable. The
        caller bounds it (``deadline``)."""
        return await self._retrying(call)

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call; on a dropped connection try once more on a fresh one.

        Every script is safe to repeat: a repeated start finds its own run id
        (the caller-id check), and a repeated end, step, cancel or repair finds the
        record of its operation id and answers what the first attempt did.
        """
        for attempt in (1, 2):
            try:
                return await call()
            except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
                if attempt == 2:
                    raise StoreUnavailable(f"Redis is unreachable: {_describe(exc)}") from None
            except redis_errors.NoScriptError:
                # The script cache was lost again between a reload and its resend:
                # the call did not run, so going again is safe.
                if attempt == 2:
                    raise StoreUnavailable("Redis keeps losing its scripts; retry") from None
            except redis_errors.ResponseError as exc:
                # Replies that mean "not now" (redis-py maps some to their own
                # ResponseError subclasses, and leaves others plain): the command was
                # refused before it ran, nothing was written, and a retry later may pass.
                if isinstance(exc, _NOT_NOW) or str(exc).startswith(NOT_NOW_PREFIXES):
                    raise StoreUnavailable(f"Redis refused the call: {_describe(exc)}") from None
                raise
            except (redis_errors.ClusterError, redis_errors.RedisClusterException) as exc:
                # A cluster in the middle of a change (redirections that did not settle
                # within redis-py's 16, a slot no node serves) or whose slot map no
                # seed gave: nothing was decided, and a retry later may pass.
                raise StoreUnavailable(f"the cluster is not ready: {_describe(exc)}") from None
        raise AssertionError("unreachable")


# Error replies that mean "not now, retry later" (the command did not run): 503
# STORE_UNAVAILABLE with Retry-After, never 500. BUSY: a script or function is running
# past its time limit; TRYAGAIN/CLUSTERDOWN: a cluster in the middle of a change;
# NOREPLICAS: min-replicas-to-write not met; MISCONF: a failed save blocks writes.
# "BUSY " with its space: BUSYGROUP (a consumer group that exists) is no "not now".
NOT_NOW_PREFIXES = (
    "BUSY ", "LOADING", "READONLY", "MASTERDOWN", "MISCONF", "OOM", "TRYAGAIN",
    "CLUSTERDOWN", "NOREPLICAS",
)  # fmt: skip
_NOT_NOW = (
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.MasterDownError,
    # A cluster's client maps these replies to its own classes, without the prefix:
    # CLUSTERDOWN, TRYAGAIN, and a MOVED or ASK it did not follow (in a pipeline).
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.AskError,
)


class _Deadline:
    """``asyncio.timeout`` that ends in ``StoreUnavailable``. A class, not a generator
    context manager: it is entered once per delivery, on the hot path."""

    __slots__ = ("_timeout", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout(self.seconds)
        await self._timeout.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self._timeout.__aexit__(*exc_info)
        except TimeoutError:
            raise StoreUnavailable(
                f"Redis did not answer within {self.seconds:g} s; the outcome is unknown, retry"
            ) from None


def _start_result(
    workflow: str,
    key: str | None,
    on_live_match: str,
    on_terminal_match: str,
    reply: list[Any],
) -> StartResult:
    # Every element is a Lua string, so bytes.
    outcome, run_id, phase, step, rerun_of, mismatch = (x.decode() for x in reply)
    if outcome == "created":
        superseded_by = None
        if rerun_of:
            superseded_by = (
                "on_live_match" if on_live_match == "cancel_existing" else "on_terminal_match"
            )
        return StartResult(
            run_id=run_id,
            workflow=workflow,
            deduped=False,
            phase=phase,
            next_step=step if phase == "running" else None,
            rerun_of=rerun_of or None,
            superseded_by=superseded_by,
        )
    if outcome == "existing":
        return StartResult(
            run_id=run_id,
            workflow=workflow,
            deduped=True,
            phase=phase,
            next_step=step if phase == "running" else None,
            params_mismatch=mismatch == "1",
        )
    if outcome == "active":
        raise RealmError(
            "STATE_RUN_ALREADY_ACTIVE",
            f"Idempotency key for workflow '{workflow}' is owned by an active run "
            f"'{run_id}' (phase '{phase}').",
        )
    if outcome == "used":
        raise RealmError(
            "STATE_IDEMPOTENCY_KEY_USED",
            f"Idempotency key for workflow '{workflow}' was already used by run '{run_id}' "
            f"(phase '{phase}'); on_terminal_match is '{on_terminal_match}'.",
        )
    if outcome == "conflict":
        raise RealmError(
            "STATE_IDEMPOTENCY_KEY_CONFLICT",
            f"Idempotency key for workflow '{workflow}' is owned by run '{run_id}' "
            f"(phase '{phase}'), which was started with different params; "
            "on_params_mismatch is 'reject'.",
        )
    raise StoreUnavailable(f"unexpected reply from start_run for key {key!r}: {outcome}")


def _op_id(op_id: str | None) -> str:
    if op_id is None:
        return new_run_id()
    check_request_id(op_id, "request_id")
    return op_id


Position = tuple[int, str]  # a run's index score and its id: a place in newest-first order


def parse_position(cursor: str | None) -> Position | None:
    """A cursor as a page returned it (``<score>.<run id>``), or None: from the newest."""
    if cursor is None:
        return None
    score, dot, run_id = cursor.partition(".")
    if not (dot and score.isascii() and score.isdigit() and len(score) <= 18):
        raise RealmError("VALIDATION_PARAMS", _bad_cursor(cursor))
    try:
        uuid.UUID(run_id)
    except ValueError:
        raise RealmError("VALIDATION_PARAMS", _bad_cursor(cursor)) from None
    return int(score), run_id


def format_position(position: Position) -> str:
    return f"{position[0]}.{position[1]}"


def _bad_cursor(cursor: str) -> str:
    return f"cursor {cursor[:60]!r} is not one this API returned"


class _RunPager:
    """One page of runs from several indexes (partitions, workflows), merged newest
    first by (score, id), read in bounded chunks.

    Each index is read from the position on (``ZRANGE … BYSCORE REV``, the bound
    inclusive, then the entries at or above the position dropped: scores are unique
    within an index, but two indexes may share one). The merge takes the newest head
    while every index that may have more has a head, so what is examined is exactly
    the merged order; the cursor is the last run examined. Under a phase filter a
    call examines at most 20 pages' worth and may return a short page with a cursor."""

    CHUNK = 200

    def __init__(
        self,
        store: RunStore,
        sources: list[tuple[Keys, str]],
        phase: str | None,
        limit: int,
        after: Position | None,
    ) -> None:
        self.store = store
        self.sources = sources
        self.phase = phase
        self.limit = limit
        self.chunk = min(self.CHUNK, limit + 1) if phase is None else self.CHUNK
        # Per source: buffered (score, id) heads, newest first; where its reads go on
        # from; whether it is read to the end.
        self.heads: list[list[Position]] = [[] for _ in sources]
        self.read_from: list[Position | None] = [after] * len(sources)
        self.done = [False] * len(sources)

    async def _refill(self) -> None:
        wanted = [i for i, heads in enumerate(self.heads) if not heads and not self.done[i]]
        if not wanted:
            return
        redis = self.store.redis

        def read(i: int) -> Awaitable[Any]:
            position = self.read_from[i]
            top: float | str = "+inf" if position is None else position[0]
            return redis.zrange(
                self.sources[i][1], top, "-inf", desc=True, byscore=True, offset=0,
                num=self.chunk + 1, withscores=True,
            )  # fmt: skip

        replies = await self.store._retrying(lambda: asyncio.gather(*(read(i) for i in wanted)))
        for i, reply in zip(wanted, replies, strict=True):
            position = self.read_from[i]
            heads = [(int(score), text_of(member)) for member, score in reply]
            if position is not None:
                heads = [
                    h
                    for h in heads
                    if h[0] < position[0] or (h[0] == position[0] and h[1] < position[1])
                ]
            # chunk + 1 asked: the one at the position itself may have been dropped.
            self.done[i] = len(reply) <= self.chunk
            heads = heads[: self.chunk]
            self.heads[i] = heads
            if heads:
                self.read_from[i] = heads[-1]

    def _take(self) -> tuple[int, Position] | None:
        """The newest head, if every source that may have more has one buffered."""
        best = None
        for i, heads in enumerate(self.heads):
            if not heads:
                if not self.done[i]:
                    return None  # a refill first: it may hold something newer
                continue
            if best is None or heads[0] > self.heads[best][0]:
                best = i
        if best is None:
            return None
        return best, self.heads[best].pop(0)

    def _exhausted(self) -> bool:
        return all(d and not h for d, h in zip(self.done, self.heads, strict=True))

    async def page(self) -> tuple[list[Run], str | None]:
        runs: list[Run] = []
        last: Position | None = None
        budget = 20 * self.limit + 1000
        examined = 0
        unexamined = False  # taken from the heads but not looked at: more remain
        while len(runs) < self.limit and examined < budget:
            await self._refill()
            if self._exhausted():
                return runs, None
            batch: list[tuple[int, Position]] = []
            want = self.limit - len(runs) if self.phase is None else self.CHUNK
            while len(batch) < want and (taken := self._take()) is not None:
                batch.append(taken)
            names = [self.sources[i][0].run(run_id) for i, (_, run_id) in batch]
            records = await self.store._retrying(lambda n=names: self.store._hgetall_many(n))
            for (_, position), record in zip(batch, records, strict=True):
                if len(runs) == self.limit or examined >= budget:
                    unexamined = True
                    break
                examined += 1
                last = position
                if record and (self.phase is None or text_of(record[b"phase"]) == self.phase):
                    runs.append(run_from_hash(record))
        if not unexamined:
            # No false promise of more: look whether anything is left to read.
            await self._refill()
            if self._exhausted():
                return runs, None
        return runs, None if last is None else format_position(last)


def _encode_output(output: Any) -> str:
    try:
        text = orjson.dumps(output).decode()
    except TypeError as exc:
        raise RealmError("VALIDATION_PARAMS", f"output must be JSON: {exc}") from None
    if len(text) > MAX_OUTPUT_BYTES:
        raise RealmError(
            "VALIDATION_PARAMS", f"output is {len(text)} bytes of JSON; at most {MAX_OUTPUT_BYTES}"
        )
    return text


def _raise_refusal(run_id: str, step: str, outcome: str, phase: str, current: str) -> None:
    """The runner-facing refusals of complete_step, step_failed and extend_lease."""
    if outcome == "not_found":
        raise _run_not_found(run_id)
    if outcome == "not_live":
        raise _not_live(run_id, phase)
    if outcome == "wrong_step":
        raise RealmError(
            "STATE_STEP_NOT_CURRENT",
            f"Run '{run_id}' is at step '{current}', not '{step}'; the result was discarded.",
        )
    if outcome == "lease_lost":
        raise _lease_lost(run_id, step)


def _lease_lost(run_id: str, step: str = "") -> RealmError:
    at = f" step '{step}' of" if step else ""
    return RealmError(
        "STATE_STEP_NOT_CURRENT",
        f"Another runner holds a newer lease on{at} run '{run_id}'; the result was discarded.",
    )


def _run_not_found(run_id: str) -> RealmError:
    return RealmError("NOT_FOUND_RUN", f"No run '{run_id}' (it never existed or has expired).")


def _not_live(run_id: str, phase: str) -> RealmError:
    return RealmError(
        "STATE_RUN_NOT_LIVE",
        f"Run '{run_id}' is not live (phase '{phase}'); the result was discarded.",
    )


def _describe(exc: BaseException) -> str:
    # redis-py messages can embed the URL; keep only the reason (no password).
    text = str(exc).split(" connecting to ")[0]
    return text or type(exc).__name__
