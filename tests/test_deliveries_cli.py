"""`realm deliveries list | show | replay` as a user runs them: real processes, against
the log a real `realm listen` wrote to a real Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import orjson
import pytest
import redis

from gateway.deliveries.log import OUTCOMES
from tests import deliveries_scaffold
from tests.deliveries_scaffold import (
    CONFIG,
    SECRETS,
    UNKNOWN,
    UUID,
    WRONG_WHEN,
    github,
    plain,
    sent,
)
from tests.listener import Listener
from tests.servers import RedisServer

SINCE_ERROR = (
    "Error: --since must be an ISO 8601 time like 2026-05-01T12:00:00Z (UTC unless it names "
    "an offset) or a duration like 90m, 2h or 3d, meaning that long ago (got 'yesterday')\n"
)
listener = deliveries_scaffold.listener


class Realm:
    """Runs `realm ...` on the listener's config and Redis; ``secrets``: with the
    webhook secrets in the environment (replay loads the triggers)."""

    def __init__(self, config: Path, redis_url: str) -> None:
        self.config = config
        self.redis_url = redis_url

    def __call__(
        self, *args: str, secrets: bool = False, config: Path | None = None
    ) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
        for name in SECRETS:
            env.pop(name, None)
        if secrets:
            env.update(SECRETS)
        return subprocess.run(
            [sys.executable, "-m", "gateway", "deliveries", *args,
             "--config", str(config or self.config), "--redis-url", self.redis_url],
            cwd=self.config.parent, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip


@pytest.fixture
def realm(listener: Listener, module_redis: RedisServer, db: redis.Redis) -> Realm:
    return Realm(listener.config_path, module_redis.url)


def listed(realm: Realm, *args: str) -> dict:
    out = realm("list", "--json", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


@pytest.mark.slow
def test_list_show_and_replay_print_the_documented_text(
    realm: Realm, listener: Listener, db: redis.Redis
):
    body = orjson.dumps({"ref": "refs/heads/main", "n": [1, 2]})
    started, _ = sent(db, lambda: github(listener.base_url, body, delivery="d-41"))
    run_id = started.json()["results"][0]["run_id"]
    sent(db, lambda: github(listener.base_url, body, event="ping", delivery="d-42"))
    sent(db, lambda: plain(listener.base_url, "e-1", token="wrong"))
    page = listed(realm)
    assert page["cursor"] is None
    refused, ignored, first = page["deliveries"]

    out = realm("list")
    assert (out.returncode, out.stderr.splitlines()[-1]) == (0, f"using Redis at {realm.redis_url}")
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["DELIVERY", "ID", "RECEIVED", "STATUS", "PATH", "OUTCOMES"]
    expected = [
        (refused, "401", "/hooks/plain", "AUTH_REQUIRED; plain: unverified"),
        (ignored, "200", "/hooks/git", "push: ignored"),
        (first, "202", "/hooks/git", "push: started"),
    ]
    assert len(lines) == 4
    for line, (summary, status, path, outcomes) in zip(lines[1:], expected, strict=True):
        cells = [summary["delivery_id"], iso(summary["received_ms"]), status, path, outcomes]
        assert re.split(r"\s{2,}", line) == cells
        # Each column starts where its heading does.
        at = 0
        for heading, cell in zip(("DELIVERY ID", "RECEIVED", "STATUS", "PATH", "OUTCOMES"),
                                 cells, strict=True):  # fmt: skip
            at = line.index(cell, at)
            assert at == lines[0].index(heading), (heading, line)
            at += len(cell)

    shown = realm("show", first["delivery_id"])
    assert shown.returncode == 0, shown.stderr
    sent_headers = [
        f"  {name.decode().lower()}: {value.decode()}"
        for name, value in started.request.headers.raw
        if name.lower() != b"x-hub-signature-256"
    ]
    record = json.loads(realm("show", first["delivery_id"], "--json").stdout)
    assert shown.stdout == "\n".join([
        f"Delivery: {first['delivery_id']}",
        f"Received: {iso(first['received_ms'])}",
        "Path: /hooks/git",
        "Status: 202",
        f"Config version: {record['config_version']}",
        f"Took: {record['ms']} ms",
        "Triggers:",
        "  push → deploy: started",
        "    signature: ok",
        "    event id: d-41",
        "    key: d-41",
        '    params: {"ref":"refs/heads/main"}',
        f"    run: {run_id}",
        f"    why: Run '{run_id}' created for workflow 'deploy'. Ready for the agent: 'build'.",
        "Headers (signatures and tokens are never kept):",
        *sent_headers,
        f"Body: {len(body)} bytes, JSON:",
        "  {",
        '    "ref": "refs/heads/main",',
        '    "n": [',
        "      1,",
        "      2",
        "    ]",
        "  }",
    ]) + "\n"  # fmt: skip
    assert "x-hub-signature" not in shown.stdout
    assert started.request.headers["x-hub-signature-256"][7:] not in shown.stdout
    assert re.fullmatch(r"[0-9a-f]{12}", record["config_version"])

    why = realm("show", ignored["delivery_id"]).stdout
    assert why.endswith(
        "  push → deploy: ignored\n    signature: ok\n"
        "    why: not matched: header X-GitHub-Event is 'ping', expected 'push'\n"
        "Headers (signatures and tokens are never kept):\n" + why.split("kept):\n")[1]
    )
    assert realm("show", refused["delivery_id"]).stdout == "\n".join([
        f"Delivery: {refused['delivery_id']}",
        f"Received: {iso(refused['received_ms'])}",
        "Path: /hooks/plain",
        "Status: 401",
        "Error: AUTH_REQUIRED: signature did not verify: token mismatch",
        f"Config version: {record['config_version']}",
        f"Took: {json.loads(realm('show', refused['delivery_id'], '--json').stdout)['ms']} ms",
        "Triggers:",
        "  plain → sync: unverified",
        "    signature: token mismatch",
        "Headers: not kept (refused before it was verified)",
        "Body: not kept (refused before it was verified)",
    ]) + "\n"  # fmt: skip

    again = realm("replay", first["delivery_id"], secrets=True)
    assert again.returncode == 0, again.stdout + again.stderr
    replay_id = listed(realm)["deliveries"][0]["delivery_id"]
    assert again.stdout == "\n".join([
        "status: ok",
        f"delivery_id: {replay_id}",
        f"replay_of: {first['delivery_id']}",
        "rerun: false",
        "reply: 200",
        "Triggers:",
        "  push → deploy: deduplicated",
        "    event id: d-41",
        "    key: d-41",
        '    params: {"ref":"refs/heads/main"}',
        f"    run: {run_id}",
        f"    why: Matched existing run '{run_id}' (idempotent) in phase 'running'; no new "
        "run created. Ready for the agent: 'build'.",
    ]) + "\n"  # fmt: skip

    rerun = realm("replay", first["delivery_id"], "--rerun", "--json", secrets=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    record = json.loads(rerun.stdout)
    (result,) = record["triggers"]
    assert (record["status"], record["rerun"], record["replay_of"]) == (
        202,
        True,
        first["delivery_id"],
    )
    assert (result["outcome"], result["rerun_of"]) == ("started", run_id)
    assert re.fullmatch(UUID, result["run_id"]) and result["run_id"] != run_id
    text = realm("show", record["delivery_id"]).stdout
    assert f"Replay of: {first['delivery_id']} (rerun: new runs started)\n" in text
    assert f"    rerun of: {run_id}\n" in text
    listing = realm("list").stdout.splitlines()
    assert listing[1].endswith(f"  push: started (replay of {first['delivery_id']})")
    assert listing[2].endswith(f"push: deduplicated (replay of {first['delivery_id']})")


def test_what_a_sender_chose_is_printed_escaped(realm: Realm, listener: Listener, db):
    """A body cannot add lines of its own to `show` or drive the terminal."""
    sent(db, lambda: plain(listener.base_url, "e-1", body=b"line one\x1b[2K\r\nstatus: ok"))
    (summary,) = listed(realm)["deliveries"]
    shown = realm("show", summary["delivery_id"]).stdout
    assert "\x1b" not in shown and "\r" not in shown
    assert shown.endswith("Body: 24 bytes:\n  line one\\u001b[2K\\r\n  status: ok\n")


def test_pages_follow_the_printed_cursor(realm: Realm, listener: Listener, db: redis.Redis):
    for i in range(5):
        sent(db, partial(plain, listener.base_url, f"e-{i}"))
    everything = [d["delivery_id"] for d in listed(realm)["deliveries"]]
    seen: list[str] = []
    cursor: list[str] = []
    for _ in range(5):
        out = realm("list", "--limit", "2", *cursor)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        more = re.fullmatch(
            r"More deliveries may follow: pass --cursor (\S+) for the next page\.", lines[-1]
        )
        rows = lines[1:-1] if more else lines[1:]
        seen += [row.split()[0] for row in rows]
        if not more:
            break
        cursor = ["--cursor", more.group(1)]
    assert seen == everything and len(seen) == 5
    page = listed(realm, "--limit", "2")
    assert page["cursor"] == everything[1]
    assert [d["delivery_id"] for d in page["deliveries"]] == everything[:2]
    # Past the oldest: an empty page says so.
    last = realm("list", "--cursor", everything[-1])
    assert (last.returncode, last.stdout) == (0, "no deliveries\n")


@pytest.mark.slow
def test_filters_and_bad_values(realm: Realm, listener: Listener, db: redis.Redis):
    url = listener.base_url
    sent(db, lambda: github(url, b'{"ref": "x"}', delivery="d-1"))
    sent(db, lambda: github(url, b'{"ref": "x"}', event="ping", delivery="d-2"))
    sent(db, lambda: plain(url, "e-1", token="wrong"))
    refused, ignored, started = (d["delivery_id"] for d in listed(realm)["deliveries"])

    def ids(*args: str) -> list[str]:
        return [d["delivery_id"] for d in listed(realm, *args)["deliveries"]]

    assert ids("--status", "4xx") == [refused]
    assert ids("--status", "202") == [started]
    assert ids("--path", "/hooks/git") == [ignored, started]
    assert ids("--outcome", "ignored") == [ignored]
    assert ids("--path", "/hooks/git", "--status", "2xx", "--outcome", "started") == [started]
    assert ids("--since", "90m") == [refused, ignored, started]
    second_ms = listed(realm)["deliveries"][1]["received_ms"]
    assert ids("--since", iso(second_ms)) == [refused, ignored]
    assert ids("--since", "2099-01-01") == []

    for args, error in [
        (("--since", "yesterday"), SINCE_ERROR),
        (("--since", "-2h"), SINCE_ERROR.replace("'yesterday'", "'-2h'")),
        (("--status", "2x"),
         "Error: --status must be an HTTP status like 202 or a class like 4xx (got '2x')\n"),
        (("--path", "hooks"), "Error: --path must start with '/' (got 'hooks')\n"),
        (("--outcome", "lost"), "Error: --outcome must be one of started, queued, scheduled, "
                                "deduplicated, refused, stale, rate_limited, handshake, "
                                "ignored, unverified, accepted (got 'lost')\n"),
    ]:  # fmt: skip
        bad = realm("list", *args)
        assert (bad.returncode, bad.stdout, bad.stderr) == (2, "", error), args

    # The help names every outcome (it is written out: `realm` starts without the log's module).
    helped = " ".join(realm("list", "--help").stdout.split())
    assert all(outcome in helped.split("--outcome")[1] for outcome in OUTCOMES)

    for command in ("show", "replay"):
        bad = realm(command, "not-an-id", secrets=True)
        assert (bad.returncode, bad.stdout) == (
            1,
            "status: error\nVALIDATION_PARAMS: delivery id 'not-an-id' is not one (ids look "
            "like dlv-0193a1b2c3d4-5e6f7a8b)\n",
        )
        unknown = realm(command, UNKNOWN, "--json", secrets=True)
        assert unknown.returncode == 1
        assert json.loads(unknown.stdout) == {
            "status": "error",
            "code": "NOT_FOUND_DELIVERY",
            "message": f"delivery {UNKNOWN} is not in the delivery log (it keeps "
            "settings.delivery_retention and at most settings.max_deliveries)",
        }
    cursor = realm("list", "--cursor", "12")
    assert (cursor.returncode, cursor.stdout) == (
        1,
        "status: error\nVALIDATION_PARAMS: cursor must be the value a previous page returned "
        "(got '12')\n",
    )
    not_replayable = realm("replay", refused, secrets=True)
    assert (not_replayable.returncode, not_replayable.stdout) == (
        1,
        f"status: error\nSTATE_DELIVERY_NOT_REPLAYABLE: delivery {refused} was refused (401) "
        "before it was verified: the log keeps neither its headers nor its body\n",
    )
    for out in (bad, unknown, cursor, not_replayable):
        assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_replay_after_fixing_the_trigger_starts_the_run(
    module_redis: RedisServer, tmp_path: Path, db: redis.Redis
):
    """The main use from the command line: the listener's trigger had a wrong `when`,
    the file is fixed, and the replay (with the fixed file) starts the run."""
    wrong = Listener(tmp_path, WRONG_WHEN, redis_url=module_redis.url, env=SECRETS).start()
    try:
        reply, _ = sent(
            db, lambda: github(wrong.base_url, b'{"ref": "refs/heads/main"}', delivery="d-main")
        )
        assert (reply.status_code, reply.json()["results"][0]["outcome"]) == (200, "ignored")
    finally:
        wrong.stop()
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(CONFIG)
    realm = Realm(fixed, module_redis.url)
    (ignored,) = listed(realm)["deliveries"]
    assert ignored["outcomes"] == [{"trigger": "push", "outcome": "ignored", "run_id": None}]

    # Without the webhook secrets the triggers cannot be loaded: one line, exit 3.
    missing = realm("replay", ignored["delivery_id"])
    assert missing.returncode == 3
    assert missing.stderr.splitlines()[-1].startswith(f"error: {fixed}: ")
    assert "GIT_SECRET" in missing.stderr and "Traceback" not in missing.stderr

    replayed = realm("replay", ignored["delivery_id"], secrets=True)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    run_id = re.search(rf"^    run: ({UUID})$", replayed.stdout, re.M).group(1)
    assert replayed.stdout.splitlines()[:7] == [
        "status: ok",
        f"delivery_id: {listed(realm)['deliveries'][0]['delivery_id']}",
        f"replay_of: {ignored['delivery_id']}",
        "rerun: false",
        "reply: 202",
        "Triggers:",
        "  push → deploy: started",
    ]
    shown = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "show", run_id, "--json",
         "--config", str(fixed), "--redis-url", module_redis.url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    run = json.loads(shown.stdout)
    assert (run["workflow"], run["params"]) == ("deploy", {"ref": "refs/heads/main"})
