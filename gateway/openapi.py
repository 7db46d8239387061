"""The OpenAPI document served at ``/openapi.json``, built from the same route lists
the app serves, so a route cannot exist without its description."""

from __future__ import annotations

import re
from typing import Any

from gateway import __version__
from gateway.api import API_ROUTES
from gateway.runs import (
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
                                      "workflow": {"type": "string"}}},
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
    "cancel_key": {"200": ("1 if the key had a live run", {
        "type": "object", "properties": {"cancelled": {"enum": [0, 1]}}})},
    "claim_steps": {"200": ("the steps taken (none when nothing is ready)", {
        "type": "object",
        "properties": {"status": {"const": "ok"}, "steps": {"type": "array", "items": _TAKEN}}})},
    "complete_step": {"200": ("the run's phase and next step", {"type": "object"})},
    "fail_run": {"200": ("the failed run; with retry, the run's phase, the attempt and "
                         "retry_at_ms", {"oneOf": [_RUN, {"type": "object"}]})},
    "reconcile_keys": {"200": ("the report", {"type": "object"})},
}  # fmt: skip


def _response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(webhook_paths: list[str]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for path, method, handler, summary in API_ROUTES:
        name = handler.__name__
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
                "404": _response("NOT_FOUND_WORKFLOW or NOT_FOUND_RUN", _ERROR),
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
                "202": _response("a run started", {"type": "object"}),
                "200": _response("deduplicated, refused by policy, or ignored", {"type": "object"}),
                "400": _response("body not parseable", _ERROR),
                "401": _response("signature missing or wrong", _ERROR),
                "409": _response("same event id, different body (on_params_mismatch: reject)",
                                 {"type": "object"}),
                "413": _response("body over max_body_bytes", _ERROR),
                "422": _response("event id missing or params fail params_schema",
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
