"""Several GitHub hooks on one path: the triggers that would take one event, sent by
two hooks, as one piece of work.

GitHub's ``X-GitHub-Delivery`` names an event, not a hook: every repository hook,
organisation hook and GitHub App that receives one event gets the same value. Two
triggers of one path that verify with different secrets serve different hooks; when
they start one workflow under a key that the delivery id alone decides, the second
hook's copy of an event finds the run the first one started and is deduplicated onto
it, silently. ``shared_delivery_warnings`` finds such triggers, for
``realm triggers check`` and the start-up lines of ``realm listen``.

Pure code: no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from gateway.ingest.conditions import Condition
from gateway.ingest.triggers import Trigger

__all__ = ["HOOK_KEY", "shared_delivery_warnings"]

# The key that keeps each hook's copy of an event apart (docs/triggers.md).
HOOK_KEY = "{header:X-GitHub-Hook-ID}:{header:X-GitHub-Delivery}"
_DELIVERY = "x-github-delivery"
# Headers that tell two hooks' copies of one event apart: the hook's own id, or the
# id of what it is installed on (a repository, an organisation, a GitHub App).
_HOOK_IDS = frozenset({"x-github-hook-id", "x-github-hook-installation-target-id"})
# Headers whose value differs between the hooks of one event: a `when` on them says
# nothing about which events a trigger takes.
_PER_HOOK = "x-github-hook-"

# One part of a key, as what it reads: ("text", literal), ("header", lower-case name),
# ("path", JSONPath) or ("event_id", JSONPath) for an event id read from the body.
_Shape = tuple[tuple[str, str], ...]


def shared_delivery_warnings(triggers: Iterable[Trigger]) -> list[str]:
    """One sentence per set of triggers (same path, same workflow, the same key from
    ``X-GitHub-Delivery`` and no hook id in it) that verify with different secrets
    and may take one event: naming the path, the triggers and the fix."""
    groups: dict[tuple[str, str, _Shape], list[Trigger]] = {}
    for trigger in triggers:
        shape = _key_shape(trigger)
        reads = {name for kind, name in shape if kind == "header"}
        if _DELIVERY in reads and not reads & _HOOK_IDS:
            groups.setdefault((trigger.path, trigger.workflow, shape), []).append(trigger)
    warnings = []
    for (path, workflow, _), group in groups.items():
        risky: set[str] = set()
        for a, b in itertools.combinations(group, 2):
            # The same secrets: every delivery verifies for both, whichever hook sent it,
            # and a hook id could not tell their runs apart.
            if set(a.verify.secret_env) != set(b.verify.secret_env) and not _never_both(a, b):
                risky.update((a.name, b.name))
        if risky:
            names = [t.name for t in group if t.name in risky]  # in the file's order
            warnings.append(_sentence(path, workflow, names))
    return warnings


def _sentence(path: str, workflow: str, names: list[str]) -> str:
    quoted = [f"'{name}'" for name in names]
    listed = f"{', '.join(quoted[:-1])} and {quoted[-1]}"
    each = "both keys" if len(names) == 2 else "each key"
    return (
        f"path {path}: triggers {listed} verify with different secrets (different hooks) "
        f"but give workflow '{workflow}' the same key from X-GitHub-Delivery, which GitHub "
        f"sends alike to every hook of an event: one hook's delivery joins the run another "
        f'hook\'s started; put the hook id in {each}: key: "{HOOK_KEY}"'
    )


def _key_shape(trigger: Trigger) -> _Shape:
    """The key as what it reads, in order: two triggers with the same shape give one
    event the same key (its values are escaped alike, the separators being the same)."""
    shape: list[tuple[str, str]] = []
    for kind, text, ref, _ in trigger.key.parts:
        if kind == "event_id":
            source = trigger.event_id
            if source.header is not None:
                # `{event_id}` from a header is that header's text, as `{header:…}` is.
                shape.append(("header", source.header.lower()))
            else:
                assert source.path is not None
                shape.append(("event_id", source.path.expr))
        elif kind == "header":
            shape.append(("header", str(ref).lower()))
        else:
            shape.append((kind, text))
    return tuple(shape)


def _never_both(a: Trigger, b: Trigger) -> bool:
    """Whether no event can match both: each tests one event-wide header or JSONPath
    for values (`equals`, `in`) the other's test of it does not allow (a push trigger
    and a pull request trigger). Anything less certain counts as a possible overlap."""
    return any(
        _same_source(x, y) and not _allowed(x) & _allowed(y)
        for x in a.when
        for y in b.when
        if _allowed(x) and _allowed(y)
    )


def _same_source(x: Condition, y: Condition) -> bool:
    if x.header is not None and y.header is not None:
        name = x.header.lower()
        return name == y.header.lower() and not name.startswith(_PER_HOOK)
    return x.path is not None and y.path is not None and x.path.expr == y.path.expr


def _allowed(condition: Condition) -> frozenset[str]:
    """The string values an `equals` or `in` test allows; empty for any other test,
    or one with a value that is not a string (JSON equality is not a set's)."""
    if condition.test == "equals":
        values: tuple[object, ...] = (condition.operand,)
    elif condition.test == "in":
        values = condition.operand  # type: ignore[assignment]
    else:
        return frozenset()
    if not all(isinstance(v, str) for v in values):
        return frozenset()
    return frozenset(values)  # type: ignore[arg-type]
