"""``realm triggers test``: a delivery walked through the request path, writing nothing."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.datastructures import Headers

from gateway.delivery import fingerprint_for, markers_for
from gateway.errors import RealmError, StoreUnavailable
from gateway.extract import BodyError, parse_body
from gateway.replies import shown
from gateway.runs import canonical_params, check_key, fingerprint_of
from gateway.store import RunStore
from gateway.triggers import Trigger
from gateway.verify import sign as sign_body
from gateway.verify import verify

DECISIONS = {
    "start": "start a new run",
    "rerun": "start a new run that supersedes run {run}",
    "existing": "return run {run} (deduplicated, phase '{phase}')",
    "active": "refuse: STATE_RUN_ALREADY_ACTIVE (run {run} is live)",
    "used": "refuse: STATE_IDEMPOTENCY_KEY_USED (run {run} ended as '{phase}')",
    "conflict": "refuse: STATE_IDEMPOTENCY_KEY_CONFLICT (run {run} has other params)",
}


async def dry_run(
    store: RunStore,
    triggers: Sequence[Trigger],
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    sign: bool,
) -> dict[str, Any]:
    now = time.time()
    report: dict[str, Any] = {"path": triggers[0].path, "triggers": []}
    body_digest = hashlib.sha256(body).hexdigest()
    for trigger in triggers:
        entry: dict[str, Any] = {"trigger": trigger.name, "workflow": trigger.workflow}
        report["triggers"].append(entry)
        sent = list(headers)
        if sign:
            given = {name.lower() for name, _ in sent}
            event_id = next((v for n, v in sent if n.lower() == "webhook-id"), None)
            added = sign_body(trigger.verify, body, now, event_id=event_id)
            sent += [(n, v) for n, v in added.items() if n.lower() not in given]
        lookup = Headers(raw=[(n.lower().encode(), v.encode()) for n, v in sent])
        reason = verify(trigger.verify, lookup, body, now)
        entry["signature"] = "ok" if reason is None else f"fails: {reason}"
        if reason is not None:
            entry["result"] = "401: signature did not verify"
            continue
        try:
            doc = parse_body(body, lookup.get("content-type"))
        except BodyError as exc:
            entry["result"] = f"400: body is not parseable: {exc}"
            continue
        why_not = trigger.match(lookup, doc)
        if why_not is not None:
            entry["matched"] = False
            entry["result"] = f"ignored: {why_not}"
            continue
        entry["matched"] = True
        try:
            extracted = trigger.extract(lookup, doc, body)
            entry.update(event_id=extracted.event_id, key=extracted.key, params=extracted.params)
            # The checks start_run applies before its claim (extract already
            # bounds the key's length; check_key is the store's own word on it).
            check_key(extracted.key)
            store.config.workflow(trigger.workflow).check_params(extracted.params)
        except RealmError as exc:
            entry["result"] = f"422: {exc.code}: {exc.message}"
            continue
        try:
            decision, state = await store.preview_start(
                trigger.workflow, extracted.key, trigger.on_live_match,
                trigger.on_terminal_match, trigger.on_params_mismatch,
                fingerprint_for(trigger, body_digest)
                or fingerprint_of(canonical_params(extracted.params)),
                markers=markers_for(store, trigger, extracted.event_id, body_digest),
            )  # fmt: skip
        except StoreUnavailable as exc:
            entry["result"] = f"claim unknown: {exc.message}"
            continue
        run = state.run_id if state else None
        phase = state.phase if state else None
        entry["result"] = "a claim now would " + DECISIONS[decision].format(run=run, phase=phase)
    return report


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
