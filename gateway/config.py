"""``triggers.yaml`` → frozen dataclasses. Every error names the file, the entry and the field.

The ``workflows:`` part lives here; the ``triggers:`` part is compiled by
``gateway.triggers``. Commands that only start or manage runs load the
workflows alone, so they need none of the webhook secrets.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastjsonschema
import orjson
import yaml
from fastjsonschema import JsonSchemaValueException
from jsonschema import validators
from jsonschema.exceptions import SchemaError
from referencing.exceptions import Unresolvable

from gateway.errors import ConfigError, RealmError
from gateway.keys import DEFAULT_PREFIX

if TYPE_CHECKING:
    from gateway.triggers import Trigger

# Workflow names become part of every Redis key, inside the hash tag: no braces,
# no colons, nothing that needs quoting in a URL path either.
WORKFLOW_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
RETENTION = re.compile(r"^([1-9][0-9]*)([dhms])$")
RETENTION_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000}
DEFAULT_RETENTION = "7d"
WORKFLOW_FIELDS = {"steps", "params_schema", "retention", "stream_retention", "partitions",
                   "description", "max_attempts", "retry_backoff", "lease",
                   "handlers"}  # handlers: for `realm work` (gateway/handlers.py)  # fmt: skip
# A busy workflow's keys may be spread over this many hash tags ({wf#0} … {wf#N-1}).
MAX_PARTITIONS = 1024
TOP_FIELDS = {"version", "workflows", "triggers", "settings"}
SETTINGS_FIELDS = {"key_prefix", "max_body_bytes", "redis_timeout", "body_timeout", "max_in_flight",
                   "max_buffered_body_bytes", "max_header_bytes", "durability",
                   "delivery_log", "store_bodies", "max_stored_body_bytes",
                   "delivery_retention", "max_deliveries"}  # fmt: skip
RESERVED_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/v1", "/ui"})
DEFAULT_MAX_BODY_BYTES = 25 * 1024 * 1024  # GitHub's payload cap
DEFAULT_REDIS_TIMEOUT = 2.0  # seconds; well inside GitHub's 10 s
DEFAULT_BODY_TIMEOUT = 10.0  # seconds to receive a whole body: a slow sender gets 408
DEFAULT_MAX_IN_FLIGHT = 1000  # deliveries past their body read, per worker; more get 503
# Bytes of bodies one worker holds for deliveries not yet answered (never less than
# max_body_bytes); more get 503 OVERLOADED at once (gateway/webhooks.py BodyBudget).
DEFAULT_MAX_BUFFERED_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line and headers; more get 431 (gateway/edge.py)
# The delivery log (gateway/deliveries.py): how long and how many deliveries are kept,
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
    # How long a ready step's stream entry is kept (gateway/sweep.py trims older
    # ones); 0 means the same as retention_ms.
    stream_retention_ms: int = 0
    # Hash tags the workflow's keys are spread over (1: the one tag {wf}); an
    # idempotency key always lives in the same partition (gateway/keys.py).
    partitions: int = 1
    # Runners (gateway/runner.py): attempts of each step before the run fails, the
    # backoff before attempt n+1 (doubling each time), and how long a taken step is a
    # runner's before another may take it.
    max_attempts: int = 3
    retry_backoff_ms: int = 1_000
    lease_ms: int = 30_000
    # The raw `handlers:` mapping (checked by gateway/handlers.py at load; `realm work`
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
        return [f"{_json_path(e.absolute_path)}: {e.message}" for e in errors]

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
    otherwise 503 (gateway/pipeline.py)."""

    replicas: int = 1
    fsync: bool = False
    timeout: float = 0.5


DURABILITY_FIELDS = {"replicas", "fsync", "timeout"}


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


@dataclass(frozen=True)
class Config:
    file: str
    workflows: Mapping[str, Workflow]
    settings: Settings = Settings()
    triggers: Mapping[str, Trigger] = field(default_factory=dict)
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


def load_config(
    path: str | os.PathLike[str],
    *,
    with_triggers: bool = True,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Read and check a ``triggers.yaml``. Raises ``ConfigError`` on any problem."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(file, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(file, f"cannot read file: {exc}") from None
    return parse_config(text, file=file, with_triggers=with_triggers, env=env)


def parse_config(
    text: str,
    *,
    file: str = "triggers.yaml",
    with_triggers: bool = True,
    env: Mapping[str, str] | None = None,
) -> Config:
    doc = load_yaml(text, file)
    if not isinstance(doc, dict):
        raise ConfigError(file, "must be a mapping with 'version', 'workflows' and 'triggers'")
    unknown = sorted(str(k) for k in doc if k not in TOP_FIELDS)
    if unknown:
        raise ConfigError(
            file, f"unknown top-level field(s) {unknown}; allowed: {sorted(TOP_FIELDS)}"
        )
    version = doc.get("version")
    if type(version) is not int or version != 1:  # `version: true` is not 1
        raise ConfigError(file, f"field 'version' must be 1 (got {_clip(repr(version))})")
    workflows = _parse_workflows(doc.get("workflows"), file)
    settings = _parse_settings(doc.get("settings"), file)
    triggers: Mapping[str, Trigger] = {}
    if with_triggers and doc.get("triggers") is not None:
        from gateway.triggers import parse_triggers

        triggers = parse_triggers(
            doc["triggers"],
            file=file,
            workflows=workflows.keys(),
            env=os.environ if env is None else env,
        )
        for trigger in triggers.values():
            if trigger.replay_guard and workflows[trigger.workflow].partitions > 1:
                # The guard's record of a body must sit in the slot of the claim that
                # checks it; a replay under another event id has another key, so on a
                # partitioned workflow it would be claimed in another partition.
                raise ConfigError(
                    file,
                    f"replay_guard (on by default for github and shopify) needs workflow "
                    f"'{trigger.workflow}' in one partition; set replay_guard: false or "
                    "remove the workflow's partitions",
                    section="trigger",
                    name=trigger.name,
                    field="replay_guard",
                )
            if trigger.path in RESERVED_PATHS or trigger.path.startswith(("/v1/", "/ui/")):
                raise ConfigError(
                    file,
                    f"{trigger.path} is the gateway's own route; pick another path "
                    "(reserved: /v1/…, /ui/…, " + ", ".join(sorted(RESERVED_PATHS)) + ")",
                    section="trigger",
                    name=trigger.name,
                    field="path",
                )
    version = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    return Config(
        file=file, workflows=workflows, settings=settings, triggers=triggers, version=version
    )


def parse_retention(value: object) -> int:
    """``7d``, ``36h``, ``90m``, ``30s`` → milliseconds. Raises ValueError."""
    match = RETENTION.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"must be a duration like '7d', '36h' or '90m' (got {value!r})")
    return int(match.group(1)) * RETENTION_UNIT_MS[match.group(2)]


def _parse_workflows(raw: object, file: str) -> dict[str, Workflow]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(file, "field 'workflows' must be a non-empty mapping of name → workflow")
    return {str(name): _parse_workflow(name, spec, file) for name, spec in raw.items()}


def _parse_workflow(name: object, raw: object, file: str) -> Workflow:
    def error(field_name: str | None, message: str) -> ConfigError:
        return ConfigError(file, message, section="workflow", name=str(name), field=field_name)

    if not isinstance(name, str) or not WORKFLOW_NAME.fullmatch(name):
        raise error(
            None,
            "workflow names use letters, digits, '_', '.' and '-' (at most 100, "
            "starting with a letter or digit)",
        )
    if not isinstance(raw, dict):
        raise error(
            None, "must be a mapping with 'steps' (and optionally 'params_schema', 'retention')"
        )
    unknown = sorted(str(k) for k in raw if k not in WORKFLOW_FIELDS)
    if unknown:
        raise error(unknown[0], f"unknown field; allowed: {sorted(WORKFLOW_FIELDS)}")

    steps = raw.get("steps")
    if not isinstance(steps, list) or not steps:
        raise error("steps", "must be a non-empty list of step names")
    for i, step in enumerate(steps):
        if not isinstance(step, str) or not step.strip():
            raise error(f"steps[{i}]", f"must be a non-empty string (got {step!r})")
    if len(set(steps)) != len(steps):
        raise error("steps", "step names must be unique")

    try:
        retention_ms = parse_retention(raw.get("retention", DEFAULT_RETENTION))
    except ValueError as exc:
        raise error("retention", str(exc)) from None
    stream_retention_ms = retention_ms  # readers may need the entries longer, or shorter
    if "stream_retention" in raw:
        try:
            stream_retention_ms = parse_retention(raw["stream_retention"])
        except ValueError as exc:
            raise error("stream_retention", str(exc)) from None

    max_attempts = raw.get("max_attempts", 3)
    if (
        not isinstance(max_attempts, int)
        or isinstance(max_attempts, bool)
        or not (1 <= max_attempts <= 100)
    ):
        raise error(
            "max_attempts",
            f"must be a whole number from 1 to 100 (got {_clip(repr(max_attempts))})",
        )
    durations = {}
    for field_name, default in (("retry_backoff", "1s"), ("lease", "30s")):
        try:
            durations[field_name] = parse_retention(raw.get(field_name, default))
        except ValueError as exc:
            raise error(field_name, str(exc)) from None

    partitions = raw.get("partitions", 1)
    if (
        not isinstance(partitions, int)
        or isinstance(partitions, bool)
        or not 1 <= partitions <= MAX_PARTITIONS
    ):
        raise error(
            "partitions",
            f"must be a whole number from 1 to {MAX_PARTITIONS} (got {_clip(repr(partitions))})",
        )

    schema = raw.get("params_schema")
    validator = None
    if schema is not None:
        if not isinstance(schema, dict):
            raise error("params_schema", "must be a JSON Schema object (a mapping)")
        if not isinstance(schema.get("$schema", ""), str):
            raise error("params_schema", "'$schema' must be a string (a dialect URI)")
        try:
            cls = validators.validator_for(schema)
            cls.check_schema(schema)
            validator = cls(schema)
            # check_schema does not follow $ref; one validation does, so a reference
            # to nowhere is a config error here rather than a 500 on every delivery.
            list(validator.iter_errors({}))
        except SchemaError as exc:
            where = _clip(_json_path(exc.absolute_path))
            raise error(
                "params_schema", f"not a valid JSON Schema at {where}: {_clip(exc.message)}"
            ) from None
        except (Unresolvable, TypeError, ValueError, AttributeError, RecursionError) as exc:
            # Unresolvable: jsonschema's error for a $ref it cannot resolve.
            raise error("params_schema", f"cannot be used: {_clip(str(exc))}") from None
    handlers = raw.get("handlers")
    if handlers is not None:
        from gateway.handlers import parse_handlers

        parse_handlers(handlers, file=file, workflow=name, steps=steps)
    return Workflow(
        name=name,
        handlers=handlers,
        steps=tuple(steps),
        retention_ms=retention_ms,
        stream_retention_ms=stream_retention_ms,
        partitions=partitions,
        max_attempts=max_attempts,
        retry_backoff_ms=durations["retry_backoff"],
        lease_ms=durations["lease"],
        params_schema=schema,
        _validator=validator,
        _fast_check=_fast_check_for(schema) if schema is not None else None,
    )


# Keywords whose meaning is the same in draft 7 (fastjsonschema) and 2020-12
# (jsonschema's default), and which hold no references or formats.
_PLAIN_KEYWORDS = frozenset({
    "type", "properties", "required", "items", "enum", "const", "pattern", "minLength",
    "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "additionalProperties", "minItems", "maxItems", "uniqueItems", "multipleOf",
    "minProperties", "maxProperties", "not", "anyOf", "oneOf", "allOf", "title",
    "description", "default", "examples",
})  # fmt: skip


def _plain(schema: object) -> bool:
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or not set(schema) <= _PLAIN_KEYWORDS:
        return False
    subschemas: list[object] = list((schema.get("properties") or {}).values())
    for key in ("items", "additionalProperties", "not"):
        if key in schema:
            subschemas.append(schema[key])
    for key in ("anyOf", "oneOf", "allOf"):
        subschemas.extend(schema.get(key) or [])
    return all(_plain(sub) for sub in subschemas)


def _fast_check_for(schema: Mapping[str, Any]) -> Any:
    """fastjsonschema's compiled validator (about 10x faster than jsonschema on the
    hot path), only for schemas made of plain keywords; else None."""
    if not _plain(schema):
        return None
    try:
        return fastjsonschema.compile(dict(schema), use_formats=False)
    except Exception:
        return None


def _parse_settings(raw: object, file: str) -> Settings:
    if raw is None:
        return Settings()

    def error(field_name: str | None, message: str) -> ConfigError:
        return ConfigError(file, message, section="settings", field=field_name)

    if not isinstance(raw, dict):
        raise error(None, "must be a mapping")
    unknown = sorted(str(k) for k in raw if k not in SETTINGS_FIELDS)
    if unknown:
        raise error(unknown[0], f"unknown field; allowed: {sorted(SETTINGS_FIELDS)}")
    prefix = raw.get("key_prefix", DEFAULT_PREFIX)
    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,50}", prefix):
        raise error("key_prefix", "must be 1-50 letters, digits, '_', '.' or '-'")
    max_body = raw.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
        raise error("max_body_bytes", f"must be a positive integer (got {max_body!r})")
    timeouts = {}
    for name, default in (("redis_timeout", DEFAULT_REDIS_TIMEOUT),
                          ("body_timeout", DEFAULT_BODY_TIMEOUT)):  # fmt: skip
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60:
            raise error(name, f"must be seconds between 0 and 60 (got {value!r})")
        timeouts[name] = float(value)
    in_flight = raw.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise error("max_in_flight", f"must be a positive integer (got {in_flight!r})")
    sizes = {}
    for name, default, least, floor in (
        ("max_buffered_body_bytes", max(DEFAULT_MAX_BUFFERED_BODY_BYTES, max_body), max_body,
         f"max_body_bytes ({max_body})"),
        ("max_header_bytes", DEFAULT_MAX_HEADER_BYTES, 1024, "1024"),
    ):  # fmt: skip
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise error(name, f"must be an integer of at least {floor} (got {value!r})")
        sizes[name] = value
    durability = _parse_durability(raw.get("durability"), timeouts["redis_timeout"], error)
    flags = {}
    for name in ("delivery_log", "store_bodies"):
        value = raw.get(name, True)
        if not isinstance(value, bool):
            raise error(name, f"must be true or false (got {_clip(repr(value))})")
        flags[name] = value
    try:
        retention_ms = parse_retention(raw.get("delivery_retention", DEFAULT_DELIVERY_RETENTION))
    except ValueError as exc:
        raise error("delivery_retention", str(exc)) from None
    counts = {}
    for name, default, least, most in (
        ("max_stored_body_bytes", DEFAULT_MAX_STORED_BODY_BYTES, 0, 16 * 1024 * 1024),
        ("max_deliveries", DEFAULT_MAX_DELIVERIES, 1, 10_000_000),
    ):
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise error(
                name, f"must be an integer from {least} to {most} (got {_clip(repr(value))})"
            )
        counts[name] = value
    return Settings(key_prefix=prefix, max_body_bytes=max_body, max_in_flight=in_flight,
                    durability=durability, delivery_retention_ms=retention_ms,
                    **timeouts, **sizes, **flags, **counts)  # fmt: skip


def _parse_durability(raw: object, redis_timeout: float, error: Any) -> Durability | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise error(
            "durability", "must be a mapping like {replicas: 1, fsync: false, timeout: 0.5}"
        )
    unknown = sorted(str(k) for k in raw if k not in DURABILITY_FIELDS)
    if unknown:
        raise error(
            f"durability.{unknown[0]}", f"unknown field; allowed: {sorted(DURABILITY_FIELDS)}"
        )
    replicas = raw.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= 100:
        raise error("durability.replicas", f"must be an integer from 0 to 100 (got {replicas!r})")
    fsync = raw.get("fsync", False)
    if not isinstance(fsync, bool):
        raise error("durability.fsync", f"must be true or false (got {fsync!r})")
    if replicas == 0 and not fsync:
        raise error("durability.replicas", "0 replicas without fsync confirms nothing: set one")
    timeout = raw.get("timeout", 0.5)
    # A claim may wait for the confirmation before its own, then its own: both must
    # fit in the claim's deadline (redis_timeout). 0 would make WAIT block for ever.
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (0.001 <= timeout < redis_timeout / 2)
    ):
        raise error(
            "durability.timeout",
            f"must be seconds from 0.001 to below half of redis_timeout ({redis_timeout:g}) "
            f"(got {timeout!r})",
        )
    return Durability(replicas=replicas, fsync=fsync, timeout=float(timeout))


def _clip(text: str, limit: int = 200) -> str:
    """A message part quoting the file's content, cut short: an error is one line
    for a person to read, however large the value it quotes."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- YAML

# A triggers.yaml is a few hundred nodes; aliases may share a block (a `verify`
# used by several triggers) but not multiply it into millions (an alias bomb).
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what a config must never mean silently:
    a key written twice (YAML keeps the last one, so a second `verify:` would
    replace the first), aliases that expand past MAX_YAML_NODES, recursive
    anchors and nesting past MAX_YAML_DEPTH. Each error carries its line."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_node_graph(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: its keys may be overridden, on purpose
            key = self.construct_object(key_node)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class says so
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {_clip(repr(key), 60)} (first at line "
                    f"{first.start_mark.line + 1}); write each key once",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _check_node_graph(root: yaml.Node | None) -> None:
    """Refuse recursive anchors, alias bombs and deep nesting, in time linear in
    the number of distinct nodes (a shared node is sized once)."""
    if root is None:
        return
    size: dict[int, int] = {}  # id(node) → expanded node count, capped
    active: set[int] = set()  # nodes on the current path: meeting one is a cycle
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        children = _children(node)
        if done:
            active.discard(id(node))
            size[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(size[id(c)] for c in children))
            if size[id(node)] > MAX_YAML_NODES:
                _refuse(node, f"aliases expand to more than {MAX_YAML_NODES} values")
            continue
        if id(node) in size:
            continue
        if depth > MAX_YAML_DEPTH:
            _refuse(node, f"nested more than {MAX_YAML_DEPTH} levels deep")
        active.add(id(node))
        stack.append((node, depth, True))
        for child in children:
            if id(child) in active:
                _refuse(child, "an anchor is used inside itself (a recursive alias)")
            if id(child) not in size:
                stack.append((child, depth + 1, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _refuse(node: yaml.Node, problem: str) -> None:
    raise yaml.composer.ComposerError(None, None, problem, node.start_mark)


def load_yaml(text: str, file: str) -> object:
    """Parse YAML text with _StrictLoader; any problem is a one-line ConfigError."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: safe
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(file, f"not valid YAML{where}: {_clip(problem)}") from None
    except RecursionError:
        raise ConfigError(
            file, f"not valid YAML: nested more than {MAX_YAML_DEPTH} levels deep"
        ) from None
    except ValueError as exc:  # e.g. `2024-13-45`, read as a date
        raise ConfigError(file, f"not valid YAML: {_clip(str(exc))}") from None


def _json_path(path: Any) -> str:
    """jsonschema's error path → ``$.a[0].b`` (``$`` for the params themselves)."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out
