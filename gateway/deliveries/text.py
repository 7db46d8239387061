"""The delivery log as people type and read it (``realm deliveries``, the MCP tools): the
``since`` values they give, the list's table, one record's fields, a replay's reply.

Everything a sender chose (header values, the body, an error's text that quotes it)
is printed with its control characters escaped, so a stored delivery cannot add a
line of its own to a reply or drive the terminal (gateway/ingest/replies.py does the same
for run replies).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from gateway.ingest.replies import shown
from gateway.model.config import parse_retention
from gateway.model.errors import RealmError

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SINCE_HELP = (
    "an ISO 8601 time like 2026-05-01T12:00:00Z (UTC unless it names an offset) or a "
    "duration like 90m, 2h or 3d, meaning that long ago"
)


def parse_since(text: str, now_ms: int) -> int:
    """``since`` as ms since the epoch: a duration back from ``now_ms`` or an ISO 8601
    time; ``VALIDATION_PARAMS`` naming what is accepted otherwise."""
    try:
        return now_ms - parse_retention(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        clipped = text if len(text) <= 40 else text[:40] + "…"
        raise RealmError(
            "VALIDATION_PARAMS", f"since must be {SINCE_HELP} (got {clipped!r})"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    # Whole milliseconds by integer division: a float timestamp times 1000 can land
    # a hair below the millisecond a listed delivery's own time names.
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def check_cursor(text: str | None) -> str | None:
    """A cursor as a previous page returned it (the id that page ended at)."""
    # Here, not at the top: `realm` loads this module for the help texts of its
    # options, and the log's module imports the triggers and the metrics.
    from gateway.deliveries.log import DELIVERY_ID

    if text is not None and not DELIVERY_ID.fullmatch(text):
        clipped = text if len(text) <= 40 else text[:40] + "…"
        raise RealmError(
            "VALIDATION_PARAMS",
            f"cursor must be the value a previous page returned (got {clipped!r})",
        )
    return text


# -- the list ---------------------------------------------------------------------------


LIST_COLUMNS = ("DELIVERY ID", "RECEIVED", "STATUS", "PATH", "OUTCOMES")


def list_lines(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """A page of the log as a table, the header first; no line at all for no delivery."""
    if not summaries:
        return []
    rows = [LIST_COLUMNS] + [
        (
            s["delivery_id"],
            _time(s["received_ms"]),
            str(s["status"]),
            shown(s["path"]),
            _outcomes(s),
        )
        for s in summaries
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(LIST_COLUMNS))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _outcomes(summary: Mapping[str, Any]) -> str:
    """Each trigger's outcome (``github-push: started``), after the reply's error code
    if it had one (``AUTH_REQUIRED; github-push: unverified``)."""
    parts = [f"{shown(o['trigger'])}: {o['outcome']}" for o in summary["outcomes"]]
    text = "; ".join(p for p in (summary["code"], ", ".join(parts)) if p) or "-"
    if summary.get("replay_of"):
        text += f" (replay of {summary['replay_of']})"
    return text


# -- one record -------------------------------------------------------------------------


def record_text(record: Mapping[str, Any]) -> str:
    """``realm deliveries show``: the record's fields, each trigger's outcome and why,
    the headers as kept, the body (pretty-printed when it is JSON)."""
    lines = [
        f"Delivery: {record['delivery_id']}",
        f"Received: {_time(record['received_ms'])}",
        f"Path: {shown(record['path'])}",
        f"Status: {record['status']}",
    ]
    if record["code"]:
        lines.append(f"Error: {record['code']}: {_plain(record['message'] or '')}")
    if record["replay_of"]:
        how = " (rerun: new runs started)" if record["rerun"] else ""
        lines.append(f"Replay of: {record['replay_of']}{how}")
    lines.append(f"Config version: {record['config_version'] or '-'}")
    lines.append(f"Took: {record['ms']} ms")
    lines += trigger_lines(record["triggers"], refused=record["headers"] is None)
    lines += _headers_lines(record)
    lines += _body_lines(record)
    return "\n".join(lines)


def trigger_lines(triggers: Sequence[Mapping[str, Any]], *, refused: bool) -> list[str]:
    if not triggers:
        why = "refused before matching" if refused else "none matched"
        return [f"Triggers: {why}"]
    lines = ["Triggers:"]
    for t in triggers:
        lines.append(f"  {shown(t['trigger'])} → {shown(t['workflow'])}: {t['outcome']}")
        # Each step's word, in the request path's order (a record written before
        # these fields existed has none of them).
        if t.get("signature") is not None:
            lines.append(f"    signature: {_plain(t['signature'])}")
        if t["event_id"] is not None:
            lines.append(f"    event id: {shown(t['event_id'])}")
        if t.get("key") is not None:
            lines.append(f"    key: {shown(t['key'])}")
        if t.get("params") is not None:
            lines.append(f"    params: {_plain(orjson.dumps(t['params']).decode())}")
        if t["run_id"]:
            lines.append(f"    run: {t['run_id']}")
        if t["rerun_of"]:
            lines.append(f"    rerun of: {t['rerun_of']}")
        if t["message"] or t["code"]:
            why = f"{t['code']}: " if t["code"] else ""
            lines.append(f"    why: {why}{_plain(t['message'] or '')}")
    return lines


def _headers_lines(record: Mapping[str, Any]) -> list[str]:
    if record["headers"] is None:
        return ["Headers: not kept (refused before it was verified)"]
    lines = ["Headers (signatures and tokens are never kept):"]
    lines += [f"  {_plain(name)}: {_plain(value)}" for name, value in record["headers"]]
    return lines


def _body_lines(record: Mapping[str, Any]) -> list[str]:
    if record["headers"] is None:
        return ["Body: not kept (refused before it was verified)"]
    size = record["body_size"]
    if record["body"] is None:
        return [f"Body: {size} bytes, not stored (settings.store_bodies is false)"]
    text = record["body"]
    if record["body_truncated"]:
        kept = len(_body_bytes(record))
        title = f"Body: the first {kept} of {size} bytes (settings.max_stored_body_bytes)"
    else:
        title = f"Body: {size} bytes"
    if record["body_encoding"] == "base64":
        return [f"{title}, not UTF-8, as base64:", f"  {text}"]
    if not record["body_truncated"]:
        try:
            text = orjson.dumps(orjson.loads(text), option=orjson.OPT_INDENT_2).decode()
            title += ", JSON"
        except orjson.JSONDecodeError:
            pass
    return [f"{title}:", *(f"  {_plain(line)}" for line in text.split("\n"))]


def _body_bytes(record: Mapping[str, Any]) -> bytes:
    if record["body_encoding"] == "base64":
        return base64.b64decode(record["body"])
    return str(record["body"]).encode()


# -- a replay ---------------------------------------------------------------------------


def replay_text(record: Mapping[str, Any]) -> str:
    """The reply to a replay: the replay's own record in the lines of every run-start reply."""
    lines = [
        "status: ok",
        f"delivery_id: {record['delivery_id']}",
        f"replay_of: {record['replay_of']}",
        f"rerun: {'true' if record['rerun'] else 'false'}",
        f"reply: {record['status']}",
    ]
    lines += trigger_lines(record["triggers"], refused=False)
    return "\n".join(lines)


# -- helpers ----------------------------------------------------------------------------


def _time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _plain(text: str) -> str:
    """``text`` on one line as it is, each non-printable character as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    short = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if char in short:
        return short[char]
    code = ord(char)
    if code > 0xFFFF:
        return f"\\U{code:08x}"
    return f"\\u{code:04x}"
