"""What the gateway records of each delivery (metrics, and one line in the delivery
log), and how every log line on stderr is written.

The delivery log is an access log: one line per delivery on stderr, written
straight into a buffered stream rather than through ``logging`` (a LogRecord per
delivery, and a write per line, cost more than the rest of the bookkeeping
together). The app flushes it every 0.2 s, before each /metrics scrape and at
shutdown; a warning line (a params mismatch, a 5xx) is flushed at once. Other
messages use ``logging``. The delivery and outcome counters are kept here too and
added to the metrics at each flush.

Every line has one format, the process's log format (``--log-format``): ``json``, one
object per line with ``event``, ``ts`` (UTC, milliseconds) and ``level`` first, for a
log collector; or ``text``, the plain message, for a person at a terminal. The
delivery log, the ``realm`` loggers, uvicorn's and the runner's all follow it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import os
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
    "Per trigger of a delivery: started, queued, scheduled, deduplicated, stale, "
    "rate_limited, handshake, refused or ignored",
    ["trigger", "workflow", "outcome"],
)
LATENCY = Histogram(
    "realm_delivery_seconds", "Time from request to reply, body read included", ["path"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)  # fmt: skip


# The log formats, the default first; REALM_LOG_FORMAT carries the choice to the
# worker processes `realm listen` spawns.
LOG_FORMATS = ("json", "text")
LOG_FORMAT_ENV = "REALM_LOG_FORMAT"


class DeliveryLog:
    def __init__(self, stream: BinaryIO | None = None, log_format: str | None = None) -> None:
        # fd 2 with a buffer of its own (sys.stderr flushes at every line).
        self.stream = stream or open(2, "wb", buffering=1 << 16, closefd=False)  # noqa: SIM115
        self._counts: collections.Counter[tuple[Any, ...]] = collections.Counter()
        self.text = (log_format or current_log_format()) == "text"

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
            "ts": timestamp(time.time()),
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
            if self.text:
                self.stream.write(delivery_text(record).encode() + b"\n")
            else:
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


def current_log_format() -> str:
    """This process's log format: REALM_LOG_FORMAT's, else ``json``."""
    chosen = os.environ.get(LOG_FORMAT_ENV, "").strip().lower()
    return chosen if chosen in LOG_FORMATS else LOG_FORMATS[0]


def setup_logging(log_format: str | None = None) -> None:
    """Log to stderr in ``log_format`` (default: ``current_log_format()``), once per
    process: ``realm listen`` and ``realm work`` call it, and so does each worker
    process the listener spawns. The format is written to REALM_LOG_FORMAT, so those
    workers log alike."""
    root = logging.getLogger()
    if getattr(root, "_realm_configured", False):
        return
    chosen = log_format or current_log_format()
    os.environ[LOG_FORMAT_ENV] = chosen
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if chosen == "text" else JsonFormatter())
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root._realm_configured = True  # type: ignore[attr-defined]


class _Clock:
    """The ``YYYY-MM-DDTHH:MM:SS`` of the last second asked for: a delivery line's
    time costs a cached string and its milliseconds, not a strftime."""

    second = -1
    prefix = ""


def timestamp(now: float) -> str:
    """``now`` (Unix seconds) as ISO 8601 UTC with milliseconds: ``2025-06-01T12:00:00.123Z``."""
    second = int(now)
    if second != _Clock.second:
        _Clock.prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _Clock.second = second
    return f"{_Clock.prefix}.{int((now - second) * 1000):03d}Z"


def _structured(record: logging.LogRecord) -> dict[str, Any] | None:
    """The fields of a message that is itself one JSON object (a config reload's
    line, the request path's error line), else None."""
    message = record.getMessage()
    if not message.startswith("{"):
        return None
    try:
        fields = orjson.loads(message)
    except orjson.JSONDecodeError:
        return None
    return fields if isinstance(fields, dict) else None


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``event`` (``log`` for a plain message), ``ts``,
    ``level``, then ``logger`` and ``message``, or the fields of a message that is a
    JSON object already."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _structured(record)
        line: dict[str, Any] = {
            "event": (fields or {}).get("event", "log"),
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
        }
        if fields is None:
            line["logger"] = record.name
            line["message"] = record.getMessage()
        else:
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    """The message as it is; a JSON-object message as ``event: name=value …``."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _structured(record)
        if fields is None:
            text = record.getMessage()
        else:
            event = fields.pop("event", "log")
            fields.pop("level", None)
            text = f"{event}: " + " ".join(f"{k}={_plain(v)}" for k, v in fields.items())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def delivery_text(record: dict[str, Any]) -> str:
    """A delivery log record as one line of text, e.g. ``delivery /hooks/github 202
    (1.2 ms): github-push started run 6c48… (event id 72d3…); github-preview ignored``."""
    head = f"delivery {_plain(record['path'])} {record['status']} ({record['ms']} ms)"
    if record["level"] != "info":
        head = f"{record['level']}: {head}"
    if "results" not in record:
        return f"{head}: {record.get('code')}"
    parts = []
    for r in record["results"]:
        part = f"{r['trigger']} {r['outcome']}"
        if r.get("code"):
            part += f" {r['code']}"
        if r.get("run_id"):
            part += f" run {r['run_id']}"
        if r.get("event_id") is not None:
            part += f" (event id {_plain(r['event_id'])})"
        if r.get("params_mismatch"):
            part += " params mismatch"
        parts.append(part)
    return f"{head}: " + "; ".join(parts)


def _plain(value: object) -> str:
    """A value in a text line: as it is when a plain word; else as a JSON literal
    (escaped), so that a sender's value cannot break or forge a line."""
    if isinstance(value, str) and value.isprintable() and value and " " not in value:
        return value if not value.startswith('"') else json.dumps(value)
    return json.dumps(value, default=str)
