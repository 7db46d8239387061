"""Handshakes: a sender's check of an endpoint before (or between) its deliveries,
answered once the request is verified, writing nothing to the run store.

- ``slack``: a ``url_verification`` event gets its ``challenge`` back.
- ``zoom``: ``endpoint.url_validation`` gets ``{plainToken, encryptedToken}``, the
  token's HMAC-SHA256 with the secret token, hex (Zoom re-validates every 72 hours).
- ``meta``: a GET with ``hub.mode=subscribe`` whose ``hub.verify_token`` is one of the
  trigger's verify tokens (compared in constant time) gets ``hub.challenge``.
- ``twitter``: a GET with ``crc_token`` gets ``{response_token}`` (the CRC check).
- ``discord``: a PING interaction (``type: 1``) gets ``{"type": 1}``.
- ``sns``: a ``SubscriptionConfirmation`` is confirmed by visiting its ``SubscribeURL``
  (https, an SNS host only); an ``UnsubscribeConfirmation`` is acknowledged.
- Any trigger: a ``respond`` rule, ``{when: [...], status, body, content_type}``,
  answers what its conditions match (Microsoft Graph's ``validationToken``, say).

A trigger declares the methods it takes (``methods: [GET, POST]``; POST by default,
and GET too for the presets whose handshake is a GET); a path answers 405 to a method
none of its triggers takes. A GET is never a delivery: it is answered by a handshake
or refused. Also here: a Stripe trigger's ``stripe: {livemode, api_version}``, which
refuses events of the other mode or of another API version.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol

import orjson

from gateway.ingest.conditions import TESTS, Condition, compile_condition
from gateway.ingest.jsonpath import Path, compile_path
from gateway.ingest.values import HeaderLookup
from gateway.model.errors import RealmError
from gateway.model.words import shown_value, yaml_kind
from gateway.signatures.ed25519 import is_discord_ping
from gateway.signatures.spec import VerifySpec
from gateway.signatures.verify import crc_response

__all__ = [
    "METHODS",
    "Answer",
    "Respond",
    "StripeRules",
    "answer_get",
    "answer_post",
    "compile_handshakes",
    "default_methods",
    "is_sns_confirmation",
]

METHODS = ("GET", "POST")
# Presets whose sender checks the endpoint with a GET.
_GET_SCHEMES = frozenset({"meta", "twitter"})
_RESPOND_FIELDS = ("when", "status", "body", "content_type")
_STRIPE_FIELDS = ("livemode", "api_version")
_QUERY_TESTS = frozenset(TESTS)

STATE_STRIPE_LIVEMODE = "STATE_STRIPE_LIVEMODE"
STATE_STRIPE_API_VERSION = "STATE_STRIPE_API_VERSION"


@dataclass(frozen=True)
class Answer:
    """What a handshake replies: the status, the body as sent, its type, and what it
    was (for the delivery log and the listener's line)."""

    status: int
    body: bytes
    content_type: str
    what: str
    trigger: str | None = None  # which trigger answered a GET (None: a refusal)


@dataclass(frozen=True)
class _Template:
    """A response text over ``{$.path}``, ``{header:Name}`` and ``{query:name}``."""

    text: str
    parts: tuple[tuple[str, Any], ...]

    def render(self, headers: HeaderLookup, doc: object, query: Mapping[str, str]) -> str:
        out: list[str] = []
        for kind, ref in self.parts:
            if kind == "text":
                out.append(ref)
            elif kind == "path":
                found, value = ref.get(doc)
                if found and value is not None:
                    out.append(value if isinstance(value, str) else orjson.dumps(value).decode())
            elif kind == "header":
                out.append(headers.get(ref.lower()) or "")
            else:
                out.append(query.get(ref, ""))
        return "".join(out)


@dataclass(frozen=True)
class Respond:
    """A trigger's ``respond`` rule: when every condition holds, this reply."""

    when: tuple[Condition, ...]
    status: int
    body: _Template | Mapping[str, _Template]
    content_type: str

    def answer(self, headers: HeaderLookup, doc: object, query: Mapping[str, str]) -> Answer | None:
        if any(c.check(headers, doc, query) is not None for c in self.when):
            return None
        if isinstance(self.body, _Template):
            text = self.body.render(headers, doc, query).encode()
        else:
            text = orjson.dumps({k: t.render(headers, doc, query) for k, t in self.body.items()})
        return Answer(self.status, text, self.content_type, "respond rule")


@dataclass(frozen=True)
class StripeRules:
    """``stripe: {livemode, api_version}``: what a Stripe trigger takes."""

    livemode: bool | None = None
    api_version: str | None = None

    def refusal(self, doc: object) -> RealmError | None:
        """The refusal of an event of the other mode or another API version."""
        data = doc if isinstance(doc, dict) else {}
        if self.livemode is not None and data.get("livemode") is not self.livemode:
            want, got = _mode(self.livemode), _mode(data.get("livemode"))
            return RealmError(
                STATE_STRIPE_LIVEMODE,
                f"this trigger takes {want} events; this one is {got}: nothing was started",
            )
        if self.api_version is not None and data.get("api_version") != self.api_version:
            return RealmError(
                STATE_STRIPE_API_VERSION,
                f"this trigger takes events of API version {self.api_version}; this one has "
                f"{shown_value(data.get('api_version'))}: nothing was started",
            )
        return None


def _mode(livemode: object) -> str:
    # `is`, not a lookup: the body's value may be anything, a list included.
    if livemode is True:
        return "live-mode"
    return "test-mode" if livemode is False else "of no mode"


class _Trigger(Protocol):
    """What a handshake reads of a trigger (gateway.ingest.triggers.Trigger)."""

    @property
    def name(self) -> str: ...

    @property
    def verify(self) -> VerifySpec: ...

    @property
    def respond(self) -> Respond | None: ...


def answer_post(
    trigger: _Trigger, headers: HeaderLookup, doc: object, query: Mapping[str, str]
) -> Answer | None:
    """The handshake a verified POST is, for ``trigger``; None when it is a delivery.
    (SNS's subscription confirmation, which must visit a URL: ``is_sns_confirmation``.)"""
    if trigger.respond is not None:
        answer = trigger.respond.answer(headers, doc, query)
        if answer is not None:
            return answer
    data = doc if isinstance(doc, dict) else {}
    scheme = trigger.verify.scheme
    if scheme == "slack" and data.get("type") == "url_verification":
        return _json(200, {"challenge": str(data.get("challenge", ""))}, "slack url_verification")
    if scheme == "zoom" and data.get("event") == "endpoint.url_validation":
        payload = data.get("payload")
        plain = payload.get("plainToken") if isinstance(payload, dict) else None
        if not isinstance(plain, str) or not plain:
            return None
        key = trigger.verify.keys[0]
        encrypted = hmac.digest(key, plain.encode(), "sha256").hex()
        return _json(
            200, {"plainToken": plain, "encryptedToken": encrypted}, "zoom endpoint.url_validation"
        )
    if scheme == "discord" and is_discord_ping(data):
        return _json(200, {"type": 1}, "discord ping")
    if scheme == "sns" and data.get("Type") == "UnsubscribeConfirmation":
        return _json(200, {"status": "ok"}, "sns unsubscribe confirmation")
    return None


def is_sns_confirmation(trigger: _Trigger, doc: object) -> bool:
    """A verified SNS SubscriptionConfirmation: confirmed by visiting its SubscribeURL
    (gateway.ingest.sns_certs.visit_subscribe_url, which the caller awaits)."""
    return (
        trigger.verify.scheme == "sns"
        and isinstance(doc, dict)
        and doc.get("Type") == "SubscriptionConfirmation"
    )


def answer_get(
    triggers: Sequence[_Trigger], headers: HeaderLookup, query: Mapping[str, str]
) -> Answer:
    """The answer to a GET on a path whose triggers take GET: the first trigger whose
    handshake it is, else 403 (a wrong verify token) or 400 (no handshake at all)."""
    refused = None
    for trigger in triggers:
        if trigger.respond is not None:
            answer = trigger.respond.answer(headers, None, query)
            if answer is not None:
                return replace(answer, trigger=trigger.name)
        spec = trigger.verify
        if spec.scheme == "meta" and query.get("hub.mode") == "subscribe":
            token = query.get("hub.verify_token", "")
            if _one_of(token, getattr(spec, "verify_tokens", ())):
                challenge = query.get("hub.challenge", "").encode()
                return Answer(200, challenge, "text/plain", "meta subscribe", trigger.name)
            refused = "hub.verify_token is not this trigger's verify token"
        if spec.scheme == "twitter" and "crc_token" in query:
            token = crc_response(spec, query["crc_token"])
            return replace(
                _json(200, {"response_token": token}, "twitter crc"), trigger=trigger.name
            )
    if refused is not None:
        return _error(403, "AUTH_REQUIRED", refused)
    return _error(
        400,
        "VALIDATION_HANDSHAKE",
        "a GET on a webhook path is a sender's handshake, and this one is none of the "
        "triggers' (meta's hub.mode=subscribe, twitter's crc_token, a respond rule)",
    )


def _one_of(given: str, tokens: Sequence[str]) -> bool:
    # Every token compared, whatever matched first: the time says nothing.
    found = False
    for token in tokens:
        found |= hmac.compare_digest(given.encode(), token.encode())
    return found and bool(given)


def _json(status: int, body: object, what: str) -> Answer:
    return Answer(status, orjson.dumps(body), "application/json", what)


def _error(status: int, code: str, message: str) -> Answer:
    body = {"status": "error", "code": code, "message": message}
    return Answer(status, orjson.dumps(body), "application/json", code)


def default_methods(scheme: str) -> tuple[str, ...]:
    """What a trigger takes when it declares no ``methods``."""
    return ("GET", "POST") if scheme in _GET_SCHEMES else ("POST",)


class FieldChecks(Protocol):
    """What reports a trigger's config errors, naming the file, trigger and field."""

    def fail(self, field: str | None, message: str) -> NoReturn: ...

    def check_fields(
        self, raw: dict[object, object], allowed: tuple[str, ...], prefix: str
    ) -> None: ...

    def condition(self, raw: object, field: str) -> Condition: ...


def compile_handshakes(
    checks: FieldChecks, raw: dict[object, object], scheme: str
) -> tuple[tuple[str, ...], Respond | None, StripeRules | None]:
    """A trigger's ``methods``, ``respond`` and ``stripe`` fields."""
    methods = default_methods(scheme)
    if "methods" in raw:
        given = raw["methods"]
        if not isinstance(given, list) or not given:
            checks.fail("methods", f"must be a list such as [GET, POST], not {yaml_kind(given)}")
        for i, method in enumerate(given):
            if not isinstance(method, str) or method.upper() not in METHODS:
                checks.fail(
                    f"methods[{i}]",
                    f"must be one of {', '.join(METHODS)}, not {shown_value(method)}",
                )
        methods = tuple(m for m in METHODS if m in {str(g).upper() for g in given})
    respond = _respond(checks, raw["respond"]) if "respond" in raw else None
    stripe = None
    if "stripe" in raw:
        if scheme != "stripe":
            checks.fail("stripe", "is for triggers whose verify scheme is stripe")
        stripe = _stripe(checks, raw["stripe"])
    return methods, respond, stripe


def _respond(checks: FieldChecks, raw: object) -> Respond:
    if not isinstance(raw, dict):
        checks.fail(
            "respond",
            "must be a mapping such as {when: [{query: validationToken, exists: true}], "
            f"body: '{{query:validationToken}}'}}, not {yaml_kind(raw)}",
        )
    checks.check_fields(raw, _RESPOND_FIELDS, prefix="respond.")
    when_raw = raw.get("when")
    if not isinstance(when_raw, list) or not when_raw:
        checks.fail("respond.when", "is required: a list of conditions, as for `when`")
    when = tuple(_condition(checks, item, f"respond.when[{i}]") for i, item in enumerate(when_raw))
    status = raw.get("status", 200)
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 299:
        checks.fail("respond.status", f"must be a 2xx status, not {shown_value(status)}")
    if "body" not in raw:
        checks.fail("respond.body", "is required: a text such as '{$.challenge}', or a mapping")
    body_raw = raw["body"]
    body: _Template | dict[str, _Template]
    if isinstance(body_raw, str):
        body = _template(checks, body_raw, "respond.body")
        default_type = "text/plain"
    elif isinstance(body_raw, dict) and all(isinstance(v, str) for v in body_raw.values()):
        body = {str(k): _template(checks, v, f"respond.body.{k}") for k, v in body_raw.items()}
        default_type = "application/json"
    else:
        checks.fail(
            "respond.body", f"must be a text or a mapping of texts, not {yaml_kind(body_raw)}"
        )
    content_type = raw.get("content_type", default_type)
    if not isinstance(content_type, str) or "/" not in content_type or "\n" in content_type:
        checks.fail(
            "respond.content_type", f"must be a media type, not {shown_value(content_type)}"
        )
    return Respond(when, status, body, content_type)


def _condition(checks: FieldChecks, raw: object, field: str) -> Condition:
    """A condition of a respond rule: as for ``when``, or on a query parameter."""
    if not isinstance(raw, dict) or "query" not in raw:
        return checks.condition(raw, field)
    checks.check_fields(raw, ("query", *TESTS), prefix=f"{field}.")
    name = raw["query"]
    if not isinstance(name, str) or not name:
        checks.fail(f"{field}.query", f"must be a parameter name, not {shown_value(name)}")
    tests = [t for t in TESTS if t in raw]
    if len(tests) != 1:
        checks.fail(field, f"needs exactly one test of {', '.join(TESTS)}")
    try:
        return compile_condition(query=name, test=tests[0], operand=raw[tests[0]])  # type: ignore[arg-type]
    except ValueError as exc:
        checks.fail(f"{field}.{tests[0]}", str(exc))


def _template(checks: FieldChecks, text: str, field: str) -> _Template:
    parts: list[tuple[str, Any]] = []
    pos = 0
    literal: list[str] = []
    while pos < len(text):
        if text.startswith(("{{", "}}"), pos):
            literal.append(text[pos])
            pos += 2
            continue
        if text[pos] == "}":
            checks.fail(field, f"unmatched '}}' at position {pos}; write '}}}}' for a brace")
        if text[pos] != "{":
            literal.append(text[pos])
            pos += 1
            continue
        end = text.find("}", pos + 1)
        if end < 0:
            checks.fail(field, f"unclosed '{{' at position {pos}")
        if literal:
            parts.append(("text", "".join(literal)))
            literal = []
        inner = text[pos + 1 : end]
        if inner.startswith("$"):
            try:
                path: Path = compile_path(inner)
            except ValueError as exc:
                checks.fail(field, f"{{{inner}}}: {exc}")
            parts.append(("path", path))
        elif inner.startswith("header:") and inner[7:]:
            parts.append(("header", inner[7:]))
        elif inner.startswith("query:") and inner[6:]:
            parts.append(("query", inner[6:]))
        else:
            checks.fail(
                field,
                f"unknown placeholder {{{inner}}}; the placeholders are {{$.json.path}}, "
                "{header:Name} and {query:name}",
            )
        pos = end + 1
    if literal:
        parts.append(("text", "".join(literal)))
    return _Template(text, tuple(parts))


def _stripe(checks: FieldChecks, raw: object) -> StripeRules:
    if not isinstance(raw, dict):
        checks.fail(
            "stripe",
            f"must be a mapping such as {{livemode: true, api_version: '2024-06-20'}}, "
            f"not {yaml_kind(raw)}",
        )
    checks.check_fields(raw, _STRIPE_FIELDS, prefix="stripe.")
    livemode = raw.get("livemode")
    if livemode is not None and not isinstance(livemode, bool):
        checks.fail("stripe.livemode", f"must be true or false, not {shown_value(livemode)}")
    version = raw.get("api_version")
    if version is not None and (not isinstance(version, str) or not version):
        checks.fail(
            "stripe.api_version",
            f"must be a version such as '2024-06-20' (quoted), not {shown_value(version)}",
        )
    return StripeRules(livemode, version)
