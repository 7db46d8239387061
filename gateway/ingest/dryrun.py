"""``realm triggers test``: a delivery walked through the request path, writing nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.ingest.delivery import Reply, TriggerResult, handle
from gateway.ingest.replies import shown
from gateway.ingest.triggers import Trigger
from gateway.ingest.webhooks import RequestHeaders
from gateway.signatures.sign import sign as sign_body
from gateway.store.runstore import RunStore


async def dry_run(
    store: RunStore,
    triggers: Sequence[Trigger],
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    sign: bool,
) -> dict[str, Any]:
    """The request path's own walk (``delivery.handle`` with ``dry_run``), reported
    per trigger. ``sign``: each trigger's scheme signs the body first (the headers
    given win), so one command checks a config against a sample payload."""
    now = time.time()
    report: dict[str, Any] = {"path": triggers[0].path, "triggers": []}
    for trigger in triggers:
        sent = list(headers)
        if sign:
            given = {name.lower() for name, _ in sent}
            event_id = next((v for n, v in sent if n.lower() in ("webhook-id", "svix-id")), None)
            added = sign_body(trigger.verify, body, now, event_id=event_id)
            sent += [(n, v) for n, v in added.items() if n.lower() not in given]
        lookup = RequestHeaders([(n.lower().encode(), v.encode()) for n, v in sent])
        # One trigger at a time: signing is per trigger, so each is walked with the
        # headers its own scheme signed.
        reply = await handle(
            store, [trigger], lookup, lookup.get("content-type"), body, dry_run=True
        )
        report["triggers"].append(_entry(reply, reply.walk[0]))
    report["status"] = verdict([entry["status"] for entry in report["triggers"]])
    return report


def verdict(statuses: Sequence[int]) -> int:
    """The status the listener would answer with, from its triggers' (as
    ``delivery.handle`` combines them): 401 when no signature verified; else a 5xx or
    4xx wins over a start (202), and a start over a deduplication or a non-match (200)."""
    verified = [status for status in statuses if status != 401]
    return max(verified, key=lambda s: {200: 0, 202: 1}.get(s, s)) if verified else 401


def _entry(reply: Reply, step: TriggerResult) -> dict[str, Any]:
    """What the walk said of one trigger, as the report shows it."""
    entry: dict[str, Any] = {"trigger": step.trigger, "workflow": step.workflow}
    # What the listener's reply would say of this trigger (503: Redis did not answer).
    entry["status"] = 503 if step.outcome == "unknown" else step.status
    entry["signature"] = "ok" if step.signature == "ok" else f"fails: {step.signature}"
    if step.signature != "ok":
        entry["result"] = "401: signature did not verify"
        return entry
    if reply.status == 400:
        entry["result"] = f"400: {reply.body['message']}"
        return entry
    if step.outcome == "handshake":
        entry["result"] = f"{step.status}: {step.message}"
        return entry
    entry["matched"] = bool(step.matched)
    if not step.matched:
        entry["result"] = f"ignored: {step.why_not}"
        return entry
    if step.key is not None:
        entry.update(event_id=step.event_id, key=step.key, params=step.params)
    if step.outcome in ("refused", "stale", "rate_limited"):
        entry["result"] = f"{step.status}: {step.code}: {step.message}"

    elif step.outcome == "unknown":
        entry["result"] = f"claim unknown: {step.message}"
    else:
        entry["result"] = f"a claim now would {step.decision}"
    return entry


def format_report(report: dict[str, Any]) -> str:
    lines = [f"POST {report['path']} (dry run: nothing is written)"]
    for entry in report["triggers"]:
        lines.append(f"trigger {entry['trigger']} → {entry['workflow']}")
        lines.append(f"  signature: {entry['signature']}")
        if "matched" in entry:
            lines.append(f"  when: {'all hold' if entry['matched'] else 'not matched'}")
        for name in ("event_id", "key"):
            if name in entry:
                # The sender's values: escaped, so they cannot forge report lines.
                lines.append(f"  {name.replace('_', ' ')}: {shown(str(entry[name]))}")
        if "params" in entry:
            lines.append(f"  params: {orjson.dumps(entry['params']).decode()}")
        lines.append(f"  result: {entry['result']}")
    return "\n".join(lines)
