"""What the inspector page's tests share (tests/test_ui.py over HTTP, test_ui_browser.py
in Chromium): the triggers, the API token the login takes, the module's real `realm
listen` with the inspector on, an admin API client, and a webhook sender."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.servers import RedisServer

TOKEN = "ui-test-token-5d1c9e"
HOOK_SECRET = "hook-secret-77ab"
CONFIG = (
    WORKFLOWS_YAML
    + """
triggers:
  hook:
    workflow: sync
    path: /hooks/plain
    verify: {scheme: token, header: X-Token, secret_env: HOOK_TOKEN}
    event_id: {header: X-Event-Id}
  hook-deploys:
    workflow: single
    path: /hooks/plain
    verify: {scheme: token, header: X-Token, secret_env: HOOK_TOKEN}
    when: [{jsonpath: $.kind, equals: deploy}]
    event_id: {header: X-Event-Id}
  other:
    workflow: sync
    path: /hooks/other
    verify: {scheme: token, header: X-Token, secret_env: HOOK_TOKEN}
    event_id: {jsonpath: $.id}
"""
)
ENV = {"REALM_API_TOKEN": TOKEN, "HOOK_TOKEN": HOOK_SECRET}


@pytest.fixture(scope="module")
def gateway(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    """The module's `realm listen` of CONFIG with REALM_API_TOKEN set: the inspector is
    on, and its login takes TOKEN (a test module binds it: ``gateway =
    inspector_scaffold.gateway``)."""
    listener = Listener(
        tmp_path_factory.mktemp("ui"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield listener
    listener.stop()


@pytest.fixture
def api(gateway: Listener) -> Iterator[httpx.Client]:
    """The admin API of the module's listener (the bearer token)."""
    with httpx.Client(
        base_url=gateway.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as client:
        yield client


def send(
    client: httpx.Client,
    event_id: str,
    body: dict[str, object],
    *,
    path: str = "/hooks/plain",
    secret: str = HOOK_SECRET,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """One webhook delivery, as a sender would post it."""
    return client.post(
        path,
        content=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "X-Token": secret,
            "X-Event-Id": event_id,
            **(headers or {}),
        },
    )
