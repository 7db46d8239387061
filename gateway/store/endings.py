"""Ending a live run before its steps are done: cancelled by id (``cancel_run``) or
by its idempotency key (``cancel_key``), or failed (``fail_run``: by an operator, or by
a runner that holds the step's lease).

Apart from steps because an ending is no step's report: it needs no lease (a runner's
is honoured when given) and is the same whatever step the run is at. Every ending is
safe to repeat under the same ``op_id`` (the script records what it did).
"""

from __future__ import annotations

from typing import Any

from gateway.model.errors import StoreUnavailable
from gateway.store.base import (
    StoreBase,
    check_op_reused,
    lease_lost,
    not_live,
    op_id_or_new,
    run_not_found,
)
from gateway.store.runs import Run, check_key, text_of
from gateway.store.starts import MAX_CLAIM_CALLS


class RunEndings(StoreBase):
    """Runs cancelled or failed before their last step."""

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
            raise not_live(run_id, phase)
        if outcome == "lease_lost":
            raise lease_lost(run_id)
        return await self.get_run(run_id)

    async def cancel_run(self, run_id: str, *, op_id: str | None = None) -> int:
        """Cancel a live or waiting (queued, scheduled) run: 1. An ended run is left as
        it is: 0, never an error.
        ``op_id``: as for ``complete_step``."""
        outcome, _ = await self._end_run(run_id, "cancelled", "", op_id, "")
        return 1 if outcome == "ended" else 0

    async def cancel_key(self, workflow: str, key: str, *, op_id: str | None = None) -> int:
        """Cancel the runs ``key`` holds: its live run (its live runs, when it queues), a
        scheduled one and every run waiting in its queue. How many were cancelled: 0 when
        none was. ``op_id``: as for ``complete_step``."""
        self.config.workflow(workflow)
        check_key(key)
        wf = self.config.workflows[workflow]
        keys = self.keys_for_key(workflow, key)
        pointer, queue = keys.pointer(key), keys.queue(key)
        op = keys.op(op_id_or_new(op_id))
        async with self.deadline():
            for _ in range(MAX_CLAIM_CALLS):  # until the key stays put between read and script
                held, waiting = await self._retrying(lambda: self._key_state(pointer, queue))
                if held[0] is None:
                    return 0
                expected, live = text_of(held[0]), text_of(held[1] or b"")
                queued = [text_of(x) for x in waiting]
                ids = list(dict.fromkeys([expected, *live.split(), *queued]))
                reply = await self._retrying(
                    lambda ids=ids, e=expected, lv=live, qd=queued: self._run_script(
                        self.scripts.cancel_key,
                        [pointer, keys.key_runs(key), op, keys.stream(), queue, keys.queued(),
                         keys.due(), *(keys.run(i) for i in ids)],
                        [wf.retention_ms, e, lv, " ".join(qd), *ids],
                    )
                )  # fmt: skip
                check_op_reused(reply)
                outcome = text_of(reply[0])
                if outcome != "moved":
                    return int(reply[2]) if outcome == "cancelled" else 0
        raise StoreUnavailable(
            f"the key kept moving under concurrent starts ({MAX_CLAIM_CALLS} calls); retry"
        )

    async def _key_state(self, pointer: str, queue: str) -> tuple[list[Any], list[bytes]]:
        # A fresh pipeline per try: a failed pipeline forgets its commands.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(pointer, ["run", "live"])
            pipe.zrange(queue, 0, -1)
            held, waiting = await pipe.execute()
        return held, waiting

    async def _end_run(
        self, run_id: str, phase: str, error: str, op_id: str | None, lease: str
    ) -> tuple[str, str]:
        run, wf, keys = await self._located(run_id)
        head = [keys.run(run_id), keys.op(op_id_or_new(op_id)), keys.stream(), keys.due()]
        argv = [run_id, phase, wf.retention_ms, error, lease]
        async with self.deadline():
            reply = await self._ending(self.scripts.end_run, head, keys, run, argv)
        check_op_reused(reply)
        outcome, final = text_of(reply[0]), text_of(reply[1])
        if outcome == "not_found":
            raise run_not_found(run_id)
        return outcome, final
