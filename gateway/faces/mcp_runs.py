"""The MCP tools for runs: start one or a batch, show, list, cancel, and be a runner
(claim a step with a lease, complete it or fail it), with their arguments' schemas
and the replies to a claim and to a failed attempt.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult
from pydantic import Field

from gateway.faces.mcp_calls import page_text, run_tool
from gateway.ingest import replies
from gateway.model.errors import RealmError
from gateway.store.paging import check_cursor
from gateway.store.runs import MAX_BATCH_ITEMS, new_run_id
from gateway.store.runstore import RunStore

if TYPE_CHECKING:
    from gateway.store.runs import StepFailure, TakenStep

__all__ = ["DEFAULT_RUNNER", "add_run_tools", "claim_text", "retry_text"]

# Literal types, so that each tool's JSON schema lists the allowed values.
LiveMatchArg = Literal["use_existing", "fail", "cancel_existing", "queue"]
TerminalMatchArg = Literal["reuse", "reject", "rerun_if_failed", "rerun"]
ParamsMismatchArg = Literal["flag", "reject"]
PhaseArg = Literal["running", "completed", "failed", "cancelled", "queued", "scheduled"]

# The consumer name claim_step reads with when the caller names none.
DEFAULT_RUNNER = "mcp"

WorkflowId = Annotated[str, Field(description="The workflow, as named in triggers.yaml.")]
RunId = Annotated[str, Field(description="The run's id (a UUID), as start_run returned it.")]
Params = Annotated[
    dict[str, Any],
    Field(
        default_factory=dict,
        description="The run's parameters (a JSON object); checked against the "
        "workflow's params_schema.",
        json_schema_extra={"default": {}},
    ),
]
IdempotencyKey = Annotated[
    str | None,
    Field(
        description="Names the piece of work: a repeat with the same key (for the same "
        "workflow) starts no new run. Without a key every call starts a new run.",
    ),
]
LiveMatch = Annotated[
    LiveMatchArg,
    Field(
        description="A repeat while the key's run is live: use_existing returns it "
        "(deduped: true); fail refuses (STATE_RUN_ALREADY_ACTIVE); cancel_existing "
        "cancels it and starts a new run; queue creates a run in phase 'queued' that "
        "starts when the live run ends (STATE_QUEUE_FULL past 100 waiting).",
    ),
]
TerminalMatch = Annotated[
    TerminalMatchArg,
    Field(
        description="A repeat after the key's run ended: reuse returns it (deduped: true); "
        "reject refuses (STATE_IDEMPOTENCY_KEY_USED); rerun_if_failed starts a new run "
        "if it failed or was cancelled, else returns it; rerun always starts a new run.",
    ),
]
ParamsMismatch = Annotated[
    ParamsMismatchArg,
    Field(
        description="A repeat whose params differ from the key's run: flag returns the "
        "run with params_mismatch: true; reject refuses (STATE_IDEMPOTENCY_KEY_CONFLICT).",
    ),
]
Lease = Annotated[
    str | None,
    Field(
        description="The lease claim_step returned with this step: the result counts only "
        "while it is the run's current lease (else it is discarded, STATE_STEP_NOT_CURRENT). "
        "Without it, the step is recorded whoever holds it (an admin's override).",
    ),
]
RequestId = Annotated[
    str | None,
    Field(
        description="Your id for this call: a retry with the same request_id (after a lost "
        "reply or STORE_UNAVAILABLE) reports what the first call did instead of acting again.",
    ),
]
BatchId = Annotated[
    str | None,
    Field(
        description="Your id for this batch; without one, one is made and returned in the "
        "reply (batch_id: ...). A retry with the same batch_id and items names the same runs "
        "and starts nothing twice.",
    ),
]
# The items are handed to the store as they came, so that a bad item is reported
# per item (VALIDATION_BATCH_ITEMS) as in Realm's documentation; the schema still
# tells the client their shape.
BatchItems = Annotated[
    list[dict[str, Any]],
    Field(
        description='One entry per run: {"params": {...}, "idempotency_key": "..."} '
        "(both optional).",
        json_schema_extra={
            "minItems": 1,
            "maxItems": MAX_BATCH_ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "params": {"type": "object", "default": {}},
                    "idempotency_key": {"type": ["string", "null"], "default": None},
                },
            },
        },
    ),
]


def add_run_tools(server: MCPServer[RunStore]) -> None:
    """Register the eight run tools on ``server``."""

    @server.tool(
        description="Start a run of a workflow, or return the run its idempotency key "
        "already has. The reply says whether it deduplicated (deduped: true/false), the "
        "run_id, and which step is ready next."
    )
    async def start_run(
        ctx: Context,
        workflow_id: WorkflowId,
        params: Params,
        idempotency_key: IdempotencyKey = None,
        on_live_match: LiveMatch = "use_existing",
        on_terminal_match: TerminalMatch = "reuse",
        on_params_mismatch: ParamsMismatch = "flag",
        request_id: RequestId = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            result = await store.start_run(
                workflow_id, params, idempotency_key,
                on_live_match, on_terminal_match, on_params_mismatch, request_id=request_id,
            )  # fmt: skip
            return replies.start_text(result)

        return await run_tool(ctx, work)

    @server.tool(
        description="Start several runs of one workflow in one call: one line per item, "
        "each with its run id and deduped: true/false. Every item is checked first: if "
        "any item's params fail the workflow's params_schema, no run starts "
        "(VALIDATION_BATCH_ITEMS). The policies apply to every item. The reply's "
        "batch_id line names the batch: after a lost reply or STORE_UNAVAILABLE, send the "
        "same items again with that batch_id and nothing starts twice."
    )
    async def start_run_batch(
        ctx: Context,
        workflow_id: WorkflowId,
        items: BatchItems,
        on_live_match: LiveMatch = "use_existing",
        on_terminal_match: TerminalMatch = "reuse",
        on_params_mismatch: ParamsMismatch = "flag",
        batch_id: BatchId = None,
    ) -> CallToolResult:
        given = new_run_id() if batch_id is None else batch_id

        async def work(store: RunStore) -> str:
            entries = await store.start_run_batch(
                workflow_id, items, on_live_match, on_terminal_match, on_params_mismatch,
                batch_id=given,
            )  # fmt: skip
            return replies.batch_reply_text(given, entries)

        return await run_tool(ctx, work, batch_id=given)

    @server.tool(
        description="Show one run: workflow, phase, current step, idempotency key, "
        "params, times, and the run it reran or its error, if any."
    )
    async def get_run(ctx: Context, run_id: RunId) -> CallToolResult:
        async def work(store: RunStore) -> str:
            return replies.run_text(await store.get_run(run_id))

        return await run_tool(ctx, work)

    @server.tool(
        description="List a workflow's runs, newest first, one line per run (id, workflow, "
        "phase, step, key). Filter by idempotency key or phase. When there are more, the "
        "last line is 'cursor: N': pass it back as cursor for the next page."
    )
    async def list_runs(
        ctx: Context,
        workflow_id: WorkflowId,
        idempotency_key: Annotated[
            str | None, Field(description="Only the runs of this key (newest first).")
        ] = None,
        phase: Annotated[PhaseArg | None, Field(description="Only runs in this phase.")] = None,
        limit: Annotated[int, Field(ge=1, le=1000, description="Runs per page.")] = 20,
        cursor: Annotated[
            str | None, Field(description="The cursor a previous page returned.")
        ] = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            runs, next_cursor = await store.list_runs(
                workflow_id, key=idempotency_key, phase=phase, limit=limit,
                cursor=check_cursor(cursor),
            )  # fmt: skip
            return page_text([replies.run_line(run) for run in runs], next_cursor, empty="no runs")

        return await run_tool(ctx, work)

    @server.tool(
        description="Cancel a live, queued or scheduled run: give run_id, or workflow_id "
        "and idempotency_key to cancel the runs of that key (its live run, a scheduled "
        "one, and every run queued behind it). Replies cancelled: N, the runs cancelled; "
        "0 when the run had already ended (it is left as it is)."
    )
    async def cancel_run(
        ctx: Context,
        run_id: Annotated[str | None, Field(description="The run to cancel.")] = None,
        workflow_id: Annotated[
            str | None, Field(description="With idempotency_key: the key's workflow.")
        ] = None,
        idempotency_key: Annotated[
            str | None, Field(description="With workflow_id: cancel this key's live run.")
        ] = None,
        request_id: RequestId = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            if run_id is not None and workflow_id is None and idempotency_key is None:
                count = await store.cancel_run(run_id, op_id=request_id)
            elif run_id is None and workflow_id is not None and idempotency_key is not None:
                count = await store.cancel_key(workflow_id, idempotency_key, op_id=request_id)
            else:
                raise RealmError(
                    "VALIDATION_PARAMS",
                    "give either run_id or both workflow_id and idempotency_key",
                )
            return f"status: ok\ncancelled: {count}"

        return await run_tool(ctx, work)

    @server.tool(
        description="Take the next ready step of a workflow, with a lease: the reply gives "
        "the run_id, step, attempt, the lease token and its deadline (lease_until), the "
        "run's params and the previous step's output. Do the step before the deadline, "
        "then report it with complete_step or fail_run, passing the lease. When no step "
        "is ready the reply says so."
    )
    async def claim_step(
        ctx: Context,
        workflow_id: WorkflowId,
        runner: Annotated[
            str | None,
            Field(
                min_length=1,
                max_length=200,
                description="Your name as a runner (the stream's consumer name).",
            ),
        ] = None,
        lease_seconds: Annotated[
            float | None,
            Field(
                ge=1,
                le=3600,
                description="How long the step is yours (default: the workflow's lease).",
            ),
        ] = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            lease_ms = None if lease_seconds is None else int(lease_seconds * 1000)
            taken = await store.take_steps(
                workflow_id, runner or DEFAULT_RUNNER, count=1, lease_ms=lease_ms
            )
            if not taken:
                return f"status: ok\nNo step of workflow '{replies.shown(workflow_id)}' is ready."
            return claim_text(taken[0])

        return await run_tool(ctx, work)

    @server.tool(
        description="Record that a run's current step finished: the run moves to its next "
        "step (named in the reply) or, after the last step, completes. A step that is not "
        "the current one, or a run that has ended, is refused; with a lease, a result "
        "after the lease passed to another runner is refused too (the result is discarded)."
    )
    async def complete_step(
        ctx: Context,
        run_id: RunId,
        step: Annotated[str, Field(description="The step that finished (the current one).")],
        lease: Lease = None,
        output: Annotated[
            Any,
            Field(
                description="The step's output (any JSON value, at most 64 KiB encoded): "
                "stored on the run and given to the next step's claim.",
            ),
        ] = None,
        request_id: RequestId = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            result = await store.complete_step(
                run_id, step, lease=lease, output=output, op_id=request_id
            )
            return replies.step_text(step, result)

        return await run_tool(ctx, work)

    @server.tool(
        description="End a live run as failed, with an optional error text stored with the "
        "run. A run that has already ended is refused (STATE_RUN_NOT_LIVE). With retry: true "
        "(and the step and its lease), only this attempt of the step fails: the step is "
        "taken again after a backoff, and the run fails once the workflow's max_attempts "
        "are used."
    )
    async def fail_run(
        ctx: Context,
        run_id: RunId,
        error: Annotated[str, Field(description="Why it failed (stored with the run).")] = "",
        lease: Lease = None,
        retry: Annotated[
            bool,
            Field(description="Fail this attempt only; needs step and lease."),
        ] = False,
        step: Annotated[str | None, Field(description="With retry: the step that failed.")] = None,
        request_id: RequestId = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            if not retry:
                run = await store.fail_run(run_id, error, lease=lease, op_id=request_id)
                return replies.fail_text(run)
            if step is None or lease is None:
                raise RealmError(
                    "VALIDATION_PARAMS", "fail_run: retry needs the step and its lease"
                )
            failure = await store.fail_step(run_id, step, error, lease=lease, op_id=request_id)
            return retry_text(step, failure)

        return await run_tool(ctx, work)


def claim_text(taken: TakenStep) -> str:
    """A claimed step, in the lines of Realm's text replies: what to do, and the lease to
    report it with. Every value a sender or caller chose is escaped (``replies.shown``)."""
    until = _time(taken.lease_until_ms)
    step = replies.shown(taken.step)
    return "\n".join(
        [
            "status: ok",
            f"run_id: {taken.run_id}",
            f"step: {step}",
            f"attempt: {taken.attempt}",
            f"lease: {replies.shown(taken.lease)}",
            f"lease_until: {until}",
            f"params: {_json_line(taken.params)}",
            f"output: {_json_line(taken.output)}",
            f"Step '{step}' of run '{taken.run_id}' is yours until {until}; report it with "
            "complete_step or fail_run, passing lease.",
        ]
    )


def retry_text(step: str, failure: StepFailure) -> str:
    """A failed attempt (``StepFailure``): taken again after its backoff, or the run failed."""
    lines = ["status: ok", f"run_id: {failure.run_id}", f"phase: {failure.phase}",
             f"attempt: {failure.attempt}"]  # fmt: skip
    shown = replies.shown(step)
    if failure.phase == "running" and failure.retry_at_ms is not None:
        at = _time(failure.retry_at_ms)
        lines.append(f"retry_at: {at}")
        lines.append(
            f"Attempt {failure.attempt} of step '{shown}' failed; the step is ready again at {at}."
        )
    else:
        lines.append(
            f"Attempt {failure.attempt} of step '{shown}' failed, the last one; "
            f"run '{failure.run_id}' failed."
        )
    return "\n".join(lines)


def _time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _json_line(value: Any) -> str:
    """A JSON value on one line: orjson escapes line breaks and C0 controls; the other
    characters a terminal or a line reader could act on (DEL, C1, U+2028) too."""
    text = orjson.dumps(value).decode()
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code > 0xFFFF:  # JSON spells it as a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"
