"""The OpenAPI document served at ``/openapi.json``, built from the same route lists
the app serves, so a route cannot exist without its description."""

from __future__ import annotations

import re
from typing import Any

from gateway.deliveries.log import DELIVERY_ID, MAX_LIMIT, OUTCOMES, STATUS_FILTER
from gateway.deliveries.text import SINCE_HELP
from gateway.faces.api import API_ROUTES
from gateway.model import __version__
from gateway.store.runs import (
    LIVE_MATCH,
    MAX_REQUEST_ID_BYTES,
    PARAMS_MISMATCH,
    PHASES,
    TERMINAL_MATCH,
)

_ERROR = {
    "type": "object",
    "required": ["status", "code", "message"],
    "properties": {
        "status": {"const": "error"},
        "code": {"type": "string", "examples": ["STATE_RUN_ALREADY_ACTIVE"]},
        "message": {"type": "string"},
    },
}
_POLICIES = {
    "on_live_match": {"enum": list(LIVE_MATCH), "default": "use_existing"},
    "on_terminal_match": {"enum": list(TERMINAL_MATCH), "default": "reuse"},
    "on_params_mismatch": {"enum": list(PARAMS_MISMATCH), "default": "flag"},
}
_START_REPLY = {
    "type": "object",
    "properties": {
        "status": {"const": "ok"},
        "deduped": {"type": "boolean"},
        "run_id": {"type": "string", "format": "uuid"},
        "rerun_of": {"type": ["string", "null"]},
        "workflow": {"type": "string"},
        "phase": {"enum": list(PHASES)},
        "next_step": {"type": ["string", "null"]},
        "params_mismatch": {"type": "boolean"},
        "due_ms": {"type": "integer", "description": "a scheduled run's due time (server ms)"},
        "message": {"type": "string"},
    },
}
_RUN = {
    "type": "object",
    "properties": {
        "run_id": {"type": "string", "format": "uuid"},
        "workflow": {"type": "string"},
        "idempotency_key": {"type": ["string", "null"]},
        "phase": {"enum": list(PHASES)},
        "next_step": {"type": ["string", "null"]},
        "steps": {"type": "array", "items": {"type": "string"}},
        "params": {"type": "object"},
        "created_ms": {"type": "integer"},
        "updated_ms": {"type": "integer"},
        "ended_ms": {"type": ["integer", "null"]},
        "rerun_of": {"type": ["string", "null"]},
        "error": {"type": ["string", "null"]},
        "due_ms": {"type": "integer", "description": "a scheduled run's due time (server ms)"},
    },
}
_ITEM = {
    "type": "object",
    "properties": {"params": {"type": "object"}, "idempotency_key": {"type": "string"}},
}
# The caller's id for one call: a resend with the same id gets the first call's result.
_REQUEST_ID = {
    "request_id": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_REQUEST_ID_BYTES,
        "description": "Your id for this call: a retry with the same id (after a lost reply or "
        "a 503) reports what the first call did instead of acting again.",
    }
}
_BATCH_ID = {
    "batch_id": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_REQUEST_ID_BYTES,
        "description": "Your id for this batch (one is made when absent; the reply "
        "carries it, a 503 too): a retry with the same id and items names the same runs "
        "and starts nothing twice.",
    }
}
_LEASE = {
    "lease": {
        "type": "string",
        "description": "The lease the step was claimed with: the result counts only while it "
        "is the run's current lease (else 409 STATE_STEP_NOT_CURRENT, the result discarded). "
        "Without it, no lease is checked.",
    }
}
_TAKEN = {
    "type": "object",
    "properties": {
        "run_id": {"type": "string", "format": "uuid"},
        "workflow": {"type": "string"},
        "step": {"type": "string"},
        "attempt": {"type": "integer", "minimum": 1},
        "params": {"type": "object"},
        "output": {"description": "The previous step's output (null for the first step)"},
        "lease": {"type": "string"},
        "lease_until_ms": {"type": "integer"},
    },
}
_DELIVERY_ID = {"type": "string", "pattern": f"^{DELIVERY_ID.pattern}$"}
_NULLABLE_TEXT = {"type": ["string", "null"]}
_DELIVERY_SUMMARY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "delivery_id": _DELIVERY_ID,
        "received_ms": {"type": "integer"},
        "path": {"type": "string"},
        "status": {"type": "integer", "description": "The status the delivery was answered with"},
        "code": {**_NULLABLE_TEXT, "description": "A refused delivery's error code"},
        "outcomes": {"type": "array", "items": {"type": "object", "properties": {
            "trigger": {"type": "string"}, "outcome": {"enum": list(OUTCOMES)},
            "run_id": _NULLABLE_TEXT}}},
        "replay_of": {**_NULLABLE_TEXT, "description": "The delivery this one replayed"},
    },
}  # fmt: skip
_DELIVERY = {
    "type": "object",
    "properties": {
        **{k: v for k, v in _DELIVERY_SUMMARY["properties"].items() if k != "outcomes"},
        "message": _NULLABLE_TEXT,
        "ms": {"type": "number", "description": "How long the delivery took to answer"},
        "config_version": {"type": "string"},
        "rerun": {"type": "boolean"},
        "triggers": {"type": "array", "items": {"type": "object", "properties": {
            "trigger": {"type": "string"}, "workflow": {"type": "string"},
            "outcome": {"enum": list(OUTCOMES)}, "run_id": _NULLABLE_TEXT,
            "event_id": _NULLABLE_TEXT, "deduped": {"type": ["boolean", "null"]},
            "rerun_of": _NULLABLE_TEXT, "phase": _NULLABLE_TEXT, "code": _NULLABLE_TEXT,
            "message": {**_NULLABLE_TEXT, "description": "Why: not matched, refused, started"},
            "signature": {**_NULLABLE_TEXT, "description": "'ok', why it did not verify "
                          "(a replay: why it may not take it), or null when not checked (a "
                          "replay)"},
            "matched": {"type": ["boolean", "null"], "description": "whether `when` held "
                        "(null: not reached)"},
            "why_not": {**_NULLABLE_TEXT, "description": "the condition that did not hold"},
            "key": {**_NULLABLE_TEXT, "description": "the idempotency key extracted"},
            "params": {"description": "the params extracted (null: not reached)"},
            "verified": {"type": "boolean", "description": "whether this trigger verified "
                         "it (a replay: verified the first delivery on arrival); a replay "
                         "starts runs only for such triggers"},
            "verify_spec": {**_NULLABLE_TEXT, "description": "a fingerprint of the trigger's "
                            "verify spec then: its scheme and secrets' variable names"},
            "params_mismatch": {"type": "boolean"}}}},
        "headers": {"type": ["array", "null"],
                    "items": {"type": "array", "items": {"type": "string"},
                              "minItems": 2, "maxItems": 2},
                    "description": "[name, value] pairs as received, names lower-case, "
                    "every signature, token and cookie header left out; null for a delivery "
                    "refused before it was verified"},
        "body": {**_NULLABLE_TEXT, "description": "null when refused before verification "
                 "or settings.store_bodies is false"},
        "body_encoding": {"enum": ["utf-8", "base64", None]},
        "body_size": {"type": ["integer", "null"], "description": "The body's whole size"},
        "body_truncated": {"type": "boolean", "description": "stored cut at "
                           "settings.max_stored_body_bytes (then it cannot be replayed)"},
    },
}  # fmt: skip
_BODIES: dict[str, dict[str, Any]] = {
    "start": {"properties": {"params": {"type": "object"},
                             "idempotency_key": {"type": "string"}, **_POLICIES, **_REQUEST_ID}},
    "start_batch": {"required": ["items"],
                    "properties": {"items": {"type": "array", "items": _ITEM}, **_POLICIES,
                                   **_BATCH_ID}},
    "cancel_run": {"properties": {**_REQUEST_ID}},
    "cancel_key": {"required": ["idempotency_key"],
                   "properties": {"idempotency_key": {"type": "string"}, **_REQUEST_ID}},
    "claim_steps": {"properties": {
        "runner": {"type": "string", "minLength": 1, "maxLength": 200, "default": "api"},
        "count": {"type": "integer", "minimum": 1, "maximum": 100, "default": 1},
        "lease_seconds": {"type": "number", "minimum": 1, "maximum": 3600,
                          "description": "default: the workflow's lease"}}},
    "complete_step": {"required": ["step"],
                      "properties": {"step": {"type": "string"}, **_LEASE,
                                     "output": {"description": "The step's output: any JSON "
                                                "value, at most 64 KiB encoded"},
                                     **_REQUEST_ID}},
    "fail_run": {"properties": {"error": {"type": "string"}, **_LEASE,
                                "retry": {"type": "boolean", "default": False,
                                          "description": "fail this attempt of the step only "
                                          "(needs step and lease)"},
                                "step": {"type": "string"}, **_REQUEST_ID}},
    "reconcile_keys": {"properties": {"dry_run": {"type": "boolean", "default": True},
                                      "workflow": {"type": "string"},
                                      "scan": {"type": "boolean", "default": False,
                                               "description": "find keys by a SCAN of the "
                                               "whole keyspace, not the key index"}}},
    "replay_delivery": {"properties": {"rerun": {
        "type": "boolean", "default": False,
        "description": "each matched trigger starts a new run (rerun_of the key's run; a "
        "live one is cancelled first) whatever its policies say; without it the policies "
        "apply, so a replay of a delivery that started a run is deduplicated"}}},
}  # fmt: skip
_OK: dict[str, dict[str, Any]] = {
    "start": {"202": ("a new run started", _START_REPLY),
              "200": ("deduplicated: the key's run", _START_REPLY)},
    "start_batch": {"200": ("the batch id, and one entry per item, in order", {
        "type": "object",
        "properties": {"status": {"const": "ok"}, "batch_id": {"type": "string"},
                       "items": {"type": "array", "items": {"type": "object"}}}})},
    "list_runs": {"200": ("a page of runs and the next cursor", {
        "type": "object",
        "properties": {"runs": {"type": "array", "items": _RUN},
                       "cursor": {"type": ["string", "null"]}}})},
    "get_run": {"200": ("the run", _RUN)},
    "cancel_run": {"200": ("1 if the run was live", {
        "type": "object", "properties": {"cancelled": {"enum": [0, 1]}}})},
    "cancel_key": {"200": ("the runs cancelled: the key's live run (runs, when it "
                           "queues), a scheduled one and its queued ones; 0 when none", {
        "type": "object", "properties": {"cancelled": {"type": "integer", "minimum": 0}}})},
    "claim_steps": {"200": ("the steps taken (none when nothing is ready)", {
        "type": "object",
        "properties": {"status": {"const": "ok"}, "steps": {"type": "array", "items": _TAKEN}}})},
    "complete_step": {"200": ("the run's phase and next step", {"type": "object"})},
    "fail_run": {"200": ("the failed run; with retry, the run's phase, the attempt and "
                         "retry_at_ms", {"oneOf": [_RUN, {"type": "object"}]})},
    "reconcile_keys": {"200": ("the report", {"type": "object"})},
    "list_deliveries": {"200": ("a page of the delivery log and the next cursor (a page "
                                "may be short under a filter and still have one)", {
        "type": "object",
        "properties": {"deliveries": {"type": "array", "items": _DELIVERY_SUMMARY},
                       "cursor": {**_DELIVERY_ID, "type": ["string", "null"]}}})},
    "get_delivery": {"200": ("the delivery's record", _DELIVERY)},
    "replay_delivery": {"200": ("the replay's own record (replay_of: the delivery; its "
                                "status and triggers say what the replay did)", _DELIVERY)},
}  # fmt: skip


_NOT_FOUND = {
    "get_delivery": "NOT_FOUND_DELIVERY: not in the log (or no longer)",
    "replay_delivery": "NOT_FOUND_DELIVERY, or NOT_FOUND_PATH: no trigger serves its path now",
}


def _response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(webhook_paths: list[str]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for path, method, handler, summary in API_ROUTES:
        name = handler.__name__
        not_found = _NOT_FOUND.get(name, "NOT_FOUND_WORKFLOW or NOT_FOUND_RUN")
        operation: dict[str, Any] = {
            "operationId": name,
            "summary": summary,
            "security": [{"bearer": []}],
            "parameters": [
                {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                for p in re.findall(r"{(\w+)}", path)
            ],
            "responses": {
                **{code: _response(*ok) for code, ok in _OK[name].items()},
                "401": _response("no or wrong bearer token (AUTH_REQUIRED)", _ERROR),
                "403": _response("REALM_API_TOKEN is not set: the API is off", _ERROR),
                "404": _response(not_found, _ERROR),
                "409": _response("refused by policy or state (STATE_*)", _ERROR),
                "422": _response("bad input (VALIDATION_*)", _ERROR),
                "503": _response("Redis unreachable or too slow (STORE_UNAVAILABLE)", _ERROR),
            },
        }
        if name == "list_runs":
            operation["parameters"] += [
                {"name": "key", "in": "query", "schema": {"type": "string"}},
                {"name": "phase", "in": "query", "schema": {"enum": list(PHASES)}},
                {"name": "limit", "in": "query",
                 "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50}},
                {"name": "cursor", "in": "query",
                 "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}},
            ]  # fmt: skip
        if name == "list_deliveries":
            operation["parameters"] += [
                {"name": "path", "in": "query", "schema": {"type": "string", "pattern": "^/"}},
                {"name": "status", "in": "query", "description": "202, or a class like 4xx",
                 "schema": {"type": "string", "pattern": f"^{STATUS_FILTER.pattern}$"}},
                {"name": "outcome", "in": "query", "description": "at least one trigger had it",
                 "schema": {"enum": list(OUTCOMES)}},
                {"name": "since", "in": "query", "description": SINCE_HELP,
                 "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {
                    "type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": 50}},
                {"name": "cursor", "in": "query", "schema": _DELIVERY_ID},
            ]  # fmt: skip
        if name in _BODIES:
            operation["requestBody"] = {
                "content": {"application/json": {"schema": {"type": "object", **_BODIES[name]}}}
            }
        paths.setdefault(path, {})[method.lower()] = operation
    for path in webhook_paths:
        paths[path] = {"post": {
            "operationId": f"webhook {path}",
            "summary": "A webhook delivery (signature verified per trigger)",
            "requestBody": {"content": {
                "application/json": {}, "application/x-www-form-urlencoded": {}}},
            "responses": {
                "202": _response("a run started, queued behind its key's live runs "
                                 "(outcome queued) or scheduled (outcome scheduled: debounce, "
                                 "delay; due_ms says when)", {"type": "object"}),
                "200": _response("deduplicated, refused by policy, stale (older than an event "
                                 "already started for its entity), rate_limited, or "
                                 "ignored",
                                 {"type": "object"}),
                "400": _response("body not parseable", _ERROR),
                "401": _response("signature missing or wrong", _ERROR),
                "409": _response("same event id, different body (on_params_mismatch: reject)",
                                 {"type": "object"}),
                "413": _response("body over max_body_bytes", _ERROR),
                "422": _response("event id or order value missing, or params fail params_schema",
                                 {"type": "object"}),
                "503": _response("Redis unreachable or too slow; Retry-After", _ERROR),
            },
        }}  # fmt: skip
    for path, summary in (
        ("/healthz", "The process is up"),
        ("/readyz", "Redis answers and the scripts are loaded"),
        ("/openapi.json", "This document"),
        ("/metrics", "Prometheus metrics, summed over the workers"),
    ):
        paths[path] = {"get": {"operationId": path.strip("/"), "summary": summary,
                               "responses": {"200": {"description": "ok"}}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "Realm Gateway", "version": __version__},
        "paths": paths,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
