"""Moving runs on, step by step: a runner takes ready steps under a lease
(``take_steps``: the workflow's streams, read through the runners' consumer group),
waits on Redis for new ones when idle (``wait_for_steps``), keeps a step in hand
(``extend_lease``), and reports it done (``complete_step``) or failed (``fail_step``:
taken again after a backoff while attempts are left).

Apart from starts and endings because this is the runners' side of the store (an
operator may report a step done too, without a lease): the consumer group, the leases
and the retries are theirs alone. A report a runner may no longer make (the run ended
or moved on, or another runner holds a newer lease) is refused and its result
discarded.

Attempts are bounded however a step ends: a failed attempt is retried until the
workflow's ``max_attempts``, and so is a lease that lapsed (a runner killed or stalled
mid-step): when the lease of the last attempt lapses, the next take fails the run.

A step's stream entry stays pending while a runner holds it. Its idle time is kept
so that it reaches the workflow's ``lease`` (the horizon) exactly when the lease lapses
or the retry is due (``park`` in lua/_lib.lua): XAUTOCLAIM, with the horizon as its
minimum idle time, then hands out only steps whose lease lapsed or whose retry is due,
never one held under a valid lease, however many runners hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import orjson
from redis import exceptions as redis_errors

from gateway.link.blocking import BlockingReader, server_of, slot_of
from gateway.model.config import Workflow
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.base import (
    MAX_ENDING_CALLS,
    StoreBase,
    check_op_reused,
    lease_lost,
    not_live,
    op_id_or_new,
    run_not_found,
)
from gateway.store.keys import Keys
from gateway.store.runs import (
    MAX_OUTPUT_BYTES,
    StepFailure,
    StepResult,
    TakenStep,
    new_run_id,
    text_of,
)

# The runners' consumer group on every stream (the Lua scripts name it too).
RUNNERS_GROUP = "runners"
# Reads of one stream per take_steps call, new entries and pending ones each (entries
# of ended runs are acknowledged and skipped in between).
TAKE_ROUNDS = 16
# A failed attempt's backoff doubles up to this; an error text is kept up to this.
MAX_BACKOFF_MS = 300_000
MAX_ERROR_CHARS = 4_000
# An idle runner's blocking read lasts this long at most: then it takes again, which
# finds the steps whose lease lapsed or whose retry fell due meanwhile (they wake no
# blocking read: they are no new entries).
WAIT_MS = 1_000
# On a cluster one read covers the streams of one slot: each wait reads one slot, at
# random, for its share of WAIT_MS, but no read blocks for less than this.
MIN_WAIT_MS = 50


class RunSteps(StoreBase):
    """Steps of runs: taken under a lease, kept, reported done or failed."""

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
        handed to the next step (None: the next step gets null). A result for a run that
        ended (STATE_RUN_NOT_LIVE) or moved past the step (STATE_STEP_NOT_CURRENT) is
        discarded.

        ``op_id`` names this call (by default a new one): a resend after a lost reply,
        by the store or by a caller passing the same id within a few minutes, reports
        what the first attempt did. The same id sent for another run, step or kind of
        call is refused: STATE_REQUEST_ID_REUSED."""
        output_json = "" if output is None else _encode_output(output)
        run, wf, keys = await self._located(run_id)
        op = keys.op(op_id_or_new(op_id))
        head = [keys.run(run_id), keys.stream(), op]
        argv = [run_id, step, wf.retention_ms, lease or "", output_json, entry_id]
        async with self.deadline():
            reply = await self._ending(self.scripts.complete_step, head, keys, run, argv)
        check_op_reused(reply)
        outcome, phase, current = (text_of(x) for x in reply[:3])
        _raise_refusal(run_id, step, outcome, phase, current)
        return StepResult(run_id, phase, current if outcome == "advanced" else None)

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
        (``lease_ms``, by default the workflow's ``lease``): first new steps
        (XREADGROUP), then steps whose lease lapsed or whose retry is due (XAUTOCLAIM).
        A step of a run that ended or moved on is acknowledged and never handed out; one
        whose lease is held is left alone; one whose last attempt's lease lapsed fails
        its run. Non-blocking: [] when nothing is ready (``wait_for_steps`` waits).

        When the store's deadline passes midway, the steps already leased are returned
        (they are this runner's; dropped, they would wait a whole lease for nobody);
        StoreUnavailable only when none was."""
        wf = self.config.workflow(workflow)
        if not 1 <= count <= 1000:
            raise RealmError("VALIDATION_PARAMS", "count must be between 1 and 1000")
        if workflow not in self._groups:
            await self.ensure_groups(workflow)
        lease_ms = wf.lease_ms if lease_ms is None else lease_ms
        taken: list[TakenStep] = []
        parts = self.partitions(workflow)
        start = random.randrange(len(parts))  # runners spread over the partitions
        parts = parts[start:] + parts[:start]
        try:
            async with self.deadline():
                try:
                    await self._take_all(parts, wf, runner, lease_ms, count, taken)
                except redis_errors.ResponseError as exc:
                    if not str(exc).startswith("NOGROUP"):
                        raise
                    # The streams went since this process made their groups (a flush, a
                    # restore): make them again, and take once more.
                    await self.ensure_groups(workflow)
                    await self._take_all(parts, wf, runner, lease_ms, count, taken)
        except StoreUnavailable:
            if not taken:
                raise
        return taken

    async def _take_all(
        self, parts: list[Keys], wf: Workflow, runner: str, lease_ms: int, count: int,
        taken: list[TakenStep],
    ) -> None:  # fmt: skip
        for keys in parts:
            await self._take_new(keys, wf, runner, lease_ms, count, taken)
        for keys in parts:
            await self._take_lapsed(keys, wf, runner, lease_ms, count, taken)

    async def _take_new(
        self, keys: Keys, wf: Workflow, runner: str, lease_ms: int, count: int,
        taken: list[TakenStep],
    ) -> None:  # fmt: skip
        """New entries of one stream (XREADGROUP >), taken into ``taken``: a ready step
        never waits behind the steps other runners hold."""
        stream = keys.stream()
        for _ in range(TAKE_ROUNDS):
            want = count - len(taken)
            if want <= 0:
                return
            read = await self._retrying(
                lambda w=want: self.redis.xreadgroup(RUNNERS_GROUP, runner, {stream: ">"}, count=w)
            )
            entries = [(text_of(i), f) for _, found in read or [] for i, f in found if f]
            if not entries:
                return
            for entry_id, fields in entries:
                await self._take_into(taken, keys, wf, runner, entry_id, fields, lease_ms)

    async def _take_lapsed(
        self, keys: Keys, wf: Workflow, runner: str, lease_ms: int, count: int,
        taken: list[TakenStep],
    ) -> None:  # fmt: skip
        """Pending entries idle past the horizon (XAUTOCLAIM): a lapsed lease, or a due
        retry (take_step.lua decides from the run). The cursor goes on where this
        process left off, so a long pending list is looked through across takes."""
        stream = keys.stream()
        for _ in range(TAKE_ROUNDS):
            want = count - len(taken)
            if want <= 0:
                return
            cursor = self._autoclaim.get(stream, "0-0")
            reply = await self._retrying(
                lambda c=cursor, w=want: self.redis.xautoclaim(
                    stream, RUNNERS_GROUP, runner, wf.lease_ms, start_id=c, count=w
                )
            )
            after = text_of(reply[0])
            self._autoclaim[stream] = after
            for entry_id, fields in reply[1]:
                if fields:
                    await self._take_into(
                        taken, keys, wf, runner, text_of(entry_id), fields, lease_ms
                    )
            if after == "0-0":  # the whole pending list was looked through
                return

    def take_only(self, runner: str, steps: Mapping[str, Collection[str]] | None) -> None:
        """From now on ``runner`` takes, of each workflow named in ``steps``, only the
        steps listed (those it has handlers for), in take_steps and wait_for_steps.
        Another step's entry it reads is left ready at once for the next take of any
        runner, with no lease and no attempt counted. None: every step again."""
        if steps is None:
            self._only.pop(runner, None)
        else:
            self._only[runner] = steps

    async def _take_into(
        self, taken: list[TakenStep], keys: Keys, wf: Workflow, runner: str, entry_id: str,
        fields: Mapping[bytes, bytes], lease_ms: int,
    ) -> None:  # fmt: skip
        only = self._only.get(runner, {}).get(wf.name)
        if only is not None and text_of(fields.get(b"step", b"")) not in only:
            await self._leave_ready(keys.stream(), runner, entry_id)  # see take_only
            return
        step = await self._take(keys, wf, runner, entry_id, fields, lease_ms)
        if step is not None:
            taken.append(step)

    async def _take(
        self,
        keys: Keys,
        wf: Workflow,
        runner: str,
        entry_id: str,
        fields: Mapping[bytes, bytes],
        lease_ms: int,
    ) -> TakenStep | None:
        run_id, step = text_of(fields.get(b"run_id", b"")), text_of(fields.get(b"step", b""))
        token = new_run_id()
        script_keys = [keys.run(run_id), keys.stream()]
        argv = [entry_id, step, token, lease_ms, runner, wf.lease_ms, wf.max_attempts,
                wf.retention_ms]  # fmt: skip
        reply = await self._retrying(
            lambda: self._run_script(self.scripts.take_step, script_keys, argv)
        )
        if text_of(reply[0]) == "need_key":
            # The run is to be failed (its last lease lapsed) and has a key: again, with
            # the key's pointer, so that the key says the run failed too, and its queue,
            # whose first run then starts (`need_next` names it: once more).
            key, next_id = text_of(reply[2]), ""
            for _ in range(MAX_ENDING_CALLS):
                script_keys = [keys.run(run_id), keys.stream(), keys.pointer(key),
                               keys.key_runs(key), keys.queue(key),
                               keys.run(next_id or run_id), keys.queued()]  # fmt: skip
                reply = await self._retrying(
                    lambda k=script_keys, a=[*argv, next_id]: self._run_script(
                        self.scripts.take_step, k, a
                    )
                )
                if text_of(reply[0]) != "need_next":
                    break
                next_id = text_of(reply[2])
        outcome, attempt, params, output, until = (text_of(x) for x in reply)
        if outcome != "taken":
            return None
        return TakenStep(
            run_id=run_id,
            workflow=wf.name,
            step=step,
            attempt=int(attempt),
            params=orjson.loads(params) if params else {},
            output=orjson.loads(output) if output else None,
            lease=token,
            lease_until_ms=int(until),
            entry_id=entry_id,
        )

    async def wait_for_steps(
        self,
        workflows: Sequence[str],
        runner: str,
        *,
        count: int = 1,
        lease_ms: int | None = None,
        wait_ms: int = WAIT_MS,
        stop: asyncio.Event | None = None,
    ) -> list[TakenStep]:
        """Wait on Redis for new steps of ``workflows``, for ``runner``: a blocking read
        (XREADGROUP ... BLOCK) of their streams, on a connection of the runner's own
        (it holds none of the store's), for at most ``wait_ms`` or until ``stop`` is
        set. The steps read are taken as ``take_steps`` takes them, up to ``count``
        (any more are left ready for the next take at once); [] when none came, or
        when ``stop`` was set (what the read got meanwhile is left ready too).

        For an idle runner, after a ``take_steps`` that found nothing: only new steps
        end the wait, so take again after it (a lapsed lease or a due retry is found
        by the take). ``end_waits(runner)`` closes the runner's connection."""
        if not 1 <= count <= 1000 or wait_ms < 1:
            raise RealmError("VALIDATION_PARAMS", "count must be 1 to 1000, wait_ms at least 1")
        wfs = {name: self.config.workflow(name) for name in workflows}
        for name in wfs:
            if name not in self._groups:
                await self.ensure_groups(name)
        streams = {k.stream(): (k, wf) for name, wf in wfs.items() for k in self.partitions(name)}
        # One read names streams of one slot (all of them, on one server).
        slots: dict[int, list[str]] = {}
        for stream in streams:
            slots.setdefault(slot_of(self.redis, stream), []).append(stream)
        batch = random.choice(list(slots.values()))
        block_ms = max(MIN_WAIT_MS, wait_ms // len(slots)) if len(slots) > 1 else wait_ms
        # Between half and all of it, at random: runners that went idle together do not
        # wake and take in step (in step, a step one runner leaves for another is
        # re-claimed by the first under the other's nose, time after time).
        block_ms = random.randint(max(1, block_ms // 2), block_ms)
        server = await self._retrying(lambda: server_of(self.redis, batch[0]))
        reader = self._waits.get((runner, server))
        if reader is None:
            reader = self._waits[(runner, server)] = BlockingReader(self.redis, batch[0])
        try:
            read = await reader.read_group(
                RUNNERS_GROUP, runner, batch, count=count, block_ms=block_ms,
                timeout=self.timeout, stop=stop,
            )  # fmt: skip
        except (redis_errors.RedisError, TimeoutError, OSError) as exc:
            self._waits.pop((runner, server), None)
            with contextlib.suppress(redis_errors.RedisError, OSError):
                await reader.aclose()
            if "NOGROUP" in str(exc):  # the streams were deleted: create the groups anew
                self._groups.difference_update(wfs)
            raise StoreUnavailable(f"waiting for steps failed: {_describe(exc)}") from None
        except BaseException:
            self._waits.pop((runner, server), None)  # cancelled: its connection was dropped
            raise
        taken: list[TakenStep] = []
        try:
            async with self.deadline():
                for stream, entry_id, fields in read:
                    keys, wf = streams[stream]
                    # A stopped wait takes nothing, even entries that came as it stopped:
                    # what stopped it (a runner's stop, a reload) comes before them.
                    if len(taken) < count and not (stop is not None and stop.is_set()):
                        step_lease = wf.lease_ms if lease_ms is None else lease_ms
                        await self._take_into(taken, keys, wf, runner, entry_id, fields,
                                              step_lease)  # fmt: skip
                    else:
                        await self._leave_ready(stream, runner, entry_id)
        except StoreUnavailable:
            if not taken:
                raise
        return taken

    async def _leave_ready(self, stream: str, runner: str, entry_id: str) -> None:
        """An entry this runner read but does not take (beyond the count, or a step it
        has no handler for): delivered at time 0 as far as the group can tell, so the
        next XAUTOCLAIM of any runner hands it out, whatever that runner's horizon."""
        await self._retrying(
            lambda: self.redis.xclaim(
                stream, RUNNERS_GROUP, runner, 0, [entry_id], time=0, justid=True
            )
        )

    async def end_waits(self, runner: str) -> None:
        """Close the connections ``runner`` waited on (``wait_for_steps``)."""
        for key in [k for k in self._waits if k[0] == runner]:
            await self._waits.pop(key).aclose()

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
        the run fails with the error. Discarded like complete_step's results, and its
        ``op_id`` names one call as complete_step's does."""
        run, wf, keys = await self._located(run_id)
        head = [keys.run(run_id), keys.stream(), keys.op(op_id_or_new(op_id))]
        argv = [run_id, step, wf.retention_ms, lease, error[:MAX_ERROR_CHARS], wf.max_attempts,
                wf.retry_backoff_ms, MAX_BACKOFF_MS, entry_id, wf.lease_ms]  # fmt: skip
        async with self.deadline():
            reply = await self._ending(self.scripts.step_failed, head, keys, run, argv)
        check_op_reused(reply)
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
                    [step, lease, ms, entry_id, wf.lease_ms],
                )
            )
        outcome, phase, current, until = (text_of(x) for x in reply)
        _raise_refusal(run_id, step, outcome, phase, current)
        return int(until)


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


def _describe(exc: BaseException) -> str:
    # redis-py messages can embed the URL; keep only the reason (no password).
    text = str(exc).split(" connecting to ")[0]
    return text or type(exc).__name__


def _raise_refusal(run_id: str, step: str, outcome: str, phase: str, current: str) -> None:
    """The runner-facing refusals of complete_step, step_failed and extend_lease."""
    if outcome == "not_found":
        raise run_not_found(run_id)
    if outcome == "not_live":
        raise not_live(run_id, phase)
    if outcome == "wrong_step":
        raise RealmError(
            "STATE_STEP_NOT_CURRENT",
            f"Run '{run_id}' is at step '{current}', not '{step}'; the result was discarded.",
        )
    if outcome == "lease_lost":
        raise lease_lost(run_id, step)
