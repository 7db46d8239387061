"""A trigger's ``rate_limit``: at most ``limit`` runs started per ``period`` for one
value of its key template (a repository, a customer; by default the trigger as a
whole). A delivery past the limit starts nothing: 200, ``outcome: rate_limited``,
``STATE_RATE_LIMITED``, and nothing is recorded of it, so its redelivery once the
window has room may start its run. The count is a sliding window in Redis, kept and
checked in the claim's own script call, so gateway processes share it exactly and a
redelivery of a started event (deduplicated) never counts twice.

Pure code: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.ingest.idempotency import KeyTemplate
from gateway.ingest.values import HeaderLookup

__all__ = ["RateLimitSpec"]


@dataclass(frozen=True)
class RateLimitSpec:
    """``key`` None: one window for the whole trigger."""

    limit: int
    period_ms: int
    key: KeyTemplate | None = None

    def window(
        self, headers: HeaderLookup, doc: object, event_id: str, *, exact: bool = False
    ) -> str:
        """The window's name for this delivery; the key template's ExtractError or
        InexactNumber as the trigger's own key raises them."""
        if self.key is None:
            return ""
        return self.key.render(headers, doc, event_id, exact=exact)
