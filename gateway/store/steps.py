"""Moving runs on, step by step: a runner takes ready steps under a lease
(``take_steps``: the workflow's streams, read through the runners' consumer group),
keeps a step in hand (``extend_lease``), and reports it done (``complete_step``) or
failed (``fail_step``: taken again after a backoff while attempts are left).

Apart from starts and endings because this is the runners' side of the store (an
operator may report a step done too, without a lease): the consumer group, the leases
and the retries are theirs alone. A report a runner may no longer make (the run ended
or moved on, or another runner holds a newer lease) is refused and its result
discarded.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import orjson
from redis import exceptions as redis_errors

from gateway.model.errors import RealmError
from gateway.store.base import StoreBase, lease_lost, not_live, op_id_or_new, run_not_found
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
# An entry pending this long is looked at again (XAUTOCLAIM); take_step.lua hands it
# out only when the run's lease on it has lapsed or its retry is due.
AUTOCLAIM_IDLE_MS = 1_000
# Reads of one stream per take_steps call (stale entries are skipped in between).
TAKE_ROUNDS = 16
# A failed attempt's backoff doubles up to this; an error text is kept up to this.
MAX_BACKOFF_MS = 300_000
MAX_ERROR_CHARS = 4_000


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
        handed to the next step. A result for a run that ended (STATE_RUN_NOT_LIVE) or
        moved past the step (STATE_STEP_NOT_CURRENT) is discarded.

        ``op_id`` names this call (by default a new one): a resend after a lost reply,
        by the store or by a caller passing the same id within a few minutes, reports
        what the first attempt did."""
        output_json = "" if output is None else _encode_output(output)
        run, wf, keys = await self._located(run_id)
        op = keys.op(op_id_or_new(op_id))
        script_keys = [keys.run(run_id), keys.stream(), op, *self._key_keys(keys, run)]
        argv = [run_id, step, wf.retention_ms, lease or "", output_json, entry_id]
        async with self.deadline():
            reply = await self._retrying(
                lambda: self._run_script(self.scripts.complete_step, script_keys, argv)
            )
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
        script_keys = [keys.run(run_id), keys.stream(), keys.op(op_id_or_new(op_id)),
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
