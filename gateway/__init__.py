"""Realm Gateway: verified webhook deliveries become exactly-once workflow runs.

The public Python face. Programs import from here; the subpackages are arranged by
capability (see docs/architecture.md) and may move their modules between releases::

    from gateway import EmbeddedServer, RunStore, load_config, redis_client
"""

from gateway.link.connection import redis_client
from gateway.link.embedded import EmbeddedServer
from gateway.loading import load_config, parse_config
from gateway.model import __version__
from gateway.model.config import Config, Workflow
from gateway.model.errors import ConfigError, RealmError, StoreUnavailable
from gateway.runners.handlers import PermanentFailure
from gateway.runners.runner import Runner
from gateway.store.runs import BatchEntry, Run, StartResult, TakenStep
from gateway.store.runstore import RunStore

__all__ = [
    "BatchEntry",
    "Config",
    "ConfigError",
    "EmbeddedServer",
    "PermanentFailure",
    "RealmError",
    "Run",
    "RunStore",
    "Runner",
    "StartResult",
    "StoreUnavailable",
    "TakenStep",
    "Workflow",
    "__version__",
    "load_config",
    "parse_config",
    "redis_client",
]
