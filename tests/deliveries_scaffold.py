"""What the delivery log's tests share (tests/test_delivery_log.py, test_deliveries_api.py,
test_deliveries_cli.py, test_mcp_deliveries.py, test_delivery_log_faults.py,
test_deliveries_cluster.py, test_replay_verified.py, test_cluster_admin.py): the triggers
they serve, their secrets, a module's real `realm listen` of them, the senders, and the
wait until the listener's log holds what was sent.

The listener writes its records every 100 ms: a test that needs a delivery in the log
waits for it (``sent``), with a deadline.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest
import redis

from gateway.deliveries.log import LogKeys, Received
from gateway.ingest.delivery import handle
from gateway.ingest.served import triggers_by_path
from gateway.ingest.webhooks import RequestHeaders
from gateway.loading import parse_config
from gateway.model.config import Config
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.servers import RedisServer
from tests.signing import github_headers

API_TOKEN = "deliveries-api-token-51c2"
GIT_SECRET = "git-secret-0d9e4a"
HOOK_TOKEN = "hook-token-77b1f0"
SECRETS = {"GIT_SECRET": GIT_SECRET, "HOOK_TOKEN": HOOK_TOKEN}
ENV = {"REALM_API_TOKEN": API_TOKEN, **SECRETS}
# A GitHub push (signed; only X-GitHub-Event push is matched) and a token-verified hook.
TRIGGERS = """
version: 1
workflows:
  sync: {steps: [fetch, load]}
  deploy: {steps: [build, release]}
triggers:
  push:
    workflow: deploy
    path: /hooks/git
    verify: {scheme: github, secret_env: GIT_SECRET}
    when: [{header: X-GitHub-Event, equals: push}]
    event_id: {header: X-GitHub-Delivery}
    params: {ref: $.ref}
  plain:
    workflow: sync
    path: /hooks/plain
    verify: {scheme: token, header: X-Token, secret_env: HOOK_TOKEN}
    event_id: {header: X-Event-Id}
"""
# What the listener serves: a body longer than 200 bytes is stored cut.
CONFIG = TRIGGERS + "settings:\n  max_stored_body_bytes: 200\n"
# The push trigger's `when` gone wrong: a push to main is ignored (the tests fix it).
WRONG_WHEN = CONFIG.replace(
    "when: [{header: X-GitHub-Event, equals: push}]",
    "when: [{header: X-GitHub-Event, equals: push}, {jsonpath: $.ref, equals: refs/heads/master}]",
)
DLV = r"dlv-[0-9a-f]{12}-[0-9a-f]{8}"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
UNKNOWN = "dlv-000000000000-00000000"


# -- a real listener -------------------------------------------------------------------


@pytest.fixture(scope="module")
def listener(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    """The module's `realm listen` of CONFIG on the module's Redis (a test module binds
    it: ``listener = deliveries_scaffold.listener``)."""
    started = Listener(
        tmp_path_factory.mktemp("deliveries"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield started
    started.stop()


def github(
    base_url: str, body: bytes, *, event: str = "push", delivery: str = "d-1", **more: str
) -> httpx.Response:
    """A GitHub delivery, signed with the push trigger's secret; ``more`` adds (or
    replaces) headers. No bearer token on a webhook: the sender's own headers only."""
    headers = github_headers(body, GIT_SECRET, event=event, delivery=delivery, **more)
    return httpx.post(base_url + "/hooks/git", content=body, headers=headers, timeout=10)


def plain(
    base_url: str, event_id: str, *, body: bytes = b"{}", token: str = HOOK_TOKEN
) -> httpx.Response:
    """A delivery to the token-verified hook (``token`` wrong: refused, 401)."""
    headers = {"X-Token": token, "X-Event-Id": event_id, "Content-Type": "application/json"}
    return httpx.post(base_url + "/hooks/plain", content=body, headers=headers, timeout=10)


def push_body(ref: str = "refs/heads/main") -> bytes:
    return orjson.dumps({"ref": ref, "repository": {"full_name": "o/r"}})


def spec_fingerprint(scheme: str, *secret_env: str) -> str:
    """What a record keeps of a trigger's verify spec: its scheme and the names of its
    secrets' variables, sorted and hashed (never a secret's value)."""
    return hashlib.sha256("\n".join([scheme, *sorted(secret_env)]).encode()).hexdigest()[:16]


def logged(db: redis.Redis) -> int:
    """How many deliveries the log in ``db`` holds, verified and refused."""
    keys = LogKeys("realm")
    return int(db.zcard(keys.index)) + int(db.zcard(keys.refused))


def sent(
    db: redis.Redis, send: Callable[[], httpx.Response], status: int | None = None
) -> tuple[httpx.Response, str]:
    """``send()`` one delivery (its reply ``status``, when given), then wait until the
    log in ``db`` holds it; the reply and the delivery's id. Waiting also keeps
    deliveries in distinct milliseconds, so newest first is one order."""
    before = logged(db)
    reply = send()
    if status is not None:
        assert reply.status_code == status, reply.text
    deadline = time.monotonic() + 10
    while (now := logged(db)) == before:
        assert time.monotonic() < deadline, "the delivery was not logged"
        time.sleep(0.02)
    assert now == before + 1, f"{now - before} deliveries logged for one sent"
    keys = LogKeys("realm")
    newest = db.zrange(keys.index, -1, -1) + db.zrange(keys.refused, -1, -1)
    delivery_id = max(newest)
    return reply, delivery_id if isinstance(delivery_id, str) else delivery_id.decode()


# -- the store alone, without a listener ------------------------------------------------

# Bodies kept up to 2000 bytes; at most 50 deliveries (and 100 refused ones).
STORE_CONFIG = TRIGGERS + "settings:\n  max_stored_body_bytes: 2000\n  max_deliveries: 50\n"
# Sent beside the signature: credentials a record must leave out, and one it keeps.
ALSO_SENT = {
    "X-Hub-Signature": "sha1=0000",
    "Authorization": "Bearer abc",
    "Cookie": "session=1",
    "User-Agent": "GitHub-Hookshot/abc",
}


def load(text: str = STORE_CONFIG) -> Config:
    return parse_config(text, file="test.yaml", env=SECRETS)


def push(ref: str = "refs/heads/main", pad: int = 0) -> bytes:
    return orjson.dumps({"ref": ref, "pad": "x" * pad})


def signed(body: bytes, event: str = "push", delivery: str | None = None) -> list[list[str]]:
    """A GitHub delivery's headers as the listener receives them (lower-case), the
    signature fourth."""
    headers = github_headers(body, GIT_SECRET, event=event, delivery=delivery, **ALSO_SENT)
    return [[name.lower(), value] for name, value in headers.items()]


def _raw(headers: list[list[str]]) -> list[tuple[bytes, bytes]]:
    return [(n.encode(), v.encode()) for n, v in headers]


async def deliver(
    store: RunStore, body: bytes, headers: list[list[str]], *, when_ms: int | None = None
) -> Received:
    """One delivery to /hooks/git through the real request path, as the listener hands
    it over to the log."""
    triggers = triggers_by_path(store.config)["/hooks/git"]
    lookup = RequestHeaders(_raw(headers))
    reply = await handle(store, triggers, lookup, lookup.get("content-type"), body)
    received = int(time.time() * 1000) if when_ms is None else when_ms
    return Received(
        received, "/hooks/git", reply, 1.5, store.config.version, triggers, _raw(headers), body
    )
