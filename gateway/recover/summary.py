"""What one run of ``realm recover`` found and did: an outcome per event, counted in
one line at the end (or one JSON object), and the line printed for each event acted on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.model.words import noun, plural
from gateway.recover.http import Waited

# The outcomes of an event, in the order the summary counts them.
OK = "ok"  # the sender counts it as delivered (GitHub: an attempt answered 2xx)
HERE = "already here"  # a claim here would not start a run: the event has one
NOT_MATCHED = "not matched"  # no trigger of the path matches it
REFUSED = "refused"  # a trigger matches it but refuses it (params, body): so would a retry
IN_FLIGHT = "in flight"  # redelivered a moment ago (GitHub): the next run looks again
REDELIVERED = "redelivered"  # asked the sender to deliver it again (GitHub)
STARTED = "started"  # claimed here, a run started (Stripe)
FAILED = "failed"  # could not be checked or brought here: the exit code says so

# What a dry run says instead of what it would have done.
DRY = {REDELIVERED: "to redeliver", STARTED: "to start"}
WOULD = {REDELIVERED: "would redeliver", STARTED: "would start"}
GITHUB_OUTCOMES = (OK, HERE, NOT_MATCHED, REFUSED, IN_FLIGHT, REDELIVERED, FAILED)
STRIPE_OUTCOMES = (HERE, NOT_MATCHED, REFUSED, STARTED, FAILED)
# The outcomes printed as a line each as they happen (the rest are only counted).
SHOWN = (REFUSED, IN_FLIGHT, REDELIVERED, STARTED, FAILED)


@dataclass(frozen=True)
class Item:
    """One event and what became of it. ``id``: GitHub's guid or Stripe's event id;
    ``kind``: the event name (GitHub) or type (Stripe); ``at``: when the sender last
    tried to deliver it (GitHub) or created it (Stripe), ISO 8601."""

    id: str
    kind: str
    action: str | None
    at: str
    outcome: str
    why: str


@dataclass
class Summary:
    """A run's items; ``examined``: the sender's records looked at (GitHub lists every
    attempt, so an event may have several). ``error``: why the run stopped early."""

    outcomes: Sequence[str]
    dry_run: bool
    examined: int = 0
    items: list[Item] = field(default_factory=list)
    waited: Waited = field(default_factory=Waited)
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.count(FAILED) > 0

    def count(self, outcome: str) -> int:
        return sum(1 for item in self.items if item.outcome == outcome)

    def word(self, outcome: str) -> str:
        return DRY.get(outcome, outcome) if self.dry_run else outcome

    def line(self, records: str) -> str:
        """The one-line summary; ``records``: what the sender's records are called
        ("delivery", "event")."""
        counts = ", ".join(f"{self.count(o)} {self.word(o)}" for o in self.outcomes)
        events = len(self.items)
        head = f"examined {plural(self.examined, records, _plural(records))}"
        if records != "event":
            head += f" ({plural(events, 'event')})"
        text = f"{'dry run: ' if self.dry_run else ''}{head}: {counts}"
        if self.waited.replies:
            replies = plural(self.waited.replies, "rate-limit reply", "rate-limit replies")
            text += f"; waited out {replies} ({self.waited.seconds:.1f} s)"
        return text

    def as_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "examined": self.examined,
            "events": len(self.items),
            **{_field(self.word(o)): self.count(o) for o in self.outcomes},
            "rate_limited": self.waited.replies,
            "waited_s": round(self.waited.seconds, 3),
            "error": self.error,
            "items": [
                {**asdict(item), "outcome": _field(self.word(item.outcome))} for item in self.items
            ],
        }


def item_line(item: Item, dry_run: bool) -> str:
    """One event acted on: outcome, id, kind, action, time, why (two spaces apart)."""
    word = WOULD.get(item.outcome, item.outcome) if dry_run else item.outcome
    return "  ".join([word, item.id, item.kind or "-", item.action or "-", item.at, item.why])


def _field(word: str) -> str:
    return word.replace(" ", "_")


def _plural(word: str) -> str:
    return noun(2, word, word[:-1] + "ies" if word.endswith("y") else None)
