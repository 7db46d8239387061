"""The reply texts of a run start, shared by the CLI, MCP and the HTTP API.

Text replies are read line by line, often by an agent: a value that came from a
sender or a caller (an idempotency key, an error text, params) must not be able to
add a line of its own (``\nstatus: ok``) or drive the terminal (ANSI escapes).
Such values go through ``shown``; error messages through ``_message``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.model.errors import RealmError
from gateway.store.runs import BatchEntry, Run, StartResult, StepResult

_SHORT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(char: str) -> str:
    """JSON's escape for one character (a surrogate pair above U+FFFF)."""
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    if code > 0xFFFF:
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def shown(value: str) -> str:
    """A value as a text reply prints it: unchanged when it is plain (printable, no
    line breaks or escape characters, not starting with a quote); otherwise as a
    JSON string literal, quotes included, whose escapes hide every control,
    format and line-separator character. Injective: a plain value never starts
    with '"', and a quoted one decodes (``json.loads``) to the original."""
    if value.isprintable() and not value.startswith('"'):
        return value
    escaped = "".join(
        char if char.isprintable() and char not in '"\\' else _escape_char(char) for char in value
    )
    return f'"{escaped}"'


def _unprintable_escaped(text: str) -> str:
    """``text`` with each non-printable character (a space aside) as a JSON escape;
    for JSON text (orjson leaves DEL, C1 controls and U+2028 raw)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else _escape_char(c) for c in text)


# Lines a multi-line error message has by design (VALIDATION_BATCH_ITEMS): a newline
# followed by anything else came from a value inside the message.
_CONTINUATION = re.compile(
    r"  - item \d+: |One or more items failed schema validation\. No runs were created\.$"
)


def _message(message: str) -> str:
    """An error message for a text reply: messages quote values the caller gave (a
    workflow name, a step, a JSON path into params), so a newline stays one only
    where the message's own structure puts it; every other non-printable
    character is shown as its escape."""
    lines = message.split("\n")
    out = _unprintable_escaped(lines[0])
    for line in lines[1:]:
        joint = "\n" if _CONTINUATION.match(line) else "\\n"
        out += joint + _unprintable_escaped(line)
    return out


def start_sentence(result: StartResult) -> str:
    if result.phase == "running":
        after = f" Ready for the agent: '{shown(result.next_step or '-')}'."
    elif result.phase == "queued":
        after = " It waits behind the live runs of its idempotency key; no step is ready."
    elif result.phase == "scheduled":
        due = "" if result.due_ms is None else f" at {_utc(result.due_ms)}"
        after = f" It is scheduled to start{due}; no step is ready."
    else:
        after = f" The run has ended ('{result.phase}'); no step is ready."
    if result.debounced:
        return (
            f"Scheduled run '{result.run_id}' of workflow '{shown(result.workflow)}' takes "
            f"these params, and waits again (debounce).{after}"
        )
    if result.deduped:
        return (
            f"Matched existing run '{result.run_id}' (idempotent) in phase '{result.phase}'; "
            f"no new run created.{after}"
        )
    if result.rerun_of:
        return (
            f"Run '{result.run_id}' created for workflow '{shown(result.workflow)}'; it "
            f"supersedes run '{result.rerun_of}' under the same idempotency key "
            f"({result.superseded_by}).{after}"
        )
    return f"Run '{result.run_id}' created for workflow '{shown(result.workflow)}'.{after}"


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


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
        **({"due_ms": result.due_ms} if result.due_ms is not None else {}),
        "message": start_sentence(result),
    }


def error_text(error: RealmError, *, batch_id: str | None = None) -> str:
    """``batch_id``: a batch start whose outcome is unknown (STORE_UNAVAILABLE) names
    its batch, so that the caller can send it again with that id."""
    text = f"status: error\n{error.code}: {_message(error.message)}"
    return text if batch_id is None else f"{text}\nbatch_id: {shown(batch_id)}"


def error_json(error: RealmError, *, batch_id: str | None = None) -> dict[str, Any]:
    reply = {"status": "error", "code": error.code, "message": error.message}
    return reply if batch_id is None else {**reply, "batch_id": batch_id}


def batch_text(entries: list[BatchEntry]) -> str:
    """One line per item, as in Realm's documentation:
    ``order-21    run baf9ec57-…  deduped: false``."""
    labels = [shown(e.idempotency_key) if e.idempotency_key else f"item {e.index}" for e in entries]
    width = max(len(label) for label in labels)
    lines = []
    for label, entry in zip(labels, entries, strict=True):
        if entry.result is not None:
            deduped = "true" if entry.result.deduped else "false"
            lines.append(f"{label.ljust(width)}  run {entry.result.run_id}  deduped: {deduped}")
        else:
            assert entry.error is not None
            lines.append(
                f"{label.ljust(width)}  error {entry.error.code}: {_message(entry.error.message)}"
            )
    return "\n".join(lines)


def batch_reply_text(batch_id: str, entries: list[BatchEntry]) -> str:
    """A batch's whole text reply: its id (send it again with a retry), then the items."""
    return f"status: ok\nbatch_id: {shown(batch_id)}\n{batch_text(entries)}"


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
        return f"Step '{shown(step)}' done. Ready for the agent: '{shown(result.next_step)}'."
    return f"Step '{shown(step)}' done; run '{result.run_id}' is completed."


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
        f"Workflow: {shown(run.workflow)}",
        f"Phase: {run.phase}",
        f"Step: {shown(run.step or '-')} ({' → '.join(shown(s) for s in run.steps)})",
        f"Idempotency key: {shown(run.key) if run.key else '-'}",
        f"Params: {_unprintable_escaped(orjson.dumps(dict(run.params)).decode())}",
        f"Created: {_ms(run.created_ms)}",
        f"Updated: {_ms(run.updated_ms)}",
    ]
    if run.ended_ms:
        lines.append(f"Ended: {_ms(run.ended_ms)}")
    if run.due_ms:
        lines.append(f"Due: {_ms(run.due_ms)}")
    if run.rerun_of:
        lines.append(f"Rerun of: {run.rerun_of}")
    if run.error:
        lines.append(f"Error: {shown(run.error)}")
    return "\n".join(lines)


RUN_LINE_HEADER = f"{'RUN ID':<36}  {'WORKFLOW':<16} {'PHASE':<10} {'STEP':<12} KEY"


def run_line(run: Run) -> str:
    """One line of ``realm run list`` (columns as ``RUN_LINE_HEADER`` names them)."""
    key = shown(run.key) if run.key else "-"
    step = shown(run.step or "-")
    return f"{run.id}  {shown(run.workflow):<16} {run.phase:<10} {step:<12} {key}"


def _ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
