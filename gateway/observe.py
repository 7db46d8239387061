"""What the gateway records of each delivery: metrics and one JSON log line."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from gateway import metrics
from gateway.delivery import Reply

log = logging.getLogger("realm")


def observe_delivery(path: str, reply: Reply, started: float) -> None:
    """Metrics, and one JSON log line per delivery. Never a header, a secret, a
    signature or the body."""
    seconds = time.perf_counter() - started
    metrics.DELIVERIES.labels(path, str(reply.status)).inc()
    metrics.LATENCY.labels(path).observe(seconds)
    for r in reply.results:
        metrics.OUTCOMES.labels(r.trigger, r.workflow, r.outcome).inc()
    record: dict[str, Any] = {
        "event": "delivery",
        "path": path,
        "status": reply.status,
        "ms": round(seconds * 1000, 2),
    }
    if reply.results:
        record["results"] = [
            {
                "trigger": r.trigger,
                "workflow": r.workflow,
                "event_id": r.event_id,
                "outcome": r.outcome,
                "run_id": r.run_id,
                **({"code": r.code} if r.code else {}),
                **({"params_mismatch": True} if r.params_mismatch else {}),
            }
            for r in reply.results
        ]
    else:
        record["code"] = reply.body.get("code")
    mismatch = any(r.params_mismatch or r.code == "STATE_IDEMPOTENCY_KEY_CONFLICT"
                   for r in reply.results)  # fmt: skip
    level = logging.WARNING if mismatch or reply.status >= 500 else logging.INFO
    log.log(level, orjson.dumps(record).decode())
