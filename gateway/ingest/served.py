"""What one worker serves now: a version of the config, its triggers by path, and the
store bound to its workflows. A reload (gateway/serving/reload.py) builds a new ``Serving``
and swaps it in with one assignment; each request takes the one current when it
arrives and keeps it to the end, so every delivery is handled entirely by one
version of the configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.ingest.triggers import Trigger
from gateway.model.config import Config
from gateway.store.runstore import RunStore


def triggers_by_path(config: Config) -> dict[str, list[Trigger]]:
    """The config's triggers grouped by path, in the file's order."""
    by_path: dict[str, list[Trigger]] = {}
    for trigger in config.triggers.values():
        by_path.setdefault(trigger.path, []).append(trigger)
    return by_path


@dataclass(frozen=True)
class Serving:
    config: Config
    by_path: Mapping[str, Sequence[Trigger]]
    store: RunStore

    @classmethod
    def of(cls, config: Config, store: RunStore) -> Serving:
        """``config`` served on ``store``'s connections."""
        if store.config is not config:
            store = store.with_config(config)
        return cls(config, triggers_by_path(config), store)

    @property
    def version(self) -> str:
        return self.config.version
