"""Starting runs (the policies on a repeated key): one start (``start_run``), a
batch (``start_run_batch``), the markers a start claims besides its key (a request
id, an event id, a body digest), and what a start would decide, written nowhere
(``preview_start``).

Apart from the runs' other operations because a start is the webhook listener's hot
path and the one operation whose claim may take several script calls (the
``need_run`` rounds, bounded by ``MAX_CLAIM_CALLS``). Expected outcomes (a new run, a
deduplicated one) are values; refusals by policy and bad input raise ``RealmError``
with a stable code.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from redis import exceptions as redis_errors

from gateway.model.errors import RealmError, StoreUnavailable
from gateway.model.words import plural
from gateway.store.base import StoreBase
from gateway.store.keys import Keys, partition_of, run_id_in
from gateway.store.policy import Decision, FlowState, KeyState, decide
from gateway.store.runs import (
    MAX_BATCH_ITEMS,
    BatchEntry,
    Flow,
    LiveMatch,
    ParamsMismatch,
    StartResult,
    TerminalMatch,
    batch_run_id,
    check_key,
    check_policies,
    check_request_id,
    encode_params,
    fingerprint_of,
    new_run_id,
    prepare_items,
    text_of,
)
from gateway.store.start_results import (
    rate_error,
    stale_against,
    stale_error,
    start_result,
)

# Script calls one start may make: each `need_run` reply names a run the next call
# must pass, and a concurrent start on the same key can move it again in between.
# Each round of calls lets one of the racing starts through, so a start needs at most
# one call more than the starts racing it; the deadline bounds the rest.
MAX_CLAIM_CALLS = 256


@dataclass
class _Sends:
    """Whether a start's script call may repeat one that already ran: its caller-id
    check (a look at the new run's hash) is needed only then. The first try of a run id
    the store made up cannot find a run of that id, so it skips the check. Once a call
    is sent a second time (its connection dropped, its reply maybe lost), that call and
    every later one of the claim look."""

    resend: bool

    def flag(self, tries: list[int]) -> str:
        """The script's resend argument for one more send of the call ``tries`` counts."""
        tries[0] += 1
        self.resend = self.resend or tries[0] > 1
        return "1" if self.resend else "0"


@dataclass(frozen=True)
class Marker:
    """A marker key a start reads and writes in its claim (see start_run.lua): ``mode``
    is ``same`` (a request id), ``dedupe`` (an event id), ``replay`` (a body digest,
    tagged with the event id it came with), ``order`` (an entity's mark, tagged with
    the delivery's order: ``number rank ties text``) or ``rate`` (a rate limit's
    window, tagged ``limit period_ms``)."""

    name: Callable[[Keys], str]  # the marker's key, in the claim's partition
    mode: str
    tag: str = ""


class RunStarts(StoreBase):
    """Run starts: one, a batch, and the preview of one."""

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
        flow: Flow | None = None,
    ) -> StartResult:
        """Start a run, or return the run that owns ``idempotency_key``.

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
        ``flow``: how the run may wait (a trigger's queue, concurrency, debounce and
        delay); on_live_match ``queue`` without one queues behind one live run.
        """
        wf = self.config.workflow(workflow)
        params = {} if params is None else params
        check_policies(on_live_match, on_terminal_match, on_params_mismatch)
        if flow is None and on_live_match == "queue":
            flow = Flow()
        if flow is not None and on_live_match == "queue" and idempotency_key is None:
            raise RealmError(
                "VALIDATION_PARAMS",
                "on_live_match 'queue' needs an idempotency_key: runs queue behind their key's",
            )
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
            pointer = keyruns = queue = run_key
        else:
            pointer, keyruns = keys.pointer(idempotency_key), keys.key_runs(idempotency_key)
            queue = keys.queue(idempotency_key) if flow is not None else run_key
        head = [run_key, keys.runs(), keys.stream(), pointer, keyruns]
        # A start with no flow never looks at the queues or the due index: their slots
        # name the new run's hash (shorter to send than a key of their own).
        waits = [keys.queued(), keys.due()] if flow is not None else [run_key, run_key]
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
        # A run id the caller chose may have been started by an earlier call of theirs.
        sends = _Sends(resend=run_id is not None)
        async with self.deadline() if bounded else contextlib.nullcontext():
            named = {"pointer": "", "marker": "", "queued": ""}
            flow_arg = "" if flow is None else flow.argument()
            for _ in range(MAX_CLAIM_CALLS):
                # A repeat needs the hash of the run it names, and keys are never
                # built inside Lua: the script answers `need_run` naming it, and this
                # call goes again with it (one more round trip, on repeats only).
                cur, mrun, qrun = named["pointer"], named["marker"], named["queued"]
                script_keys = [
                    *head,
                    keys.run(cur) if cur else run_key,
                    keys.run(mrun) if mrun else run_key,
                    keys.key_index(),
                    queue,
                    keys.run(qrun) if qrun else run_key,
                    *waits,
                    *tail,
                ]
                reply = await self._retrying(
                    lambda k=script_keys, a=[*argv, cur, mrun], t=[0], q=qrun: self._run_script(
                        self.scripts.start_run, k, [*a, sends.flag(t), flow_arg, q, *marks]
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
        tags = {m.mode: m.tag for m in markers}
        return start_result(
            workflow, idempotency_key, on_live_match, on_terminal_match, reply, tags, new_id
        )

    def event_marker(self, workflow: str, trigger: str, event_id: str) -> Marker:
        """A redelivery of this event (to this trigger) gets the run the first delivery
        got, deduplicated, whatever the key's policy says about other events."""
        return Marker(lambda k: k.event(trigger, event_id), "dedupe")

    def replay_marker(self, workflow: str, trigger: str, digest: str, event_id: str) -> Marker:
        """The replay guard: this verified body seen again under another event id is
        deduplicated onto the first one's run; under the same event id, the key's
        policy decides (a real redelivery)."""
        return Marker(lambda k: k.body(trigger, digest), "replay", event_id)

    def order_marker(self, entity: str, number: float, rank: int, ties: str, text: str) -> Marker:
        """An ordered trigger's check: a start whose (number, rank) is below the
        highest that started a run for ``entity`` (or equal, with ``ties: refuse``) is
        refused as stale (STATE_EVENT_STALE); one that starts a run moves the mark."""
        return Marker(lambda k: k.order(entity), "order", f"{number!r} {rank} {ties} {text}")

    def rate_marker(self, trigger: str, window: str, limit: int, period_ms: int) -> Marker:
        """A trigger's rate limit: a start that would start a run while ``limit`` runs
        started in ``window`` within the last ``period_ms`` is refused
        (STATE_RATE_LIMITED); one that starts a run is counted."""
        return Marker(lambda k: k.rate(trigger, window), "rate", f"{limit} {period_ms}")

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
        if on_live_match == "queue":
            raise RealmError(
                "VALIDATION_PARAMS",
                "on_live_match 'queue' is for single starts: a batch cannot wait behind "
                "its own items; start them one by one",
            )
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
                f"start_run_batch: {plural(len(failures), 'item')} failed schema validation\n"
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
                reply = await self._batch_call(
                    parts[p], items_here, prepared, ids, common, resend=batch_id is not None
                )
                for n, i in enumerate(items_here):
                    group = reply[6 * n : 6 * n + 6]
                    try:
                        outcomes[i] = start_result(
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
        *,
        resend: bool,
    ) -> list[Any]:
        """start_batch.lua for the items of one partition: one atomic call (after the
        `need_run` rounds that name the runs its repeats point at, which write nothing)."""
        named: dict[int, str] = {}
        # Run ids from a batch id are the same on the caller's retry of the batch.
        sends = _Sends(resend=resend)
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
                lambda k=script_keys, a=argv, t=[0]: self._run_script(
                    self.scripts.start_batch, k, [*a[:7], sends.flag(t), *a[7:]]
                )
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
        flow: Flow | None = None,
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
                if marker.mode == "order":
                    held = await self._retrying(lambda m=marker: self.redis.get(m.name(keys)))
                    if held is not None and stale_against(marker.tag, text_of(held)):
                        raise stale_error(workflow, marker.tag, text_of(held).split(" ", 2)[2])
                    continue
                if marker.mode == "rate":
                    await self._preview_rate(workflow, marker, keys)
                    continue
                run, tag = await self._retrying(lambda m=marker: self._read_marker(m.name(keys)))
                if run is None or (marker.mode == "replay" and tag == marker.tag):
                    continue
                run_key = keys.run(text_of(run))
                phase = await self._retrying(lambda k=run_key: self.redis.hget(k, "phase"))
                if phase is not None:
                    return "existing", KeyState(text_of(run), text_of(phase), "")
        shape = None
        if flow is not None:
            shape = FlowState(flow.limit, flow.queue_max, flow.keep, flow.schedules,
                              flow.debounce_ms > 0)  # fmt: skip
        if idempotency_key is None:
            return ("schedule" if shape is not None and shape.schedules else "start"), None
        pointer, queue = keys.pointer(idempotency_key), keys.queue(idempotency_key)
        async with self.deadline():
            (run, phase, fp, live), waiting = await self._retrying(
                lambda: self._pointer_and_queue(pointer, queue)
            )
        state = None
        if run is not None:
            state = KeyState(text_of(run), text_of(phase), text_of(fp),
                             len(text_of(live or b"").split()), waiting)  # fmt: skip
        decision = decide(
            state, on_live_match, on_terminal_match, on_params_mismatch, fingerprint, shape
        )
        return decision, state

    async def _pointer_and_queue(self, pointer: str, queue: str) -> tuple[list[Any], int]:
        # A fresh pipeline per try: a failed pipeline forgets its commands.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(pointer, ["run", "phase", "fp", "live"])
            pipe.zcard(queue)
            held, waiting = await pipe.execute()
        return held, int(waiting)

    async def _preview_rate(self, workflow: str, marker: Marker, keys: Keys) -> None:
        """Raise what the claim would if ``marker``'s window is full now (by this
        machine's clock, where the claim uses the server's: a preview)."""
        limit, period_ms = (int(x) for x in marker.tag.split(" "))
        now_ms = int(time.time() * 1000)
        name = marker.name(keys)
        started = await self._retrying(
            lambda: self.redis.zrangebyscore(
                name, f"({now_ms - period_ms}", "+inf", withscores=True
            )
        )
        if len(started) >= limit:
            wait_ms = max(int(started[0][1]) + period_ms - now_ms, 1)
            raise rate_error(workflow, marker.tag, wait_ms)

    async def _read_marker(self, name: str) -> tuple[str | None, str]:
        """A marker's run and tag (see start_run.lua): a string, or a hash written by
        an earlier version."""
        try:
            value = await self.redis.get(name)
        except redis_errors.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            run, tag = await self.redis.hmget(name, ["run", "tag"])
            return (None if run is None else text_of(run)), text_of(tag or b"")
        if value is None:
            return None, ""
        run, _outcome, _rerun_of, tag = text_of(value).split("\n", 3)
        return run, tag
