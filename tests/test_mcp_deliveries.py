"""The delivery log's MCP tools (list_deliveries, get_delivery, replay_delivery): ``realm
mcp`` as a subprocess, driven by the ``mcp`` SDK's client, reading the log a real
`realm listen` wrote to a real Redis."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.deliveries.log import OUTCOMES
from tests import deliveries_scaffold
from tests.deliveries_scaffold import CONFIG, DLV, SECRETS, UUID, WRONG_WHEN, github, sent
from tests.listener import Listener
from tests.mcp_client import mcp_session
from tests.servers import RedisServer

listener = deliveries_scaffold.listener


@pytest.fixture
def connect(module_redis: RedisServer, db: redis.Redis) -> Callable[..., Any]:
    """An MCP session of `realm mcp` on ``config`` (with the webhook secrets unless told)."""
    return lambda config, *, secrets=True: mcp_session(
        config, module_redis.url, SECRETS if secrets else None
    )


def push(db: redis.Redis, base_url: str, event: str = "push", delivery: str = "d-1") -> str:
    """One push (``event`` "unsigned": its signature wrong), waited for in the log; its id."""
    body = b'{"ref": "refs/heads/main"}'
    bad = {"X-Hub-Signature-256": "sha256=00"} if event == "unsigned" else {}
    return sent(db, lambda: github(base_url, body, event=event, delivery=delivery, **bad))[1]


async def test_the_three_tools_are_listed_with_typed_arguments(
    connect: Callable[..., Any], listener: Listener
) -> None:
    async with connect(listener.config_path) as tools:
        listed = {t.name: t for t in (await tools.session.list_tools()).tools}
    assert {"list_deliveries", "get_delivery", "replay_delivery"} <= set(listed)
    props = listed["list_deliveries"].input_schema["properties"]
    assert set(props) == {"path", "status", "outcome", "since", "limit", "cursor"}
    assert props["outcome"]["anyOf"][0]["enum"] == list(OUTCOMES)
    assert (props["limit"]["minimum"], props["limit"]["maximum"]) == (1, 1000)
    assert listed["get_delivery"].input_schema["required"] == ["delivery_id"]
    replay = listed["replay_delivery"].input_schema
    assert replay["required"] == ["delivery_id"]
    assert (replay["properties"]["rerun"]["type"], replay["properties"]["rerun"]["default"]) == (
        "boolean",
        False,
    )


async def test_list_get_and_replay(connect: Callable[..., Any], listener: Listener, db) -> None:
    started = push(db, listener.base_url, delivery="d-7")
    refused = push(db, listener.base_url, event="unsigned")
    async with connect(listener.config_path) as tools:
        text = await tools.ok("list_deliveries")
        lines = text.splitlines()
        assert lines[0].split() == ["DELIVERY", "ID", "RECEIVED", "STATUS", "PATH", "OUTCOMES"]
        assert [line.split()[0] for line in lines[1:]] == [refused, started]
        assert lines[1].split()[2:] == [
            "401",
            "/hooks/git",
            "AUTH_REQUIRED;",
            "push:",
            "unverified",
        ]
        assert lines[2].split()[2:] == ["202", "/hooks/git", "push:", "started"]

        first = await tools.ok("list_deliveries", limit=1)
        assert first.splitlines()[1:] == [first.splitlines()[1], f"cursor: {refused}"]
        rest = await tools.ok("list_deliveries", limit=1, cursor=refused)
        assert rest.splitlines()[1].split()[0] == started
        assert (await tools.ok("list_deliveries", status="4xx")).splitlines()[1].startswith(refused)
        assert await tools.ok("list_deliveries", since="2099-01-01") == "no deliveries"

        shown = await tools.ok("get_delivery", delivery_id=started)
        run_id = re.search(rf"^    run: ({UUID})$", shown, re.M).group(1)
        assert shown.startswith(f"Delivery: {started}\n")
        assert "  push → deploy: started\n" in shown
        assert "  x-github-delivery: d-7\n" in shown
        assert "signature-256" not in shown
        assert shown.endswith('Body: 26 bytes, JSON:\n  {\n    "ref": "refs/heads/main"\n  }')

        again = await tools.ok("replay_delivery", delivery_id=started)
        replay_id = re.search(rf"^delivery_id: ({DLV})$", again, re.M).group(1)
        assert again == "\n".join([
            "status: ok",
            f"delivery_id: {replay_id}",
            f"replay_of: {started}",
            "rerun: false",
            "reply: 200",
            "Triggers:",
            "  push → deploy: deduplicated",
            "    event id: d-7",
            "    key: d-7",
            '    params: {"ref":"refs/heads/main"}',
            f"    run: {run_id}",
            f"    why: Matched existing run '{run_id}' (idempotent) in phase 'running'; no new "
            "run created. Ready for the agent: 'build'.",
        ])  # fmt: skip
        rerun = await tools.ok("replay_delivery", delivery_id=started, rerun=True)
        assert "reply: 202\n" in rerun and f"    rerun of: {run_id}\n" in rerun
        assert "rerun: true\n" in rerun

        not_replayable = await tools.refused("replay_delivery", delivery_id=refused)
        assert not_replayable == (
            f"status: error\nSTATE_DELIVERY_NOT_REPLAYABLE: delivery {refused} was refused "
            "(401) before it was verified: the log keeps neither its headers nor its body"
        )
        bad = await tools.refused("get_delivery", delivery_id="nope")
        assert bad == (
            "status: error\nVALIDATION_PARAMS: delivery id 'nope' is not one (ids look like "
            "dlv-0193a1b2c3d4-5e6f7a8b)"
        )
        unknown = await tools.refused("get_delivery", delivery_id="dlv-000000000000-00000000")
        assert unknown.startswith("status: error\nNOT_FOUND_DELIVERY: delivery ")
        since = await tools.refused("list_deliveries", since="soon")
        assert since.startswith("status: error\nVALIDATION_PARAMS: since must be an ISO 8601 ")
        outcome = await tools.refused("list_deliveries", outcome="lost")
        assert outcome.startswith("status: error\nVALIDATION_PARAMS: list_deliveries: outcome")
        cursor = await tools.refused("list_deliveries", cursor="7")
        assert cursor == (
            "status: error\nVALIDATION_PARAMS: cursor must be the value a previous page "
            "returned (got '7')"
        )


@pytest.mark.slow
async def test_a_replay_after_fixing_the_file_starts_the_run(
    connect: Callable[..., Any], module_redis: RedisServer, tmp_path: Path, db
) -> None:
    """The main use: the trigger's `when` was wrong; the file is fixed while the MCP
    server runs, and replay_delivery reads it as it is now."""
    wrong = Listener(tmp_path, WRONG_WHEN, redis_url=module_redis.url, env=SECRETS).start()
    try:
        ignored = push(db, wrong.base_url, delivery="d-main")
    finally:
        wrong.stop()
    async with connect(wrong.config_path) as tools:
        still = await tools.ok("replay_delivery", delivery_id=ignored)
        assert "reply: 200\n" in still and "  push → deploy: ignored\n" in still
        wrong.config_path.write_text(CONFIG)
        fixed = await tools.ok("replay_delivery", delivery_id=ignored)
        assert "reply: 202\n" in fixed and "  push → deploy: started\n" in fixed
        run_id = re.search(rf"^    run: ({UUID})$", fixed, re.M).group(1)
        run = await tools.ok("get_run", run_id=run_id)
        assert 'Params: {"ref":"refs/heads/main"}' in run

    async with connect(wrong.config_path, secrets=False) as tools:
        # The run tools need no secret; a replay needs the triggers, so it does.
        assert (await tools.ok("get_run", run_id=run_id)).startswith(f"Run: {run_id}\n")
        missing = await tools.refused("replay_delivery", delivery_id=ignored)
        assert missing.startswith(
            "status: error\nCONFIG_INVALID: a replay needs the triggers, which do not load: "
            f"{wrong.config_path}: "
        )
        assert "GIT_SECRET" in missing and missing.endswith(
            "(realm mcp needs the webhook secrets in its environment for this, as realm "
            "listen does)"
        )
