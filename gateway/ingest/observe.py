"""What the gateway records of each delivery: metrics, and one JSON line in the delivery log.

The delivery log is an access log: one JSON object per line on stderr, written
straight into a buffered stream rather than through ``logging`` (a LogRecord per
delivery, and a write per line, cost more than the rest of the bookkeeping
together). The app flushes it every 0.2 s, before each /metrics scrape and at
shutdown; a warning line (a params mismatch, a 5xx) is flushed at once. Other
messages use ``logging``. The delivery and outcome counters are kept here too and
added to the metrics at each flush.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import sys
import time
from typing import Any, BinaryIO

import orjson
from prometheus_client import Counter, Histogram

from gateway.ingest.delivery import Reply

DELIVERIES = Counter(
    "realm_deliveries_total", "Webhook deliveries answered, by path and HTTP status",
    ["path", "status"],
)  # fmt: skip
OUTCOMES = Counter(
    "realm_trigger_outcomes_total",
    "Per trigger of a delivery: started, deduplicated, refused or ignored",
    ["trigger", "workflow", "outcome"],
)
LATENCY = Histogram(
    "realm_delivery_seconds", "Time from request to reply, body read included", ["path"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)  # fmt: skip


class DeliveryLog:
    def __init__(self, stream: BinaryIO | None = None) -> None:
        # fd 2 with a buffer of its own (sys.stderr flushes at every line).
        self.stream = stream or open(2, "wb", buffering=1 << 16, closefd=False)  # noqa: SIM115
        self._counts: collections.Counter[tuple[Any, ...]] = collections.Counter()

    def observe(self, path: str, reply: Reply, started: float) -> None:
        """Metrics and the log line. Never a header, a secret, a signature or the body."""
        seconds = time.perf_counter() - started
        counts = self._counts
        status = reply.status
        # Counted here, added to the metrics at the next flush: an increment of a
        # metric shared between worker processes costs a lock and a getpid each.
        counts[("delivery", path, status)] += 1
        _latency(path).observe(seconds)
        warning = status >= 500
        record: dict[str, Any] = {
            "event": "delivery",
            "level": "info",
            "path": path,
            "status": status,
            "ms": round(seconds * 1000, 2),
        }
        if reply.results:
            results = []
            for r in reply.results:
                counts[("outcome", r.trigger, r.workflow, r.outcome)] += 1
                line = {"trigger": r.trigger, "workflow": r.workflow, "event_id": r.event_id,
                        "outcome": r.outcome, "run_id": r.run_id}  # fmt: skip
                if r.code is not None:
                    line["code"] = r.code
                    if r.code == "STATE_IDEMPOTENCY_KEY_CONFLICT":
                        line["params_mismatch"] = warning = True
                if r.params_mismatch:
                    # The same event id came back with another body: worth a look.
                    line["params_mismatch"] = warning = True
                results.append(line)
            record["results"] = results
        else:
            record["code"] = reply.body.get("code")
        if warning:
            record["level"] = "warning"
        try:
            self.stream.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
            if warning:
                self.stream.flush()
        except (OSError, ValueError):  # stderr gone or closed: never fail a delivery
            pass

    def flush(self) -> None:
        """Write out the buffered lines and add the counts to the metrics."""
        counts, self._counts = self._counts, collections.Counter()
        for key, n in counts.items():
            if key[0] == "delivery":
                _deliveries(key[1], key[2]).inc(n)
            else:
                _outcomes(key[1], key[2], key[3]).inc(n)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    async def flush_every(self, interval: float = 0.2) -> None:
        """Runs for the life of the app, on its event loop."""
        while True:
            await asyncio.sleep(interval)
            self.flush()


# Labelled children, looked up once: the label sets are few (paths x statuses,
# triggers x outcomes), and a lookup per delivery is measurable on the hot path.
@functools.cache
def _deliveries(path: str, status: int) -> Any:
    return DELIVERIES.labels(path, str(status))


@functools.cache
def _latency(path: str) -> Any:
    return LATENCY.labels(path)


@functools.cache
def _outcomes(trigger: str, workflow: str, outcome: str) -> Any:
    return OUTCOMES.labels(trigger, workflow, outcome)


def setup_logging() -> None:
    """Log messages as they are to stderr, once per process: ``realm listen`` calls
    it, and so does each worker process it spawns."""
    root = logging.getLogger()
    if getattr(root, "_realm_configured", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root._realm_configured = True  # type: ignore[attr-defined]
