"""Prometheus metrics served at ``/metrics``.

``realm listen`` runs its workers as separate processes, so it points
prometheus_client's multiprocess mode at a private folder before they start;
``/metrics`` then sums every worker, whichever one answers the scrape.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

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

REDIRECTIONS = Counter(
    "realm_redis_redirections_total",
    "Redis Cluster replies the listener's claims followed: moved (the slot has a new "
    "owner), ask (the slot is migrating), tryagain (its keys are split by a migration)",
    ["kind"],
)


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
