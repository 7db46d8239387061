"""The configuration model: what one ``triggers.yaml`` means, as frozen dataclasses.

Parsing the ``workflows:`` and ``settings:`` parts is ``gateway.model.parse``;
the whole file, with its triggers and handlers, is read by ``gateway.loading``.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import orjson
from fastjsonschema import JsonSchemaValueException
from referencing.exceptions import Unresolvable

from gateway.model.errors import RealmError

T = TypeVar("T")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# The first part of every Redis key (gateway.store.keys), unless settings.key_prefix says otherwise.
DEFAULT_PREFIX = "realm"

# Workflow names become part of every Redis key, inside the hash tag: no braces,
# no colons, nothing that needs quoting in a URL path either.
WORKFLOW_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
RETENTION = re.compile(r"^([1-9][0-9]*)([dhms])$")
RETENTION_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000}
DEFAULT_RETENTION = "7d"
WORKFLOW_FIELDS = {"steps", "params_schema", "retention", "stream_retention", "partitions",
                   "description", "max_attempts", "retry_backoff", "lease",
                   "handlers"}  # for `realm work` (gateway/runners/handlers.py)  # fmt: skip
# A busy workflow's keys may be spread over this many hash tags ({wf#0} … {wf#N-1}).
MAX_PARTITIONS = 1024
SETTINGS_FIELDS = {"key_prefix", "max_body_bytes", "redis_timeout", "body_timeout", "max_in_flight",
                   "max_buffered_body_bytes", "max_header_bytes", "durability",
                   "delivery_log", "store_bodies", "max_stored_body_bytes",
                   "delivery_retention", "max_deliveries",
                   "trusted_proxies", "spool", "ingress"}  # fmt: skip
RESERVED_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/v1", "/ui"})
DEFAULT_MAX_BODY_BYTES = 25 * 1024 * 1024  # GitHub's payload cap
DEFAULT_REDIS_TIMEOUT = 2.0  # seconds; well inside GitHub's 10 s
DEFAULT_BODY_TIMEOUT = 10.0  # seconds to receive a whole body: a slow sender gets 408
DEFAULT_MAX_IN_FLIGHT = 1000  # deliveries past their body read, per worker; more get 503
# Bytes of bodies one worker holds for deliveries not yet answered (never less than
# max_body_bytes); more get 503 OVERLOADED at once (gateway/ingest/webhooks.py BodyBudget).
DEFAULT_MAX_BUFFERED_BODY_BYTES = 64 * 1024 * 1024
# The request line and headers; more get 431 (gateway/ingest/edge.py).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# The delivery log (gateway/deliveries/log.py): how long and how many deliveries are kept,
# and how much of each body. 128 KiB holds nearly every GitHub and Stripe delivery;
# 10 000 of them at most ~1.3 GB in Redis, typically (3 KB) ~30 MB.
DEFAULT_DELIVERY_RETENTION = "3d"
DEFAULT_MAX_DELIVERIES = 10_000
DEFAULT_MAX_STORED_BODY_BYTES = 128 * 1024


@dataclass(frozen=True)
class Workflow:
    name: str
    steps: tuple[str, ...]
    retention_ms: int
    params_schema: Mapping[str, Any] | None = None
    # How long a ready step's stream entry is kept (gateway/store/sweep.py trims older
    # ones); 0 means the same as retention_ms.
    stream_retention_ms: int = 0
    # Hash tags the workflow's keys are spread over (1: the one tag {wf}); an
    # idempotency key always lives in the same partition (gateway/store/keys.py).
    partitions: int = 1
    # Runners (gateway/runners/runner.py): attempts of each step before the run fails, the
    # backoff before attempt n+1 (doubling each time), and how long a taken step is a
    # runner's before another may take it.
    max_attempts: int = 3
    retry_backoff_ms: int = 1_000
    lease_ms: int = 30_000
    # The raw `handlers:` mapping (checked by gateway/runners/handlers.py at load; `realm work`
    # builds the handlers from it). Not part of the layout: compare=False.
    handlers: Mapping[str, Any] | None = field(default=None, compare=False)
    _validator: Any = field(default=None, repr=False, compare=False)
    # A compiled yes/no check for schemas where it agrees with jsonschema (see
    # _fast_check_for); jsonschema stays the authority and writes the messages.
    _fast_check: Any = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def steps_json(self) -> bytes:
        """The steps as the scripts receive them (the run keeps its own copy)."""
        return orjson.dumps(list(self.steps))

    def params_errors(self, params: object) -> list[str]:
        """Every way ``params`` fails the schema, each as ``<where>: <reason>``."""
        if self._validator is None:
            return []
        if self._fast_check is not None:
            try:
                self._fast_check(params)
                return []
            except JsonSchemaValueException:
                pass  # jsonschema below says exactly where and why
        try:
            errors = sorted(self._validator.iter_errors(params), key=lambda e: list(e.path))
        except Unresolvable as exc:
            # A $ref that only these params reach, and that leads nowhere: the load
            # check cannot see every branch, so refuse the params, never crash.
            return [f"$: params_schema cannot be applied: {exc}"]
        return [f"{json_path(e.absolute_path)}: {e.message}" for e in errors]

    def check_params(self, params: object) -> None:
        """Raise ``VALIDATION_PARAMS`` naming each failing field and why."""
        errors = self.params_errors(params)
        if errors:
            raise RealmError(
                "VALIDATION_PARAMS",
                f"params for workflow '{self.name}' do not fit its params_schema: "
                + "; ".join(errors),
            )


@dataclass(frozen=True)
class Durability:
    """``settings.durability``: a claim is acknowledged only once its writes are on
    ``replicas`` replicas (``WAIT``), and with ``fsync`` also fsynced on the primary
    and those replicas (``WAITAOF``, Redis 7.2+/Valkey), within ``timeout`` seconds;
    otherwise 503 (gateway/link/pipeline.py)."""

    replicas: int = 1
    fsync: bool = False
    timeout: float = 0.5


DURABILITY_FIELDS = {"replicas", "fsync", "timeout"}

# The spool (gateway/spool/): deliveries kept on local disk while Redis cannot take them.
DEFAULT_SPOOL_MAX_BYTES = 1024**3
DEFAULT_SPOOL_DRAIN_RATE = 200  # deliveries per second and worker, leaving room for live ones


@dataclass(frozen=True)
class Spool:
    """``settings.spool``: where a worker keeps verified deliveries that Redis could not
    take in time (``dir``; None: ``spool`` in the data folder), how many bytes its files
    may hold in all (a full spool answers 503, as with no spool), and how fast each
    worker drains it once Redis answers."""

    dir: str | None = None
    max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    drain_rate: int = DEFAULT_SPOOL_DRAIN_RATE


SPOOL_FIELDS = {"dir", "max_bytes", "drain_rate"}

# ``settings.ingress``: per path, a rate like ``50/s`` and a burst.
INGRESS_RATE = re.compile(r"^([1-9][0-9]{0,6})/([smh])$")
INGRESS_RATE_UNIT_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000}
INGRESS_FIELDS = {"rate", "burst"}
# The most of a rate's count and of a burst: a million a second is one delivery a µs,
# the script's unit of time, and a burst's span stays well inside a double's integers.
MAX_INGRESS_COUNT = 1_000_000


@dataclass(frozen=True)
class IngressLimit:
    """``settings.ingress.<path>``: deliveries to one webhook path, at most ``count``
    per ``period_ms`` on average and ``burst`` at once, counted in Redis for every
    gateway process together before anything is read or verified
    (gateway/ingest/ingress.py); past it the sender gets 429 with Retry-After."""

    count: int
    period_ms: int
    burst: int

    @property
    def interval_us(self) -> int:
        """Microseconds between two deliveries at the steady rate, rounded up: a limit
        that rounds never lets more through than it says."""
        return -(-self.period_ms * 1000 // self.count)

    @property
    def rate(self) -> str:
        """The rate as written: ``50/s``."""
        unit = next(u for u, ms in INGRESS_RATE_UNIT_MS.items() if ms == self.period_ms)
        return f"{self.count}/{unit}"


@dataclass(frozen=True)
class Settings:
    key_prefix: str = DEFAULT_PREFIX
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    redis_timeout: float = DEFAULT_REDIS_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_buffered_body_bytes: int = DEFAULT_MAX_BUFFERED_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    durability: Durability | None = None  # None: acknowledged once the primary has it
    # The delivery log: off, it records nothing (the listener's log line stays).
    delivery_log: bool = True
    store_bodies: bool = True  # false: headers and outcomes only, no body
    max_stored_body_bytes: int = DEFAULT_MAX_STORED_BODY_BYTES  # longer: stored cut, marked
    delivery_retention_ms: int = 3 * 86_400_000
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    # Proxies whose X-Forwarded-For and X-Forwarded-Proto the inspector believes (its
    # login limit's client, its cookie's Secure): the addresses they connect from.
    trusted_proxies: tuple[Network, ...] = ()
    # On by default; None (``spool: false``): a delivery Redis cannot take gets 503.
    spool: Spool | None = Spool()
    # Per webhook path: how fast deliveries may arrive (no entry: unlimited). A reload
    # may change it: the request path reads it from the config serving.
    ingress: Mapping[str, IngressLimit] = field(default_factory=dict)


@dataclass(frozen=True)
class Config(Generic[T]):
    """One version of ``triggers.yaml``. Generic in its triggers' type, which the
    ingest layer defines and ``gateway.loading`` compiles: the model below them
    knows only that a config carries some."""

    file: str
    workflows: Mapping[str, Workflow]
    settings: Settings = Settings()
    triggers: Mapping[str, T] = field(default_factory=dict)
    # Which text of the file this is: the first 12 hex digits of its SHA-256. The
    # listener logs it and /readyz shows it, so an operator sees a reload take hold.
    version: str = ""

    def workflow(self, name: str) -> Workflow:
        try:
            return self.workflows[name]
        except KeyError:
            known = ", ".join(sorted(self.workflows)) or "none"
            # The file's base name only: callers of the API need not learn the
            # gateway's directory layout.
            raise RealmError(
                "NOT_FOUND_WORKFLOW",
                f"Workflow '{name}' is not defined in {os.path.basename(self.file)} "
                f"(defined: {known}).",
            ) from None


def parse_retention(value: object) -> int:
    """``7d``, ``36h``, ``90m``, ``30s`` → milliseconds. Raises ValueError."""
    match = RETENTION.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"must be a duration like '7d', '36h' or '90m' (got {value!r})")
    return int(match.group(1)) * RETENTION_UNIT_MS[match.group(2)]


def json_path(path: Any) -> str:
    """jsonschema's error path → ``$.a[0].b`` (``$`` for the params themselves)."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out
