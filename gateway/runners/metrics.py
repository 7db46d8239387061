"""A runner's own metrics, served by ``realm work --metrics-port``.

The listener's ``/metrics`` reads the step streams instead (how many steps wait and
for how long); these count what one runner process did with the steps it took.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

STEPS = Counter(
    "realm_steps_total",
    "Steps a runner finished with, by outcome (gateway/runners/runner.py's words): ok (recorded), "
    "failed (recorded as a failure: retried later, or the run failed), discarded (the "
    "run had ended or moved on: the result was refused), unrecorded (the store stayed "
    "unavailable, or a stop cut the handler short: the step is taken again after its lease)",
    ["workflow", "step", "outcome"],
)
ATTEMPTS = Counter(
    "realm_step_attempts_total",
    "Handler runs (every attempt of a step, the first one included)",
    ["workflow", "step"],
)
LEASES_LOST = Counter(
    "realm_leases_expired_total",
    "Leases this runner held that lapsed before it reported: another runner may run the step",
    ["workflow"],
)
HANDLER = Histogram(
    "realm_handler_seconds", "Time from taking a step to its result recorded (mostly its handler)",
    ["workflow", "step"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)  # fmt: skip


def step_done(workflow: str, step: str, outcome: str, seconds: float | None) -> None:
    """One step a runner finished with: ``outcome`` as ``realm_steps_total`` lists;
    ``seconds`` from taking the step to its result, None when no handler ran (a step
    refused at once, or given back unrun at a stop): then no attempt is counted."""
    STEPS.labels(workflow, step, outcome).inc()
    if seconds is not None:
        ATTEMPTS.labels(workflow, step).inc()
        HANDLER.labels(workflow, step).observe(seconds)


def lease_expired(workflow: str) -> None:
    """A lease this runner held lapsed (extending it was refused, or its result was
    discarded as STATE_STEP_NOT_CURRENT while the run was still live)."""
    LEASES_LOST.labels(workflow).inc()


def serve_runner_metrics(port: int, addr: str = "127.0.0.1") -> None:
    """Serve this process's metrics at http://addr:port/metrics (a daemon thread)."""
    start_http_server(port, addr)
