"""``realm send``: sign a saved payload as its sender would, with the trigger's scheme and
the secret in the environment, and POST it to a running listener; ``--repeat`` sends
the same delivery again, as a sender's redelivery (same event id, a fresh timestamp).

The request is built here (gateway.signatures.sign signs it, as for
``realm triggers test --sign``); the listener decides everything else. No secret is
ever printed: not the request's headers, not an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import string
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from gateway.cli.common import (
    EXIT_CONFIG,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    config_option,
)
from gateway.ingest.jsonpath import Path as JsonPath
from gateway.ingest.replies import shown
from gateway.ingest.triggers import Trigger
from gateway.loading import load_config
from gateway.model import __version__
from gateway.model.errors import ConfigError
from gateway.signatures.schemes import PLACEHOLDER_SECRET, STD_ID, is_header_name
from gateway.signatures.sign import sign
from gateway.signatures.spec import VerifySpec, describe

JSON_TYPE = "application/json"
FORM_TYPE = "application/x-www-form-urlencoded"
CONTENT_TYPES = {"json": JSON_TYPE, "form": FORM_TYPE}
DEFAULT_PORT = 8000  # `realm listen`'s default --port (and REALM_PORT, as it reads it)
DEFAULT_TIMEOUT = 30.0
USER_AGENT = f"realm-send/{__version__}"

# Schemes whose sender signs a timestamp inside the body (Unix ms), set on each send.
BODY_TIMESTAMPS = {"linear": "webhookTimestamp"}
# The event-id header each sender puts on every delivery, whatever a trigger reads.
SENDER_ID_HEADERS = {
    "github": "X-GitHub-Delivery",
    "shopify": "X-Shopify-Webhook-Id",
    "twilio": "I-Twilio-Idempotency-Token",
}
_ALNUM = string.ascii_letters + string.digits
_NOT_JSON = object()


class SendError(Exception):
    """What stops ``realm send`` before or while sending: one line, and its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _SetOrPlaceholder(Mapping[str, str]):
    """The environment for reading the config: each variable's value where it is set,
    else a placeholder (a whsec_ one, as `triggers check --no-secrets` has): only the
    signing trigger's secret must be set, which _with_secret checks."""

    def __getitem__(self, name: str) -> str:
        return os.environ.get(name) or PLACEHOLDER_SECRET

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One delivery, ready to sign: its body, the headers besides the signature's, and
    the event id they (or the body) carry."""

    spec: VerifySpec  # holding the first secret of the environment
    body: bytes
    headers: tuple[tuple[str, str], ...]
    event_id: str
    triggers: tuple[str, ...]  # the triggers whose scheme signs it

    def request(self, now: float) -> tuple[bytes, list[tuple[str, str]]]:
        """The body and headers, signed at ``now``; the headers given win over the
        signature's (a test of a wrong signature sends its own)."""
        body = self.body
        if self.spec.scheme in BODY_TIMESTAMPS:  # a timestamp signed in the body
            doc = json.loads(body)
            doc[BODY_TIMESTAMPS[self.spec.scheme]] = int(now * 1000)
            body = _json_bytes(doc)
        standard = self.spec.scheme == "standard"
        added = sign(self.spec, body, now, event_id=self.event_id if standard else None)
        if (not added and self.spec.scheme != "none") or not all(added):
            # A public key (discord, sns, a whpk_ key), or a scheme sign() does not know
            # yet: said, and nothing sent (never a secret as a nameless header).
            raise SendError(
                f"realm send cannot sign as the sender of trigger {self.triggers[0]} "
                f"(scheme {self.spec.scheme}): the gateway holds no key that signs for it"
            )
        return body, _merged(list(self.headers), list(added.items()))


@click.command()
@click.option("--path", "route", required=True, help="The trigger path to post to.")
@click.option(
    "--body", "body_file", required=True, type=click.Path(dir_okay=False, exists=True),
    help="File holding the payload, sent byte for byte (unless its event id is set).",
)  # fmt: skip
@click.option(
    "--header", "header_args", multiple=True, metavar="'Name: value'",
    help="A request header; repeat for more. One the signing would add is replaced.",
)  # fmt: skip
@click.option(
    "--trigger", "trigger_name", default=None, metavar="NAME",
    help="The trigger whose scheme and secret sign, when the path's triggers differ.",
)  # fmt: skip
@click.option(
    "--event-id", default=None, metavar="ID",
    help="The event id, where the trigger reads it (a header, the body's JSONPath, "
    "webhook-id) [default: a fresh one in the sender's style].",
)  # fmt: skip
@click.option(
    "--keep-id", is_flag=True,
    help="Keep the event id the body already holds (a trigger with a JSONPath event id).",
)  # fmt: skip
@click.option(
    "--content-type", default=None, metavar="json|form|TYPE",
    help="The body's Content-Type [default: json, or form for a form-encoded file].",
)  # fmt: skip
@click.option(
    "--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
    help="Send the delivery N times: the same event id, re-signed each time.",
)  # fmt: skip
@click.option(
    "--url", default=None, metavar="URL",
    help=f"The listener's base URL; the path is appended [default: "
    f"http://127.0.0.1:{DEFAULT_PORT}, or the port in REALM_PORT].",
)  # fmt: skip
@click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TIMEOUT,
    show_default=True, help="Seconds to wait for each reply.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@config_option
def send(
    route: str,
    body_file: str,
    header_args: tuple[str, ...],
    trigger_name: str | None,
    event_id: str | None,
    keep_id: bool,
    content_type: str | None,
    repeat: int,
    url: str | None,
    timeout: float,
    as_json: bool,
    config_path: str,
) -> None:
    """Sign a saved payload as the trigger's sender would and POST it to a listener.

    Exits 0 when every reply is a 2xx, 1 otherwise; 2 for a bad option or path, 3 for
    a bad config file or a secret not set, 4 when the listener does not answer.
    """
    try:
        base = _base_url(url)
        target = base + urllib.parse.quote(urllib.parse.unquote(route))
        delivery = prepare(
            config_path, urllib.parse.unquote(route), Path(body_file), _headers(header_args),
            trigger_name=trigger_name, event_id=event_id, keep_id=keep_id,
            content_type=content_type,
        )  # fmt: skip
    except SendError as exc:
        _fail(str(exc), exc.exit_code)
    replies = post(delivery, target, repeat=repeat, timeout=timeout, as_json=as_json,
                   listener=base)  # fmt: skip
    sys.exit(0 if all(200 <= r["status"] < 300 for r in replies) else EXIT_REFUSED)


# --------------------------------------------------------------------------- preparing


def prepare(
    config_path: str,
    route: str,
    body_file: Path,
    given: list[tuple[str, str]],
    *,
    trigger_name: str | None = None,
    event_id: str | None = None,
    keep_id: bool = False,
    content_type: str | None = None,
) -> Delivery:
    """The delivery to send to ``route``: its triggers and scheme, its secret, its
    content type and its event id, set where the triggers read it."""
    if event_id is not None and keep_id:
        raise SendError("--event-id and --keep-id: give one of them")
    if event_id == "":
        raise SendError("--event-id: the event id is empty")
    try:
        config = load_config(config_path, env=_SetOrPlaceholder())  # its secret: below
    except ConfigError as exc:
        raise SendError(str(exc), EXIT_CONFIG) from None
    triggers = _signing_triggers(list(config.triggers.values()), route, trigger_name)
    spec = _with_secret(triggers[0])
    try:
        body = body_file.read_bytes()
    except OSError as exc:
        raise SendError(f"--body: cannot read {body_file}: {exc.strerror}") from None
    headers = _with_content_type(given, content_type, body, body_file)
    form = _media(headers) == FORM_TYPE
    carriers = _id_headers(triggers, spec)
    paths = list({p.expr: p for t in triggers if (p := t.event_id.path) is not None}.values())
    from_headers = {v for n, v in headers if n.lower() in {c.lower() for c in carriers}}
    if len(from_headers) > 1:
        raise SendError(f"--header: the event id headers disagree ({', '.join(carriers)})")
    if from_headers:
        (header_id,) = from_headers
        if event_id is not None and event_id != header_id:
            raise SendError("--event-id and --header give two event ids: give one of them")
        event_id = header_id
    if keep_id:
        if from_headers:
            raise SendError("--keep-id and a --header event id: give one of them")
        event_id = _kept_id(body, form, paths, triggers, body_file)
    if event_id is None:
        event_id = fresh_id(spec.scheme)
    body = _with_body_id(body, form, paths, event_id, body_file)
    headers = _merged(headers, [(name, event_id) for name in carriers])
    if not any(n.lower() == "user-agent" for n, _ in headers):
        headers.append(("User-Agent", USER_AGENT))
    if spec.scheme in BODY_TIMESTAMPS and (form or not isinstance(_json(body), dict)):
        field = BODY_TIMESTAMPS[spec.scheme]
        raise SendError(f"{body_file} is not a JSON object, which scheme {spec.scheme} "
                        f"signs a time in ({field})")  # fmt: skip
    delivery = Delivery(spec, body, tuple(headers), event_id, tuple(t.name for t in triggers))
    delivery.request(time.time())  # a scheme it cannot sign: said before anything is sent
    return delivery


def _signing_triggers(triggers: Sequence[Trigger], route: str, name: str | None) -> list[Trigger]:
    """The path's triggers that verify as the one that signs: all of them when they
    verify alike, else those of ``--trigger``'s scheme and secret."""
    matching = [t for t in triggers if t.path == route]
    if not matching:
        paths = ", ".join(sorted({t.path for t in triggers})) or "none"
        raise SendError(f"no trigger has path {route} (paths: {paths})")
    listed = ", ".join(f"{t.name} ({describe(t.verify)})" for t in matching)
    if name is not None:
        chosen = [t for t in matching if t.name == name]
        if not chosen:
            raise SendError(f"--trigger: {route} has no trigger {name} (its triggers: {listed})")
        spec = chosen[0].verify
    elif any(t.verify != matching[0].verify for t in matching):
        raise SendError(
            f"the triggers of {route} verify differently: {listed}; "
            "pick the one to sign as with --trigger NAME"
        )
    else:
        spec = matching[0].verify
    return [t for t in matching if t.verify == spec]


def _with_secret(trigger: Trigger) -> VerifySpec:
    """The trigger's spec, once the first variable of its ``secret_env`` (the secret a
    sender signs with) is known to be set: the config was read with its value."""
    spec = trigger.verify
    if spec.secret_env and not os.environ.get(spec.secret_env[0]):
        variable = spec.secret_env[0]
        state = "not set" if os.environ.get(variable) is None else "empty"
        raise SendError(
            f"environment variable {variable} is {state}: trigger {trigger.name} signs with "
            "the secret it holds (verify.secret_env)",
            EXIT_CONFIG,
        )
    return spec


def _headers(args: Sequence[str]) -> list[tuple[str, str]]:
    headers: list[tuple[str, str]] = []
    for arg in args:
        name, sep, value = arg.partition(":")
        name = name.strip()
        if not sep or not is_header_name(name):
            raise SendError(f"--header: {arg!r} is not 'Name: value'")
        if any(n.lower() == name.lower() for n, _ in headers):
            raise SendError(f"--header: {name} is given twice; a listener refuses that")
        headers.append((name, value.strip()))
    return headers


def _with_content_type(
    headers: list[tuple[str, str]], option: str | None, body: bytes, body_file: Path
) -> list[tuple[str, str]]:
    """The headers with a Content-Type: ``--content-type``'s, a ``--header``'s, else
    JSON, or a form for a body that reads as one."""
    given = _media(headers)
    if option is not None:
        if given is not None:
            raise SendError("--content-type and --header 'Content-Type: …': give one of them")
        media = CONTENT_TYPES.get(option.lower(), option)
        if "/" not in media:
            raise SendError(f"--content-type: {option!r} is not json, form or a media type")
        return [*headers, ("Content-Type", media)]
    if given is not None:
        return headers
    media = FORM_TYPE if _reads_as_form(body) else JSON_TYPE
    if media == JSON_TYPE and _json(body) is _NOT_JSON:
        click.echo(f"warning: {body_file} is neither JSON nor a form; sent as {JSON_TYPE}",
                   err=True)  # fmt: skip
    return [*headers, ("Content-Type", media)]


def _media(headers: Sequence[tuple[str, str]]) -> str | None:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.split(";", 1)[0].strip().lower()
    return None


def _json(body: bytes) -> object:
    """The body's JSON value, or ``_NOT_JSON``."""
    try:
        return json.loads(body)
    except ValueError:  # UnicodeDecodeError too
        return _NOT_JSON


def _reads_as_form(body: bytes) -> bool:
    """``name=value&…`` text that is not JSON."""
    text = body.decode("utf-8", "replace").strip()
    if not text or text[0] in '{["' or _json(body) is not _NOT_JSON:
        return False
    try:
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        return False
    return bool(pairs)


# --------------------------------------------------------------------------- event ids


def fresh_id(scheme: str) -> str:
    """A new event id as the scheme's sender writes one: GitHub a UUID, Stripe
    ``evt_…``, Standard Webhooks ``msg_…``, any other a UUID."""
    if scheme == "stripe":
        return "evt_" + "".join(secrets.choice(_ALNUM) for _ in range(24))
    if scheme == "standard":
        return f"msg_{secrets.token_hex(12)}"
    return str(uuid.uuid4())


def _id_headers(triggers: Sequence[Trigger], spec: VerifySpec) -> list[str]:
    """The headers that carry the event id: those the triggers read it from, and the
    one the sender always sends (``webhook-id`` for the standard scheme: signed)."""
    names = [t.event_id.header for t in triggers if t.event_id.header is not None]
    if spec.scheme in SENDER_ID_HEADERS:
        names.append(SENDER_ID_HEADERS[spec.scheme])
    if spec.scheme == "standard":
        names.append(STD_ID)  # signed; a trigger reading svix-id has it above
    unique: dict[str, str] = {}
    for name in names:
        unique.setdefault(name.lower(), name)
    return list(unique.values())


def _kept_id(
    body: bytes, form: bool, paths: Sequence[JsonPath], triggers: Sequence[Trigger], file: Path
) -> str:
    if not paths:
        where = ", ".join(f"{t.name} ({t.event_id.describe()})" for t in triggers)
        raise SendError(
            f"--keep-id keeps the event id the body holds, and no trigger reads one from "
            f"it: {where}; give --event-id ID"
        )
    doc = _document(body, form, file)[0]
    for path in paths:
        found, value = path.get(doc)
        if found and _is_id(value):
            return str(value)
    where = " or ".join(p.expr for p in paths)
    raise SendError(f"--keep-id: {file} holds no event id at {where}")


def _is_id(value: object) -> bool:  # as the listener takes one: a string or an integer
    return value != "" and isinstance(value, str | int) and not isinstance(value, bool)


def _with_body_id(
    body: bytes, form: bool, paths: Sequence[JsonPath], event_id: str, file: Path
) -> bytes:
    """``body`` with ``event_id`` at each of ``paths`` (unchanged where it is there)."""
    if not paths:
        return body
    doc, rebuild = _document(body, form, file)
    changed = False
    for path in paths:
        found, value = path.get(doc)
        if found and _is_id(value) and str(value) == event_id:
            continue
        if not path.steps or not _set(doc, path.steps, event_id):
            raise SendError(
                f"cannot set the event id at {path.expr} in {file}; put it in the file "
                "and give --keep-id"
            )
        changed = True
    return rebuild(doc) if changed else body


def _document(body: bytes, form: bool, file: Path) -> tuple[Any, Any]:
    """The body as the listener reads it, and a function that writes it back."""
    if not form:
        try:
            doc = json.loads(body)
        except ValueError:
            raise SendError(f"{file} is not JSON, where the event id is read") from None
        return doc, _json_bytes
    pairs = urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
    fields = dict(pairs)  # GitHub's form: the event is JSON in `payload`
    if "payload" in fields:
        try:
            doc = json.loads(fields["payload"])
        except ValueError:
            raise SendError(f"{file}: form field 'payload' is not JSON") from None

        def payload_back(doc: Any) -> bytes:
            rest = [(n, v) for n, v in pairs if n != "payload"]
            encoded = [("payload", _json_bytes(doc).decode()), *rest]
            return urllib.parse.urlencode(encoded).encode()

        return doc, payload_back

    def fields_back(doc: Any) -> bytes:
        kept = [(n, doc.get(n, v)) for n, v in pairs]
        new = [(n, v) for n, v in doc.items() if n not in fields]
        return urllib.parse.urlencode([*kept, *new]).encode()

    return fields, fields_back


def _json_text(doc: Any, indent: int | None = None) -> str:
    """JSON text (compact unless ``indent``), integers of any size as they are; escaped
    to ASCII only when it holds what UTF-8 cannot encode (a lone surrogate)."""
    separators = None if indent else (",", ":")
    text = json.dumps(doc, ensure_ascii=False, indent=indent, separators=separators)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(doc, indent=indent, separators=separators)
    return text


def _json_bytes(doc: Any) -> bytes:
    return _json_text(doc).encode()


def _set(doc: Any, steps: Sequence[str | int], value: str) -> bool:
    """Set ``value`` at ``steps`` (mapping keys and list indexes), making the mappings
    on the way; False when the document's shape has no place for it."""
    node = doc
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if isinstance(step, int):
            if type(node) is not list or step >= len(node):
                return False
            if last:
                node[step] = value
            node = node[step]
        else:
            if not isinstance(node, dict):
                return False
            if last:
                node[step] = value
            node = node.setdefault(step, {})
    return True


def _merged(first: list[tuple[str, str]], more: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``first`` and those of ``more`` whose name (any case) it does not have."""
    merged = list(first)
    names = {n.lower() for n, _ in first}
    for name, value in more:
        if name.lower() not in names:
            names.add(name.lower())
            merged.append((name, value))
    return merged


# --------------------------------------------------------------------------- sending


def _base_url(url: str | None) -> str:
    if url is None:
        port = os.environ.get("REALM_PORT") or str(DEFAULT_PORT)
        url = f"http://127.0.0.1:{port}"
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:  # checked first and never echoed: a credential
        raise SendError("--url: must not contain credentials (user:password@)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SendError(f"--url: {url!r} is not an http:// or https:// URL")
    if parts.query or parts.fragment:
        raise SendError(f"--url: {url!r} has a query or fragment; give the base URL")
    return url.rstrip("/")


def post(
    delivery: Delivery, url: str, *, repeat: int, timeout: float, as_json: bool, listener: str
) -> list[dict[str, Any]]:
    """Send ``delivery`` ``repeat`` times, each signed afresh; print each reply (or,
    with ``as_json``, one object at the end). Ends the command if the listener does
    not answer."""
    import httpx  # some 40 ms that every other command need not wait

    replies: list[dict[str, Any]] = []
    summary = {"url": url, "triggers": list(delivery.triggers), "event_id": delivery.event_id}
    with httpx.Client(timeout=timeout, follow_redirects=False) as client:
        for attempt in range(1, repeat + 1):
            body, headers = delivery.request(time.time())
            try:
                reply = client.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                message = _unanswered(listener, exc, timeout)
                if as_json:
                    click.echo(_json_text({**summary, "replies": replies, "error": message}))
                _fail(message, EXIT_UNAVAILABLE)
            entry = _reply(reply)
            replies.append(entry)
            if not as_json:
                _print_reply(url, delivery.event_id, attempt, repeat, reply, entry)
    if as_json:
        ok = all(200 <= r["status"] < 300 for r in replies)
        click.echo(_json_text({**summary, "replies": replies, "ok": ok}))
    return replies


def _unanswered(url: str, exc: Exception, timeout: float) -> str:
    import httpx

    if isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower():
        return f"the listener at {url} is not answering (connection refused)"
    if isinstance(exc, httpx.TimeoutException):
        return f"the listener at {url} did not answer within {timeout:g} s"
    return f"the listener at {url} is not answering: {exc or type(exc).__name__}"


def _reply(reply: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"status": reply.status_code}
    try:
        entry["body"] = reply.json()
    except ValueError:
        entry["body"] = reply.text
    if "retry-after" in reply.headers:
        entry["retry_after"] = reply.headers["retry-after"]
    return entry


def _print_reply(
    url: str, event_id: str, attempt: int, repeat: int, reply: Any, entry: dict[str, Any]
) -> None:
    count = f", {attempt} of {repeat}" if repeat > 1 else ""
    click.echo(f"POST {url} (event id {shown(event_id)}{count})")
    click.echo(f"{reply.status_code} {reply.reason_phrase}".rstrip())
    if "retry_after" in entry:
        click.echo(f"Retry-After: {shown(entry['retry_after'])}")
    body = entry["body"]
    if isinstance(body, str):
        if body:
            click.echo(body)
    else:
        click.echo(_json_text(body, indent=2))


def _fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(exit_code)
