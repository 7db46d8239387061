"""What the gateway records of each delivery: metrics and one JSON log line."""

from __future__ import annotations

import asyncio
import functools
import io
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
    _deliveries(path, reply.status).inc()
    _latency(path).observe(seconds)
    for r in reply.results:
        _outcomes(r.trigger, r.workflow, r.outcome).inc()
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


# Labelled children, looked up once: the label sets are few (paths x statuses,
# triggers x outcomes), and a lookup per delivery is measurable on the hot path.
@functools.cache
def _deliveries(path: str, status: int) -> Any:
    return metrics.DELIVERIES.labels(path, str(status))


@functools.cache
def _latency(path: str) -> Any:
    return metrics.LATENCY.labels(path)


@functools.cache
def _outcomes(trigger: str, workflow: str, outcome: str) -> Any:
    return metrics.OUTCOMES.labels(trigger, workflow, outcome)


class BatchedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record into a buffered stream at once; the stream reaches the file
    when its buffer fills, when ``flush_logs`` runs (the app does, every 0.2 s) and
    at once for warnings and errors. A write syscall per delivery costs more, under
    load, than the delivery's own logging."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + "\n")
            if record.levelno >= logging.WARNING:
                self.stream.flush()
        except Exception:
            self.handleError(record)


def flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()


async def flush_logs_every(interval: float = 0.2) -> None:
    """Runs for the life of the app, on its event loop (no thread to share the GIL with)."""
    while True:
        await asyncio.sleep(interval)
        flush_logs()


def buffered_stderr() -> Any:
    """A text stream on fd 2 that is not line-buffered (sys.stderr always is)."""
    raw = open(2, "wb", buffering=1 << 16, closefd=False)  # noqa: SIM115 - lives as long as the process
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", line_buffering=False)


def setup_logging() -> None:
    """Log lines as they are (the delivery lines are JSON already) to stderr, once per
    process: ``realm listen`` calls it, and so does each worker process it spawns."""
    root = logging.getLogger()
    if any(isinstance(h, BatchedStreamHandler) for h in root.handlers):
        return
    handler = BatchedStreamHandler(buffered_stderr())
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
