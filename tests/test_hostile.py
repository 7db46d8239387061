"""Hostile deliveries against a real `realm listen`: forged and broken signatures, a
changed body under a used event id, oversized and slow bodies, and an overload.

One listener and one private redis-server for the module (FLUSHALL before each
test). Every refusal is checked twice: the exact status, and that Redis holds
nothing afterwards (DBSIZE 0) when nothing may be written. Each test prints one
``FIGURES <name>: …`` line of measured numbers for docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync
from starlette.datastructures import Headers

from gateway.signatures.parse import parse_verify
from gateway.signatures.spec import VerifySpec
from gateway.signatures.verify import verify
from gateway.store.keys import Keys
from tests.listener import Listener, run_state_size, spool_off
from tests.servers import RedisServer
from tests.signing import (
    github_headers,
    github_signature,
    standard_headers,
    stripe_headers,
    stripe_signature,
)

# Payloads and vectors kept with the tests (tests/payloads/README.md says where from).
PAYLOADS = Path(__file__).resolve().parent / "payloads"
VECTORS_FILE = PAYLOADS / "vectors.json"

GITHUB_SECRET = "gh-hostile-4b1d8e2f9a7c6350"
STRIPE_SECRET = "whsec_hostileStripe7e2a9c4b1d0f"
STANDARD_SECRET = "whsec_" + base64.b64encode(b"hostile-standard-webhooks-key-0042").decode()
TRIGGER_TOKEN = "tok-hostile-8c3f1e7a2b9d"
ENV = {
    "GITHUB_WEBHOOK_SECRET": GITHUB_SECRET,
    "STRIPE_WEBHOOK_SECRET": STRIPE_SECRET,
    "STANDARD_WEBHOOK_SECRET": STANDARD_SECRET,
    "REALM_TRIGGER_TOKEN": TRIGGER_TOKEN,
}

MAX_BODY = 65536
BODY_TIMEOUT = 3
MAX_IN_FLIGHT = 5
REDIS_TIMEOUT = 2

# How a fixture vector's sender maps onto a verify scheme, and where its event id is.
VECTOR_SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "github": ({"scheme": "github"}, {"header": "X-GitHub-Delivery", "missing": "content_hash"}),
    "stripe": ({"scheme": "stripe"}, {"jsonpath": "$.id", "missing": "content_hash"}),
    "standard-webhooks": ({"scheme": "standard"}, {"header": "webhook-id"}),
    "gitlab": (
        {"scheme": "token", "header": "X-Gitlab-Token"},
        {"header": "Idempotency-Key", "missing": "content_hash"},
    ),
}


def _negative_vectors() -> list[dict[str, Any]]:
    data = json.loads(VECTORS_FILE.read_text())
    return [
        v
        for v in data["vectors"]
        if v["kind"] == "derived-negative" and v["scheme"] in VECTOR_SCHEMES
    ]


NEGATIVE_VECTORS = _negative_vectors()
# One trigger per (scheme, secret) among the negative vectors, each on its own path
# with its secret in its own variable.
VECTOR_SLOTS: dict[tuple[str, str], int] = {}
for _v in NEGATIVE_VECTORS:
    VECTOR_SLOTS.setdefault((_v["scheme"], _v["secret"]), len(VECTOR_SLOTS))
VECTOR_ENV = {f"VECTOR_SECRET_{i}": secret for (_, secret), i in VECTOR_SLOTS.items()}


def _vector_triggers() -> str:
    out = []
    for (scheme, _), i in VECTOR_SLOTS.items():
        verify_raw, event_id = VECTOR_SCHEMES[scheme]
        verify_raw = {**verify_raw, "secret_env": f"VECTOR_SECRET_{i}"}
        out.append(
            f"""
  vector-{i}:
    workflow: vec
    path: /vec/{i}
    verify: {json.dumps(verify_raw)}
    event_id: {json.dumps(event_id)}
"""
        )
    return "".join(out)


CONFIG = f"""
version: 1
settings:
  max_body_bytes: {MAX_BODY}
  body_timeout: {BODY_TIMEOUT}
  max_in_flight: {MAX_IN_FLIGHT}
  redis_timeout: {REDIS_TIMEOUT}
workflows:
  sink: {{steps: [go]}}
  strict: {{steps: [go]}}
  bill: {{steps: [go]}}
  events: {{steps: [go]}}
  tok: {{steps: [go]}}
  vec: {{steps: [go]}}
triggers:
  gh:
    workflow: sink
    path: /hooks/github
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    event_id: {{header: X-GitHub-Delivery}}
    params: {{ref: $.ref}}
  gh-strict:
    workflow: strict
    path: /hooks/github-strict
    verify: {{scheme: github, secret_env: GITHUB_WEBHOOK_SECRET}}
    event_id: {{header: X-GitHub-Delivery}}
    params: {{ref: $.ref}}
    on_params_mismatch: reject
  stripe:
    workflow: bill
    path: /hooks/stripe
    verify: {{scheme: stripe, secret_env: STRIPE_WEBHOOK_SECRET}}
    event_id: {{jsonpath: $.id}}
  std:
    workflow: events
    path: /hooks/standard
    verify: {{scheme: standard, secret_env: STANDARD_WEBHOOK_SECRET}}
    event_id: {{header: webhook-id}}
  tok:
    workflow: tok
    path: /hooks/token
    verify: {{scheme: token, header: X-Realm-Token, secret_env: REALM_TRIGGER_TOKEN}}
    event_id: {{header: Idempotency-Key, missing: content_hash}}
{_vector_triggers()}"""


def _spec(raw: dict[str, Any], env: dict[str, str] = ENV) -> VerifySpec:
    return parse_verify(raw, file="t", trigger="t", env=env)


HeaderList = list[tuple[str, str]]


# --------------------------------------------------------------------------- helpers


def figures(name: str, **numbers: object) -> None:
    print(f"FIGURES {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def push_body(ref: str = "refs/heads/main", *, pad: int = 0, indent: int | None = None) -> bytes:
    doc = {
        "ref": ref,
        "after": hashlib.sha1(uuid.uuid4().bytes).hexdigest(),
        "repository": {"full_name": "octo-org/shop-api", "private": True},
        "pusher": {"name": "mona", "email": "mona@example.com"},
        "pad": "x" * pad,
    }
    return json.dumps(doc, indent=indent, separators=None if indent else (",", ":")).encode()


def reserialised(body: bytes) -> bytes:
    """The same JSON document, serialised with other spacing."""
    other = json.dumps(json.loads(body), indent=3, separators=(" ,", " : ")).encode()
    assert other != body and json.loads(other) == json.loads(body)
    return other


def gh_headers(body: bytes, delivery: str | None = None, **extra: str) -> HeaderList:
    return list(github_headers(body, GITHUB_SECRET, delivery=delivery, **extra).items())


def stripe_body() -> bytes:
    return json.dumps(
        {"id": f"evt_{uuid.uuid4().hex[:24]}", "type": "invoice.paid", "data": {"object": {}}}
    ).encode()


# (body, t) -> the v1 signature; (body, msg_id=, timestamp=) -> the webhook-* headers.
stripe_sig = partial(stripe_signature, STRIPE_SECRET)
std_signed = partial(standard_headers, secret=STANDARD_SECRET, content_type=None)


def std_body() -> bytes:
    return json.dumps({"type": "invoice.created", "data": {"n": uuid.uuid4().hex}}).encode()


def with_replaced(headers: HeaderList, name: str, value: str | None) -> HeaderList:
    """``headers`` with every ``name`` removed, then ``name: value`` added (unless None)."""
    out = [(k, v) for k, v in headers if k.lower() != name.lower()]
    return out if value is None else [*out, (name, value)]


def flip_char(text: str, index: int) -> str:
    """``text`` with one character changed to another of the same alphabet."""
    c = text[index]
    repl = "0" if c != "0" else "1"
    if c.isalpha():
        repl = "b" if c.lower() != "b" else "c"
    return text[:index] + repl + text[index + 1 :]


def flip_byte(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def runs_of(db: redis_sync.Redis, workflow: str) -> list[str]:
    return db.zrange(Keys("realm", workflow).runs(), 0, -1)


def delivery_lines(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in text.splitlines()
        if line.startswith("{") and '"event":"delivery"' in line
    ]


def assert_refused(reply: httpx.Response, status: int, code: str) -> None:
    assert reply.status_code == status, reply.text
    assert "Traceback" not in reply.text
    body = reply.json()
    assert body["status"] == "error", body
    assert body["code"] == code, body


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer):
    listener = Listener(
        tmp_path_factory.mktemp("hostile-listen"),
        spool_off(CONFIG),  # the overload tests want the 503 a spool would turn into 202
        redis_url=module_redis.url,
        env={**ENV, **VECTOR_ENV},
    ).start()
    yield listener
    listener.stop()
    assert "Traceback" not in listener.log(), listener.log()[-4000:]


# --------------------------------------------------------------------------- 10. signatures


def test_controls_valid_signatures_start_runs(http, db):
    """The refusals below are not vacuous: the same paths accept a correct signature."""
    body = push_body()
    assert http.post("/hooks/github", content=body, headers=gh_headers(body)).status_code == 202
    body = stripe_body()
    reply = http.post(
        "/hooks/stripe",
        content=body,
        headers=stripe_headers(body, STRIPE_SECRET, content_type=None),
    )
    assert reply.status_code == 202, reply.text
    body = std_body()
    reply = http.post("/hooks/standard", content=body, headers=std_signed(body))
    assert reply.status_code == 202, reply.text
    reply = http.post("/hooks/token", content=b"{}", headers={"X-Realm-Token": TRIGGER_TOKEN})
    assert reply.status_code == 202, reply.text
    assert run_state_size(db) > 0
    figures("signature_controls", accepted=4)


def test_fixture_negative_vectors_fail_at_their_own_time():
    """Unit level: each derived-negative vector, checked at the vector's own time."""
    assert NEGATIVE_VECTORS, f"{VECTORS_FILE} holds no derived-negative vector"
    for v in NEGATIVE_VECTORS:
        verify_raw, _ = VECTOR_SCHEMES[v["scheme"]]
        spec = _spec({**verify_raw, "secret_env": "S"}, {"S": v["secret"]})
        body = (PAYLOADS / v["body_file"]).read_bytes()
        now = float(v.get("verify_at", v.get("timestamp", time.time())))
        reason = verify(spec, Headers(headers=v["headers"]), body, now)
        assert reason is not None, v["id"]
    figures("negative_vectors_unit", vectors=len(NEGATIVE_VECTORS), rejected=len(NEGATIVE_VECTORS))


def _fresh_variant(v: dict[str, Any], body: bytes, secret: str) -> HeaderList:
    """A timestamped negative vector, broken the same way but signed at the current time
    (sent as is, it would also fail on its old timestamp, which proves nothing)."""
    now = int(time.time())
    if v["id"] == "stripe-negative-v0-only":
        return [("Stripe-Signature", f"t={now},v0={stripe_signature(secret, body, now)}")]
    if v["id"] == "stripe-negative-stale":
        old = now - (int(v["verify_at"]) - int(v["timestamp"]))
        return [("Stripe-Signature", f"t={old},v1={stripe_signature(secret, body, old)}")]
    if v["id"] == "standard-webhooks-negative-id-mismatch":
        sent_id = v["headers"]["webhook-id"]
        signed = standard_headers(
            body, secret, msg_id=sent_id[:-1], timestamp=now, content_type=None
        )
        return list(with_replaced(list(signed.items()), "webhook-id", sent_id))
    return list(v["headers"].items())


def _signed(scheme: str, body: bytes, secret: str) -> dict[str, str]:
    """The headers that sign ``body`` correctly for a vector's scheme."""
    if scheme == "github":
        return {"X-Hub-Signature-256": github_signature(secret, body)}
    if scheme == "stripe":
        return stripe_headers(body, secret, content_type=None)
    if scheme == "standard-webhooks":
        return standard_headers(body, secret, content_type=None)
    return {"X-Gitlab-Token": secret}  # gitlab: the token itself


def test_fixture_negative_vectors_end_to_end(http, db):
    assert NEGATIVE_VECTORS, f"{VECTORS_FILE} holds no derived-negative vector"
    latencies = []
    for v in NEGATIVE_VECTORS:
        path = f"/vec/{VECTOR_SLOTS[(v['scheme'], v['secret'])]}"
        body = (PAYLOADS / v["body_file"]).read_bytes()
        if "timestamp" in v:
            headers = _fresh_variant(v, body, v["secret"])
        else:
            headers = list(v["headers"].items())
        if v.get("content_type"):
            headers.append(("Content-Type", v["content_type"]))
        started = time.perf_counter()
        reply = http.post(path, content=body, headers=headers)
        latencies.append(time.perf_counter() - started)
        assert reply.status_code == 401, (v["id"], reply.text)
        assert_refused(reply, 401, "AUTH_REQUIRED")
        assert run_state_size(db) == 0, v["id"]

        # Control: the same path, body and secret with a correct signature is not a 401.
        good = _signed(v["scheme"], body, v["secret"])
        assert http.post(path, content=body, headers=good).status_code != 401, v["id"]
        db.flushall()
    figures(
        "negative_vectors_e2e",
        vectors=len(NEGATIVE_VECTORS),
        status_401=len(NEGATIVE_VECTORS),
        dbsize_after=0,
        p50_ms=ms(p50(latencies)),
        max_ms=ms(max(latencies)),
    )


def _hostile_cases() -> list[tuple[str, Callable[[], tuple[str, bytes, HeaderList]]]]:
    """(name, build) where build() gives (path, body, headers) at send time."""
    cases: list[tuple[str, Callable[[], tuple[str, bytes, HeaderList]]]] = []

    def gh(name: str, fn: Callable[[bytes, HeaderList], tuple[bytes, HeaderList]]) -> None:
        def build() -> tuple[str, bytes, HeaderList]:
            body = push_body()
            out_body, headers = fn(body, gh_headers(body))
            return "/hooks/github", out_body, headers

        cases.append((f"github:{name}", build))

    def sig_of(headers: HeaderList, name: str = "X-Hub-Signature-256") -> str:
        return next(v for k, v in headers if k.lower() == name.lower())

    gh("flipped-signature-byte", lambda b, h: (
        b, with_replaced(h, "X-Hub-Signature-256", flip_char(sig_of(h), 20))))  # fmt: skip
    gh("flipped-body-byte", lambda b, h: (flip_byte(b, len(b) // 2), h))
    gh("truncated-signature", lambda b, h: (
        b, with_replaced(h, "X-Hub-Signature-256", sig_of(h)[:-2])))  # fmt: skip
    gh("prefix-only", lambda b, h: (b, with_replaced(h, "X-Hub-Signature-256", "sha256=")))
    gh("sha1-prefix-on-sha256-value", lambda b, h: (
        b, with_replaced(h, "X-Hub-Signature-256", "sha1=" + sig_of(h)[7:])))  # fmt: skip
    gh("sha1-prefix-sha1-value", lambda b, h: (b, with_replaced(
        h, "X-Hub-Signature-256",
        github_signature(GITHUB_SECRET, b, algorithm="sha1"))))  # fmt: skip
    gh("x-hub-signature-sha1-only", lambda b, h: (b, [
        *with_replaced(h, "X-Hub-Signature-256", None),
        ("X-Hub-Signature", github_signature(GITHUB_SECRET, b, algorithm="sha1")),
    ]))  # fmt: skip
    gh("missing-header", lambda b, h: (b, with_replaced(h, "X-Hub-Signature-256", None)))
    gh("empty-header", lambda b, h: (b, with_replaced(h, "X-Hub-Signature-256", "")))
    gh("repeated-header-both-valid", lambda b, h: (
        b, [*h, ("X-Hub-Signature-256", sig_of(h))]))  # fmt: skip
    gh("repeated-header-valid-and-bogus", lambda b, h: (
        b, [*h, ("X-Hub-Signature-256", "sha256=" + "0" * 64)]))  # fmt: skip
    gh("wrong-secret", lambda b, h: (b, with_replaced(
        h, "X-Hub-Signature-256",
        github_signature("not-the-secret", b))))  # fmt: skip
    gh("reserialised-json-body", lambda b, h: (reserialised(b), h))

    def stripe(name: str, fn: Callable[[bytes, int], tuple[bytes, HeaderList]]) -> None:
        def build() -> tuple[str, bytes, HeaderList]:
            body = stripe_body()
            out_body, headers = fn(body, int(time.time()))
            return "/hooks/stripe", out_body, [("Content-Type", "application/json"), *headers]

        cases.append((f"stripe:{name}", build))

    def ss(t: int | str, v1: str) -> HeaderList:
        return [("Stripe-Signature", f"t={t},v1={v1}")]

    stripe("flipped-signature-byte", lambda b, t: (b, ss(t, flip_char(stripe_sig(b, t), 9))))
    stripe("flipped-body-byte", lambda b, t: (flip_byte(b, 20), ss(t, stripe_sig(b, t))))
    stripe("truncated-signature", lambda b, t: (b, ss(t, stripe_sig(b, t)[:-4])))
    stripe("timestamp-301s-old", lambda b, t: (b, ss(t - 301, stripe_sig(b, t - 301))))
    stripe("timestamp-10min-future", lambda b, t: (b, ss(t + 600, stripe_sig(b, t + 600))))
    stripe("timestamp-changed-after-signing", lambda b, t: (b, ss(t - 1, stripe_sig(b, t))))
    stripe("v0-only-current", lambda b, t: (
        b, [("Stripe-Signature", f"t={t},v0={stripe_sig(b, t)}")]))  # fmt: skip
    stripe("empty-header", lambda b, t: (b, [("Stripe-Signature", "")]))
    stripe("repeated-header-both-valid", lambda b, t: (b, ss(t, stripe_sig(b, t)) * 2))
    stripe("wrong-secret", lambda b, t: (b, ss(t, stripe_signature("whsec_other", b, t))))
    stripe("reserialised-json-body", lambda b, t: (reserialised(b), ss(t, stripe_sig(b, t))))

    def std(name: str, fn: Callable[[bytes, dict[str, str]], tuple[bytes, HeaderList]]) -> None:
        def build() -> tuple[str, bytes, HeaderList]:
            body = std_body()
            out_body, headers = fn(body, std_signed(body))
            return "/hooks/standard", out_body, [("Content-Type", "application/json"), *headers]

        cases.append((f"standard:{name}", build))

    def swap(h: dict[str, str], name: str, value: str | None) -> HeaderList:
        return with_replaced(list(h.items()), name, value)

    std("webhook-id-not-the-signed-one", lambda b, h: (
        b, swap(h, "webhook-id", h["webhook-id"] + "x")))  # fmt: skip
    std("flipped-signature-byte", lambda b, h: (
        b, swap(h, "webhook-signature", flip_char(h["webhook-signature"], 10))))  # fmt: skip
    std("flipped-body-byte", lambda b, h: (flip_byte(b, 5), list(h.items())))
    std("truncated-signature", lambda b, h: (
        b, swap(h, "webhook-signature", h["webhook-signature"][:-6])))  # fmt: skip
    std("timestamp-301s-old", lambda b, h: (b, list(std_signed(
        b, msg_id=h["webhook-id"], timestamp=time.time() - 301).items())))  # fmt: skip
    std("timestamp-10min-future", lambda b, h: (b, list(std_signed(
        b, msg_id=h["webhook-id"], timestamp=time.time() + 600).items())))  # fmt: skip
    std("empty-signature", lambda b, h: (b, swap(h, "webhook-signature", "")))
    std("repeated-signature-both-valid", lambda b, h: (
        b, [*h.items(), ("webhook-signature", h["webhook-signature"])]))  # fmt: skip
    std("v1a-only", lambda b, h: (
        b, swap(h, "webhook-signature", "v1a," + h["webhook-signature"][3:])))  # fmt: skip
    std("reserialised-json-body", lambda b, h: (reserialised(b), list(h.items())))

    def tok(name: str, headers: HeaderList) -> None:
        cases.append((f"token:{name}", lambda: ("/hooks/token", b"{}", headers)))

    tok("flipped-byte", [("X-Realm-Token", flip_char(TRIGGER_TOKEN, 5))])
    tok("truncated", [("X-Realm-Token", TRIGGER_TOKEN[:-1])])
    tok("empty", [("X-Realm-Token", "")])
    tok("repeated-both-valid", [("X-Realm-Token", TRIGGER_TOKEN)] * 2)
    return cases


HOSTILE_CASES = _hostile_cases()


def test_hostile_signatures_end_to_end_are_401_and_write_nothing(http, db):
    failures = []
    latencies = []
    for name, build in HOSTILE_CASES:
        path, body, headers = build()
        started = time.perf_counter()
        reply = http.post(path, content=body, headers=headers)
        latencies.append(time.perf_counter() - started)
        written = run_state_size(db)
        ok = (
            reply.status_code == 401
            and "Traceback" not in reply.text
            and reply.json().get("code") == "AUTH_REQUIRED"
            and written == 0
        )
        if not ok:
            failures.append(f"{name}: {reply.status_code} {reply.text[:200]} dbsize={written}")
            db.flushall()
    figures(
        "hostile_signatures_e2e",
        cases=len(HOSTILE_CASES),
        status_401=len(HOSTILE_CASES) - len(failures),
        writes=0 if not failures else "see failures",
        p50_ms=ms(p50(latencies)),
        max_ms=ms(max(latencies)),
    )
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- 11. same id, new body


def test_same_event_id_different_body_is_flagged_not_silent(http, db, gateway):
    delivery = str(uuid.uuid4())
    first_body = push_body("refs/heads/main")
    first = http.post("/hooks/github", content=first_body, headers=gh_headers(first_body, delivery))
    assert first.status_code == 202, first.text
    run_id = first.json()["results"][0]["run_id"]

    # The exact redelivery is a plain deduplication, not flagged.
    again = http.post("/hooks/github", content=first_body, headers=gh_headers(first_body, delivery))
    assert again.status_code == 200, again.text
    assert "params_mismatch" not in again.json()["results"][0]

    other_body = push_body("refs/heads/evil")
    second = http.post(
        "/hooks/github", content=other_body, headers=gh_headers(other_body, delivery)
    )
    assert second.status_code == 200, second.text
    [result] = second.json()["results"]
    assert result["outcome"] == "deduplicated"
    assert result["run_id"] == run_id
    assert result.get("params_mismatch") is True, result
    assert runs_of(db, "sink") == [run_id]
    assert db.xlen(Keys("realm", "sink").stream()) == 1
    assert json.loads(db.hget(Keys("realm", "sink").run(run_id), "params")) == {
        "ref": "refs/heads/main"
    }

    deadline = time.monotonic() + 5
    while True:
        flagged = [
            line
            for line in delivery_lines(gateway.log())
            if any(
                r.get("params_mismatch") is True and r.get("event_id") == delivery
                for r in line.get("results", [])
            )
        ]
        if flagged or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(flagged) == 1, gateway.log()[-3000:]
    raw_lines = [ln for ln in gateway.log().splitlines() if delivery in ln]
    assert any('"params_mismatch":true' in ln for ln in raw_lines)
    figures("params_mismatch_flag", status=200, runs=1, stream_entries=1, warning_lines=1)


def test_same_event_id_different_body_with_reject_is_409(http, db):
    delivery = str(uuid.uuid4())
    body = push_body("refs/heads/main")
    first = http.post("/hooks/github-strict", content=body, headers=gh_headers(body, delivery))
    assert first.status_code == 202, first.text
    run_id = first.json()["results"][0]["run_id"]

    other = push_body("refs/heads/main", pad=3)
    second = http.post("/hooks/github-strict", content=other, headers=gh_headers(other, delivery))
    assert second.status_code == 409, second.text
    payload = second.json()
    assert payload["status"] == "error"
    [result] = payload["results"]
    assert result["code"] == "STATE_IDEMPOTENCY_KEY_CONFLICT", result
    assert result["outcome"] == "refused"
    assert runs_of(db, "strict") == [run_id]
    assert db.xlen(Keys("realm", "strict").stream()) == 1

    # The original body still deduplicates.
    same = http.post("/hooks/github-strict", content=body, headers=gh_headers(body, delivery))
    assert same.status_code == 200, same.text
    assert same.json()["results"][0]["run_id"] == run_id
    figures("params_mismatch_reject", status=409, runs=1, stream_entries=1)


# --------------------------------------------------------------------------- 13. limits


def _request_head(path: str, headers: HeaderList) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _complete(data: bytes) -> bool:
    """True once ``data`` holds a whole reply with a Content-Length body."""
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return True


def _read_status(sock: socket.socket, timeout: float) -> tuple[int | None, bytes]:
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data or not _complete(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionError):
        pass
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    return int(data[9:12]), data


def test_declared_oversize_body_is_413_before_it_is_sent(gateway, db):
    """Content-Length: 10 MB, only 4 KB sent: the 413 comes without waiting for the rest."""
    body_start = b"x" * 4096
    headers = [
        ("Content-Type", "application/json"),
        ("Content-Length", str(10 * 1024 * 1024)),
        ("X-GitHub-Event", "push"),
        ("X-GitHub-Delivery", str(uuid.uuid4())),
        ("X-Hub-Signature-256", "sha256=" + "0" * 64),
    ]
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        started = time.perf_counter()
        sock.sendall(_request_head("/hooks/github", headers) + body_start)
        status, raw = _read_status(sock, 5)
        elapsed = time.perf_counter() - started
    assert status == 413, raw[:500]
    assert b"VALIDATION_BODY_TOO_LARGE" in raw
    assert b"Traceback" not in raw
    assert elapsed < 1.0
    assert run_state_size(db) == 0
    figures(
        "oversize_declared",
        declared_bytes=10 * 1024 * 1024,
        sent_bytes=len(body_start),
        status=status,
        reply_ms=ms(elapsed),
    )


def test_chunked_oversize_body_is_413_mid_stream(gateway, db):
    """No Content-Length: the gateway stops reading once past the limit."""
    headers = [
        ("Content-Type", "application/json"),
        ("Transfer-Encoding", "chunked"),
        ("X-GitHub-Event", "push"),
        ("X-GitHub-Delivery", str(uuid.uuid4())),
        ("X-Hub-Signature-256", "sha256=" + "0" * 64),
    ]
    chunk = b"y" * 8192
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    status = None
    raw = b""
    replied = 0.0
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        started = time.perf_counter()
        sock.sendall(_request_head("/hooks/github", headers))
        sock.setblocking(False)
        while sent < 10 * 1024 * 1024 and time.perf_counter() - started < 10:
            try:
                raw += sock.recv(65536)
            except BlockingIOError:
                pass
            except ConnectionError:
                break
            if raw:
                replied = time.perf_counter() - started
                break
            try:
                sock.sendall(frame)
                sent += len(chunk)
            except (BlockingIOError, ConnectionError):
                pass
            time.sleep(0.002)
        if b"\r\n\r\n" not in raw or not _complete(raw):
            status, rest = _read_status(sock, 5)
            raw += rest
            replied = time.perf_counter() - started
    if raw.startswith(b"HTTP/1.1 "):
        status = int(raw[9:12])
    assert status == 413, raw[:500]
    assert b"Traceback" not in raw
    assert sent < 1024 * 1024, sent
    assert replied < 2.0, replied
    assert run_state_size(db) == 0
    figures(
        "oversize_chunked",
        limit=MAX_BODY,
        sent_before_reply_bytes=sent,
        status=status,
        reply_ms=ms(replied),
    )


def test_body_at_the_limit_passes_one_byte_over_is_413(http, db):
    skeleton = push_body(pad=0)
    pad = MAX_BODY - len(skeleton)
    exact = push_body(pad=pad)
    assert len(exact) == MAX_BODY, len(exact)
    reply = http.post("/hooks/github", content=exact, headers=gh_headers(exact))
    assert reply.status_code == 202, reply.text

    db.flushall()
    over = push_body(pad=pad + 1)
    assert len(over) == MAX_BODY + 1
    reply = http.post("/hooks/github", content=over, headers=gh_headers(over))
    assert_refused(reply, 413, "VALIDATION_BODY_TOO_LARGE")
    assert run_state_size(db) == 0
    figures("body_limit_boundary", limit=MAX_BODY, at_limit=202, over_by_one=413)


async def _slow_client(port: int, index: int, deadline: float) -> tuple[int | None, float, int]:
    """Headers at once, then one body byte a second, until a reply or ``deadline``."""
    body = push_body(f"refs/heads/slow-{index}")
    head = _request_head(
        "/hooks/github",
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            *[(k, v) for k, v in gh_headers(body, f"slow-{index}") if k != "Content-Type"],
        ],
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    sent = 0
    try:
        writer.write(head)
        await writer.drain()
        reply = asyncio.ensure_future(reader.read(4096))
        while not reply.done() and time.monotonic() < deadline and sent < len(body):
            writer.write(body[sent : sent + 1])
            sent += 1
            await writer.drain()
            await asyncio.wait([reply], timeout=1.0)
        if not reply.done():
            await asyncio.wait([reply], timeout=max(0.0, deadline - time.monotonic()))
        data = reply.result() if reply.done() and not reply.exception() else b""
        if not reply.done():
            reply.cancel()
    except ConnectionError:
        data = b""
    finally:
        writer.close()
    status = int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else None
    return status, time.monotonic() - started, sent


@pytest.mark.slow
async def test_slow_client_flood_does_not_starve_deliveries(gateway, db):
    n_slow = 200
    deadline = time.monotonic() + 15
    slow = [asyncio.create_task(_slow_client(gateway.port, i, deadline)) for i in range(n_slow)]
    await asyncio.sleep(0.5)  # every slow client connected and past its headers

    latencies: list[float] = []
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as client:
        until = time.monotonic() + BODY_TIMEOUT - 1.0  # while the flood is still holding on
        while time.monotonic() < until:
            body = push_body()
            started = time.perf_counter()
            reply = await client.post("/hooks/github", content=body, headers=gh_headers(body))
            latencies.append(time.perf_counter() - started)
            statuses.append(reply.status_code)
            await asyncio.sleep(0.05)
    results = await asyncio.gather(*slow)

    slow_statuses = [s for s, _, _ in results]
    slow_times = [t for _, t, _ in results]
    figures(
        "slow_client_flood",
        slow_clients=n_slow,
        slow_408=slow_statuses.count(408),
        slow_408_p50_s=round(p50(slow_times), 2),
        slow_408_max_s=round(max(slow_times), 2),
        normal_deliveries=len(latencies),
        normal_202=statuses.count(202),
        normal_p50_ms=ms(p50(latencies)),
        normal_max_ms=ms(max(latencies)),
    )
    assert statuses and all(s == 202 for s in statuses), statuses
    assert max(latencies) < 1.0
    assert slow_statuses == [408] * n_slow, sorted(set(map(str, slow_statuses)))
    assert all(BODY_TIMEOUT - 0.5 <= t < 15 for t in slow_times)
    # Exactly the normal deliveries wrote a run; no slow client's did.
    assert len(runs_of(db, "sink")) == len(statuses)
    assert not any(db.exists(Keys("realm", "sink").pointer(f"slow-{i}")) for i in range(n_slow))


@pytest.mark.slow
async def test_overload_answers_503_at_once_not_a_queue(gateway, db, module_redis):
    n = 50
    bodies = [push_body() for _ in range(n)]
    async with httpx.AsyncClient(
        base_url=gateway.base_url,
        timeout=15,
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
    ) as client:
        # Warm the connections so the burst below is not a burst of TCP handshakes.
        await asyncio.gather(*(client.get("/healthz") for _ in range(n)))

        async def deliver(body: bytes) -> tuple[int, str | None, float, str | None]:
            started = time.perf_counter()
            reply = await client.post("/hooks/github", content=body, headers=gh_headers(body))
            elapsed = time.perf_counter() - started
            assert "Traceback" not in reply.text
            return (
                reply.status_code,
                reply.json().get("code"),
                elapsed,
                reply.headers.get("retry-after"),
            )

        module_redis.pause()
        try:
            started = time.perf_counter()
            replies = await asyncio.gather(*(deliver(b) for b in bodies))
            total = time.perf_counter() - started
        finally:
            module_redis.resume()

        # The listener recovers once Redis answers again.
        recovered_at = None
        for _ in range(50):
            body = push_body()
            reply = await client.post("/hooks/github", content=body, headers=gh_headers(body))
            if reply.status_code == 202:
                recovered_at = time.perf_counter() - started
                break
            await asyncio.sleep(0.1)

    lines = [ln for ln in delivery_lines(gateway.log()) if ln.get("status") == 503]
    server_ms = sorted(ln["ms"] for ln in lines if ln.get("code") == "OVERLOADED")
    overloaded = [r for r in replies if r[1] == "OVERLOADED"]
    unavailable = [r for r in replies if r[1] == "STORE_UNAVAILABLE"]
    figures(
        "overload",
        deliveries=n,
        max_in_flight=MAX_IN_FLIGHT,
        overloaded_503=len(overloaded),
        overloaded_client_p50_ms=ms(p50([r[2] for r in overloaded])),
        overloaded_client_max_ms=ms(max((r[2] for r in overloaded), default=0)),
        overloaded_server_max_ms=max(server_ms, default=None),
        store_unavailable_503=len(unavailable),
        store_unavailable_min_s=round(min((r[2] for r in unavailable), default=0), 2),
        store_unavailable_max_s=round(max((r[2] for r in unavailable), default=0), 2),
        burst_total_s=round(total, 2),
        recovered_after_s=round(recovered_at, 2) if recovered_at else None,
    )
    assert all(r[0] == 503 for r in replies), sorted({(r[0], r[1]) for r in replies})
    assert len(unavailable) == MAX_IN_FLIGHT
    assert len(overloaded) == n - MAX_IN_FLIGHT
    # "At once": well under the 2 s Redis timeout as the client sees it (50 requests
    # through one client loop), and a few ms inside the gateway.
    assert all(r[2] < REDIS_TIMEOUT / 2 for r in overloaded)
    assert len(server_ms) >= n - MAX_IN_FLIGHT and server_ms[-1] < 100, server_ms
    assert all(r[3] for r in replies)  # Retry-After on every 503
    assert all(REDIS_TIMEOUT * 0.75 <= r[2] < REDIS_TIMEOUT * 2.5 for r in unavailable)
    assert recovered_at is not None
