"""The ``workflows:`` and ``settings:`` parts of ``triggers.yaml`` → the model's
dataclasses. Every error is a ``ConfigError`` naming the file, the entry and the field.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

import fastjsonschema
from jsonschema import validators
from jsonschema.exceptions import SchemaError
from referencing.exceptions import Unresolvable

from gateway.model.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_DELIVERY_RETENTION,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUFFERED_BODY_BYTES,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_STORED_BODY_BYTES,
    DEFAULT_PREFIX,
    DEFAULT_REDIS_TIMEOUT,
    DEFAULT_RETENTION,
    DEFAULT_SPOOL_DRAIN_RATE,
    DEFAULT_SPOOL_MAX_BYTES,
    DURABILITY_FIELDS,
    INGRESS_FIELDS,
    INGRESS_RATE,
    INGRESS_RATE_UNIT_MS,
    MAX_INGRESS_COUNT,
    MAX_PARTITIONS,
    SETTINGS_FIELDS,
    SPOOL_FIELDS,
    WORKFLOW_FIELDS,
    WORKFLOW_NAME,
    Durability,
    IngressLimit,
    Network,
    Settings,
    Spool,
    Workflow,
    json_path,
    parse_retention,
)
from gateway.model.errors import ConfigError
from gateway.model.words import unknown_field


def parse_workflows(raw: object, file: str) -> dict[str, Workflow]:
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
        raise error(unknown[0], unknown_field(unknown[0], WORKFLOW_FIELDS))

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
            f"must be a whole number from 1 to 100 (got {clip(repr(max_attempts))})",
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
            f"must be a whole number from 1 to {MAX_PARTITIONS} (got {clip(repr(partitions))})",
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
            where = clip(json_path(exc.absolute_path))
            raise error(
                "params_schema", f"not a valid JSON Schema at {where}: {clip(exc.message)}"
            ) from None
        except (Unresolvable, TypeError, ValueError, AttributeError, RecursionError) as exc:
            # Unresolvable: jsonschema's error for a $ref it cannot resolve.
            raise error("params_schema", f"cannot be used: {clip(str(exc))}") from None
    # Checked by gateway.loading with the runners' parser; kept raw for `realm work`.
    handlers = raw.get("handlers")
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


def parse_settings(raw: object, file: str) -> Settings:
    if raw is None:
        return Settings()

    def error(field_name: str | None, message: str) -> ConfigError:
        return ConfigError(file, message, section="settings", field=field_name)

    if not isinstance(raw, dict):
        raise error(None, "must be a mapping")
    unknown = sorted(str(k) for k in raw if k not in SETTINGS_FIELDS)
    if unknown:
        raise error(unknown[0], unknown_field(unknown[0], SETTINGS_FIELDS))
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
            raise error(name, f"must be true or false (got {clip(repr(value))})")
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
                name, f"must be an integer from {least} to {most} (got {clip(repr(value))})"
            )
        counts[name] = value
    proxies = _parse_networks(raw.get("trusted_proxies", []), error)
    spool = _parse_spool(raw.get("spool", True), error)
    ingress = _parse_ingress(raw.get("ingress", {}), error)
    return Settings(key_prefix=prefix, max_body_bytes=max_body, max_in_flight=in_flight,
                    durability=durability, delivery_retention_ms=retention_ms,
                    trusted_proxies=proxies, spool=spool, ingress=ingress,
                    **timeouts, **sizes, **flags, **counts)  # fmt: skip


def _parse_networks(raw: object, error: Any) -> tuple[Network, ...]:
    """``trusted_proxies``: addresses (``10.0.0.7``) or networks (``10.0.0.0/8``)."""
    if not isinstance(raw, list):
        raise error(
            "trusted_proxies", f"must be a list of addresses or networks (got {clip(repr(raw))})"
        )
    networks = []
    for i, item in enumerate(raw):
        try:
            if not isinstance(item, str):  # ip_network would read 5 as 0.0.0.5
                raise ValueError
            # strict=False: 10.1.2.3/8 means 10.0.0.0/8, as a person writing it means.
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise error(
                f"trusted_proxies[{i}]",
                f"must be an IP address like 10.0.0.7 or a network like 10.0.0.0/8 "
                f"(got {clip(repr(item))})",
            ) from None
    return tuple(networks)


_SIZE = re.compile(r"([0-9]+)\s*(B|KiB|MiB|GiB|TiB)?")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def _parse_spool(raw: object, error: Any) -> Spool | None:
    """``spool: false`` (off), ``true`` or absent (the defaults), or a mapping of
    ``dir``, ``max_bytes`` (bytes, or ``512MiB``, ``1GiB``) and ``drain_rate``."""
    if raw is False:
        return None
    if raw is True:
        return Spool()
    if not isinstance(raw, dict):
        raise error(
            "spool",
            f"must be true, false or a mapping like {{max_bytes: 1GiB}} (got {clip(repr(raw))})",
        )
    unknown = sorted(str(k) for k in raw if k not in SPOOL_FIELDS)
    if unknown:
        raise error(f"spool.{unknown[0]}", unknown_field(unknown[0], SPOOL_FIELDS))
    folder = raw.get("dir")
    if folder is not None and (not isinstance(folder, str) or not folder.strip()):
        raise error("spool.dir", f"must be a folder path (got {clip(repr(folder))})")
    size = raw.get("max_bytes", DEFAULT_SPOOL_MAX_BYTES)
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match:
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    # One record must fit: a spool smaller than a body would refuse everything.
    if isinstance(size, bool) or not isinstance(size, int) or size < 1024 * 1024:
        raise error(
            "spool.max_bytes",
            f"must be a size of at least 1MiB, in bytes or like 512MiB or 1GiB "
            f"(got {clip(repr(raw.get('max_bytes')))})",
        )
    rate = raw.get("drain_rate", DEFAULT_SPOOL_DRAIN_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= 100_000:
        raise error(
            "spool.drain_rate",
            f"must be deliveries per second from 1 to 100000 (got {clip(repr(rate))})",
        )
    return Spool(dir=folder, max_bytes=size, drain_rate=rate)


def _parse_ingress(raw: object, error: Any) -> dict[str, IngressLimit]:
    """``ingress``: per webhook path, ``{rate: 50/s, burst: 100}``. ``rate`` is a count
    per second, minute or hour; ``burst``, how many may arrive at once, defaults to
    the rate's count (``600/m`` lets a minute's worth arrive together, then one every
    100 ms). That a trigger serves each path is gateway.loading's check: it knows
    the triggers."""
    if raw is None:  # `ingress:` with nothing under it
        return {}
    if not isinstance(raw, dict):
        raise error(
            "ingress",
            f"must be a mapping of webhook path to {{rate: 50/s, burst: 100}} "
            f"(got {clip(repr(raw))})",
        )
    limits = {}
    for path, spec in raw.items():
        where = f"ingress.{clip(str(path), 100)}"
        if not isinstance(path, str) or not path.startswith("/"):
            raise error(where, "must be a webhook path starting with '/' (a trigger's path)")
        if not isinstance(spec, dict):
            raise error(
                where, f"must be a mapping like {{rate: 50/s, burst: 100}} (got {clip(repr(spec))})"
            )
        unknown = sorted(str(k) for k in spec if k not in INGRESS_FIELDS)
        if unknown:
            raise error(f"{where}.{unknown[0]}", unknown_field(unknown[0], INGRESS_FIELDS))
        rate = spec.get("rate")
        match = INGRESS_RATE.fullmatch(rate) if isinstance(rate, str) else None
        if match is None or int(match.group(1)) > MAX_INGRESS_COUNT:
            got = "missing" if rate is None else f"got {clip(repr(rate))}"
            raise error(
                f"{where}.rate",
                f"must be a count per second, minute or hour like '50/s', '600/m' or "
                f"'1000/h', the count from 1 to {MAX_INGRESS_COUNT} ({got})",
            )
        count = int(match.group(1))
        burst = spec.get("burst", count)
        if (
            isinstance(burst, bool)
            or not isinstance(burst, int)
            or not 1 <= burst <= MAX_INGRESS_COUNT
        ):
            raise error(
                f"{where}.burst",
                f"must be a whole number from 1 to {MAX_INGRESS_COUNT} (got {clip(repr(burst))})",
            )
        limits[path] = IngressLimit(count, INGRESS_RATE_UNIT_MS[match.group(2)], burst)
    return limits


def _parse_durability(raw: object, redis_timeout: float, error: Any) -> Durability | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise error(
            "durability", "must be a mapping like {replicas: 1, fsync: false, timeout: 0.5}"
        )
    unknown = sorted(str(k) for k in raw if k not in DURABILITY_FIELDS)
    if unknown:
        raise error(f"durability.{unknown[0]}", unknown_field(unknown[0], DURABILITY_FIELDS))
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


def clip(text: str, limit: int = 200) -> str:
    """A message part quoting the file's content, cut short: an error is one line
    for a person to read, however large the value it quotes."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
