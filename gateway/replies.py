"""The reply texts of DESIGN §4, shared by the CLI, MCP and the HTTP API."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.errors import RealmError
from gateway.runs import BatchEntry, Run, StartResult, StepResult


def start_sentence(result: StartResult) -> str:
    if result.phase == "running":
        after = f" Ready for the agent: '{result.next_step}'."
    else:
        after = f" The run has ended ('{result.phase}'); no step is ready."
    if result.deduped:
        return (
            f"Matched existing run '{result.run_id}' (idempotent) in phase '{result.phase}'; "
            f"no new run created.{after}"
        )
    if result.rerun_of:
        return (
            f"Run '{result.run_id}' created for workflow '{result.workflow}'; it supersedes run "
            f"'{result.rerun_of}' under the same idempotency key ({result.superseded_by}).{after}"
        )
    return f"Run '{result.run_id}' created for workflow '{result.workflow}'.{after}"


def start_text(result: StartResult) -> str:
    lines = [
        "status: ok",
        f"deduped: {'true' if result.deduped else 'false'}",
        f"run_id: {result.run_id}",
    ]
    if result.rerun_of:
        lines.append(f"rerun_of: {result.rerun_of}")
    if result.params_mismatch:
        lines.append("params_mismatch: true")
    lines.append(start_sentence(result))
    return "\n".join(lines)


def start_json(result: StartResult) -> dict[str, Any]:
    return {
        "status": "ok",
        "deduped": result.deduped,
        "run_id": result.run_id,
        "rerun_of": result.rerun_of,
        "workflow": result.workflow,
        "phase": result.phase,
        "next_step": result.next_step,
        "params_mismatch": result.params_mismatch,
        "message": start_sentence(result),
    }


def error_text(error: RealmError) -> str:
    return f"status: error\n{error.code}: {error.message}"


def error_json(error: RealmError) -> dict[str, Any]:
    return {"status": "error", "code": error.code, "message": error.message}


def batch_text(entries: list[BatchEntry]) -> str:
    """One line per item, as in Realm's documentation:
    ``order-21    run baf9ec57-…  deduped: false``."""
    labels = [e.idempotency_key or f"item {e.index}" for e in entries]
    width = max(len(label) for label in labels)
    lines = []
    for label, entry in zip(labels, entries, strict=True):
        if entry.result is not None:
            deduped = "true" if entry.result.deduped else "false"
            lines.append(f"{label.ljust(width)}  run {entry.result.run_id}  deduped: {deduped}")
        else:
            assert entry.error is not None
            lines.append(f"{label.ljust(width)}  error {entry.error.code}: {entry.error.message}")
    return "\n".join(lines)


def batch_json(entries: list[BatchEntry]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for entry in entries:
        item: dict[str, Any] = {"index": entry.index, "idempotency_key": entry.idempotency_key}
        if entry.result is not None:
            item.update(start_json(entry.result))
        elif entry.error is not None:
            item.update(error_json(entry.error))
        out.append(item)
    return out


def step_sentence(step: str, result: StepResult) -> str:
    if result.next_step:
        return f"Step '{step}' done. Ready for the agent: '{result.next_step}'."
    return f"Step '{step}' done; run '{result.run_id}' is completed."


def step_text(step: str, result: StepResult) -> str:
    return (
        f"status: ok\nrun_id: {result.run_id}\nphase: {result.phase}\n{step_sentence(step, result)}"
    )


def fail_text(run: Run) -> str:
    return f"status: ok\nrun_id: {run.id}\nphase: {run.phase}\nRun '{run.id}' failed."


def run_text(run: Run) -> str:
    """A run's fields, one per line, as ``realm run show`` prints them."""
    lines = [
        f"Run: {run.id}",
        f"Workflow: {run.workflow}",
        f"Phase: {run.phase}",
        f"Step: {run.step or '-'} ({' → '.join(run.steps)})",
        f"Idempotency key: {run.key or '-'}",
        f"Params: {orjson.dumps(dict(run.params)).decode()}",
        f"Created: {_ms(run.created_ms)}",
        f"Updated: {_ms(run.updated_ms)}",
    ]
    if run.ended_ms:
        lines.append(f"Ended: {_ms(run.ended_ms)}")
    if run.rerun_of:
        lines.append(f"Rerun of: {run.rerun_of}")
    if run.error:
        lines.append(f"Error: {run.error}")
    return "\n".join(lines)


def run_line(run: Run) -> str:
    """One line of ``realm run list``."""
    return f"{run.id}  {run.workflow:<16} {run.phase:<10} {run.step or '-':<12} {run.key or '-'}"


def _ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
