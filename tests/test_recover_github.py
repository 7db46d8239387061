"""`realm recover github` as a user runs it: a real process, against a stand-in of
GitHub's webhook-deliveries API on loopback (tests/sender_apis.py) whose redeliveries
go, signed, to a real `realm listen` on a real Redis."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from tests.listener import Listener
from tests.sender_apis import (
    GitHubApi,
    github_primary_limit,
    retry_after,
    serve,
    server_error,
)
from tests.servers import RedisServer
from tests.signing import github_headers

TOKEN = "ghp_recoverTestToken0123456789abcdef"
GIT_SECRET = "recover-git-secret-5e1d"
HOOK = "/repos/octo-org/shop-api/hooks/7"
CONFIG = """
version: 1
workflows:
  deploy:
    steps: [build, release]
    params_schema:
      type: object
      required: [repo, sha]
      properties:
        sha: {type: string, pattern: "^[0-9a-f]{40}$"}
triggers:
  push:
    workflow: deploy
    path: /hooks/github
    verify: {scheme: github, secret_env: GIT_SECRET}
    when: [{header: X-GitHub-Event, equals: push}]
    event_id: {header: X-GitHub-Delivery}
    params: {repo: $.repository.full_name, sha: $.after}
  plain:
    workflow: deploy
    path: /hooks/plain
    verify: {scheme: token, header: X-Token, secret_env: GIT_SECRET}
    event_id: {header: X-Event-Id}
"""
# A push as GitHub sends it (pretty-printed: not the bytes the command re-serialises).
PUSH = (Path(__file__).parent / "payloads" / "github" / "push.json").read_text()
BAD_PUSH = orjson.dumps({**orjson.loads(PUSH), "after": "not-a-sha"})
RUNS = "realm:{deploy}:runs"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
WHEN = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


@pytest.fixture(scope="module")
def listener(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    started = Listener(
        tmp_path_factory.mktemp("recover-github"), CONFIG, redis_url=module_redis.url,
        env={"GIT_SECRET": GIT_SECRET},
    ).start()  # fmt: skip
    yield started
    started.stop()


@pytest.fixture
def github(listener: Listener, db: redis.Redis) -> Iterator[GitHubApi]:
    """The hook's deliveries, two to a page; redeliveries go to the listener."""
    api = GitHubApi(
        TOKEN, HOOK, deliver_to=listener.base_url + "/hooks/github", secret=GIT_SECRET,
        max_page=2,
    )  # fmt: skip
    with serve(api):
        yield api


class Recover:
    """Runs `realm recover github ...` on the listener's config and Redis, with
    GITHUB_TOKEN and no webhook secret in the environment (none is needed)."""

    def __init__(self, listener: Listener, redis_url: str) -> None:
        self.config = listener.config_path
        self.redis_url = redis_url

    def __call__(
        self, api: GitHubApi, *args: str, token: str | None = TOKEN, hook: bool = True
    ) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
        for name in ("GIT_SECRET", "GITHUB_TOKEN"):
            env.pop(name, None)
        if token is not None:
            env["GITHUB_TOKEN"] = token
        target = ["--repo", "octo-org/shop-api", "--hook", "7"] if hook else []
        return subprocess.run(
            [sys.executable, "-m", "gateway", "recover", "github", *target,
             "--api-url", api.url, "--config", str(self.config),
             "--redis-url", self.redis_url, *args],
            cwd=self.config.parent, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip


@pytest.fixture
def recover(listener: Listener, module_redis: RedisServer) -> Recover:
    return Recover(listener, module_redis.url)


def summary(out: subprocess.CompletedProcess) -> str:
    return out.stdout.splitlines()[-1]


def no_secret(out: subprocess.CompletedProcess) -> None:
    assert TOKEN not in out.stdout + out.stderr
    assert GIT_SECRET not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow
def test_pages_through_the_list_and_redelivers_each_missing_event_once(
    github: GitHubApi, recover: Recover, listener: Listener, db: redis.Redis
) -> None:
    github.add("g-ok", push("g-ok"), code=503, ago=320)
    github.add("g-ok", push("g-ok"), code=202, ago=300, redelivery=True)
    # Arrived and started a run, but GitHub gave up waiting for the answer.
    sent = github_headers(push("g-here"), GIT_SECRET, delivery="g-here")
    reply = httpx.post(listener.base_url + "/hooks/github", content=push("g-here"), headers=sent)
    assert reply.status_code == 202, reply.text
    here = github.add("g-here", push("g-here"), code=0, ago=280)
    ping = github.add("g-ping", b'{"zen": "Keep it logically awesome."}', event="ping", ago=260)
    bad = github.add("g-bad", BAD_PUSH, code=422, ago=240)
    miss1 = github.add("g-miss1", push("g-miss1"), code=503, ago=220)
    miss2 = github.add("g-miss2", push("g-miss2"), code=502, ago=200)
    assert db.zcard(RUNS) == 1
    next_pages = cursors(github, 3)

    out = recover(github, "--rate", "5")
    assert out.returncode == 0, out.stdout + out.stderr
    no_secret(out)
    assert out.stderr.splitlines()[0] == f"using Redis at {recover.redis_url}"
    lines = out.stdout.splitlines()
    assert len(lines) == 4, out.stdout
    assert re.fullmatch(
        rf"refused  g-bad  push  -  {WHEN}  push: VALIDATION_PARAMS: .*sha.*", lines[0]
    ), lines[0]
    assert lines[1:3] == [
        f"redelivered  g-miss1  push  -  {iso(miss1.delivered_at)}  last attempt: "
        "Invalid HTTP Response: 503; push: would start a new run",
        f"redelivered  g-miss2  push  -  {iso(miss2.delivered_at)}  last attempt: "
        "Invalid HTTP Response: 502; push: would start a new run",
    ]
    assert lines[3] == (
        "examined 7 deliveries (6 events): 1 ok, 1 already here, 1 not matched, 1 refused, "
        "0 in flight, 2 redelivered, 0 failed"
    )
    # Each missing one redelivered once, and it started its run here.
    assert github.redelivered == [miss1.id, miss2.id]
    assert db.zcard(RUNS) == 3
    # Four pages of two, each after the first by the Link header's cursor.
    pages = github.calls_to("GET", "/deliveries")
    assert [c.query for c in pages] == [
        {"per_page": "100"},
        *({"per_page": "2", "cursor": c} for c in next_pages),
    ]
    # The details read: those of the events with no successful attempt, never g-ok's.
    details = [c.path for c in github.calls_to("GET") if c not in pages]
    assert details == [f"{HOOK}/deliveries/{a.id}" for a in (here, ping, bad, miss1, miss2)]
    # At most --rate 5 redeliveries a second.
    posts = github.calls_to("POST", "/attempts")
    assert posts[1].at - posts[0].at >= 0.18

    why = {
        i["id"]: i["why"]
        for i in json.loads(recover(github, "--json", "--dry-run").stdout)["items"]
    }
    assert re.fullmatch(
        rf"push: a claim would return run {UUID} \(deduplicated, phase 'running'\)", why["g-here"]
    ), why
    assert (
        why["g-ping"]
        == "no trigger matched (push: header X-GitHub-Event is 'ping', expected 'push')"
    )

    again = recover(github, "--rate", "5")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[1:] == [
        "examined 9 deliveries (6 events): 3 ok, 1 already here, 1 not matched, 1 refused, "
        "0 in flight, 0 redelivered, 0 failed"
    ]
    assert github.redelivered == [miss1.id, miss2.id]
    assert db.zcard(RUNS) == 3


def push(guid: str) -> bytes:
    """A push of its own commit: GitHub's bodies name one event each, and the replay
    guard (on for github triggers) takes the same body under another id for a replay."""
    sha = hashlib.sha1(guid.encode()).hexdigest()
    return PUSH.replace("9b2e7d4f1a6c3e8b5d0f2a7c4e9b1d6f3a8c5e07", sha).encode()


def iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def cursors(github: GitHubApi, n: int) -> list[str]:
    """The cursors of the first ``n`` next-page links: the last id of each page."""
    ordered = sorted(github.attempts, key=lambda a: (a.delivered_at, a.id), reverse=True)
    return [f"v1_{ordered[2 * i + 1].id}" for i in range(n)]


def test_a_dry_run_prints_what_it_would_redeliver_and_posts_nothing(
    github: GitHubApi, recover: Recover, db: redis.Redis
) -> None:
    first = github.add("g-1", push("g-1"), code=0, ago=400)
    second = github.add("g-2", push("g-2"), code=503, ago=300)
    github.add("g-3", push("g-3"), code=200, ago=200)

    out = recover(github, "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        f"would redeliver  g-1  push  -  {iso(first.delivered_at)}  last attempt: timed out; "
        "push: would start a new run",
        f"would redeliver  g-2  push  -  {iso(second.delivered_at)}  last attempt: "
        "Invalid HTTP Response: 503; push: would start a new run",
        "dry run: examined 3 deliveries (3 events): 1 ok, 0 already here, 0 not matched, "
        "0 refused, 0 in flight, 2 to redeliver, 0 failed",
    ]
    as_json = json.loads(recover(github, "--dry-run", "--json").stdout)
    assert {k: v for k, v in as_json.items() if k != "items"} == {
        "dry_run": True, "examined": 3, "events": 3, "ok": 1, "already_here": 0,
        "not_matched": 0, "refused": 0, "in_flight": 0, "to_redeliver": 2, "failed": 0,
        "rate_limited": 0, "waited_s": 0, "error": None,
    }  # fmt: skip
    assert [(i["id"], i["outcome"]) for i in as_json["items"]] == [
        ("g-1", "to_redeliver"), ("g-2", "to_redeliver"), ("g-3", "ok"),
    ]  # fmt: skip
    assert github.calls_to("POST") == []
    assert github.redelivered == []
    assert db.zcard(RUNS) == 0
    assert list(db.scan_iter("realm:{recover:github}*")) == []


def test_since_stops_the_paging_at_the_first_older_delivery(
    github: GitHubApi, recover: Recover
) -> None:
    for n in range(3):
        github.add(f"g-new-{n}", push(f"g-new-{n}"), ago=600 + n)
    for n in range(5):
        github.add(f"g-old-{n}", push(f"g-old-{n}"), ago=3 * 3600 + n)

    out = recover(github, "--dry-run", "--since", "2h")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line.split("  ")[1] for line in out.stdout.splitlines()[:-1]] == [
        "g-new-2", "g-new-1", "g-new-0",
    ]  # fmt: skip
    assert summary(out).startswith("dry run: examined 3 deliveries (3 events): ")
    # Page 2 held the first older one: pages 3 and 4 were never asked for.
    assert len(github.calls_to("GET", "/deliveries")) == 2

    wider = recover(github, "--dry-run", "--since", "4h")
    assert summary(wider).startswith("dry run: examined 8 deliveries (8 events): ")
    assert len(github.calls_to("GET", "/deliveries")) == 2 + 4


@pytest.mark.slow
def test_rate_limit_replies_are_waited_out_and_counted(
    github: GitHubApi, recover: Recover, db: redis.Redis
) -> None:
    missing = github.add("g-1", push("g-1"))
    github.answer_next(github_primary_limit(1), method="GET")  # the list
    github.answer_next(retry_after(1, status=403), method="GET")  # the list, again
    github.answer_next(retry_after(1, status=429), method="POST")  # the redelivery

    began = time.monotonic()
    out = recover(github)
    took = time.monotonic() - began
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.fullmatch(
        r"examined 1 delivery \(1 event\): 0 ok, 0 already here, 0 not matched, 0 refused, "
        r"0 in flight, 1 redelivered, 0 failed; waited out 3 rate-limit replies "
        r"\((\d+\.\d) s\)",
        summary(out),
    )
    assert found, summary(out)
    assert 3.0 <= float(found.group(1)) <= 5.0
    assert took >= 3.0
    assert [c.status for c in github.calls_to("GET", "/deliveries")] == [403, 403, 200]
    assert [c.status for c in github.calls_to("POST")] == [429, 202]
    assert github.redelivered == [missing.id]
    assert db.zcard(RUNS) == 1


def test_a_rate_limit_longer_than_the_bound_fails_the_event_without_waiting(
    github: GitHubApi, recover: Recover, db: redis.Redis
) -> None:
    missing = github.add("g-1", push("g-1"))
    github.answer_next(retry_after(3600, status=429), method="POST")

    began = time.monotonic()
    out = recover(github)
    assert time.monotonic() - began < 20
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"failed  g-1  push  -  {iso(missing.delivered_at)}  GitHub's rate limit on POST "
        f"{HOOK}/deliveries/{missing.id}/attempts did not lift within 60 s (it asked to "
        "wait 3600 s more)",
        "examined 1 delivery (1 event): 0 ok, 0 already here, 0 not matched, 0 refused, "
        "0 in flight, 0 redelivered, 1 failed",
    ]
    # Nothing was redelivered, so nothing is held: the next run asks again.
    again = recover(github)
    assert again.returncode == 0, again.stdout + again.stderr
    assert summary(again) == (
        "examined 1 delivery (1 event): 0 ok, 0 already here, 0 not matched, 0 refused, "
        "0 in flight, 1 redelivered, 0 failed"
    )
    assert github.redelivered == [missing.id]
    assert db.zcard(RUNS) == 1


def test_a_server_error_is_retried(github: GitHubApi, recover: Recover) -> None:
    missing = github.add("g-1", push("g-1"))
    github.answer_next(server_error(502), method="GET")
    out = recover(github)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [c.status for c in github.calls_to("GET", "/deliveries")] == [502, 200]
    assert github.redelivered == [missing.id]


@pytest.mark.slow
def test_a_redelivery_in_flight_is_not_asked_for_twice(
    listener: Listener, recover: Recover, db: redis.Redis
) -> None:
    # GitHub has not got to a redelivery yet: it is not listed, and the event still
    # looks missing. A redelivery of its own that failed a minute ago is in flight too;
    # one that failed 20 minutes ago is not.
    slow = GitHubApi(TOKEN, HOOK)
    with serve(slow):
        pending = slow.add("g-pending", push("g-pending"), ago=900)
        slow.add("g-recent", push("g-recent"), ago=1800)
        slow.add("g-recent", push("g-recent"), code=503, ago=60, redelivery=True)
        slow.add("g-stale", push("g-stale"), ago=2400)
        stale = slow.add("g-stale", push("g-stale"), code=503, ago=1200, redelivery=True)

        first = recover(slow)
        assert first.returncode == 0, first.stdout + first.stderr
        assert [line.split("  ")[:2] for line in first.stdout.splitlines()[:-1]] == [
            ["redelivered", "g-stale"], ["redelivered", "g-pending"],
            ["in flight", "g-recent"],
        ]  # fmt: skip
        recent = first.stdout.splitlines()[2]
        assert recent.endswith(
            "  a redelivery in the last 10 min has not succeeded yet; looked at again later"
        ), recent
        assert slow.redelivered == [stale.id, pending.id]

        second = recover(slow)
        assert second.returncode == 0, second.stdout + second.stderr
        assert summary(second) == (
            "examined 5 deliveries (3 events): 0 ok, 0 already here, 0 not matched, "
            "0 refused, 3 in flight, 0 redelivered, 0 failed"
        )
        assert "in flight  g-pending  push  -  " in second.stdout
        assert "redelivery asked for in the last 10 min" in second.stdout
        assert slow.redelivered == [stale.id, pending.id]
        held = db.ttl("realm:{recover:github}:repos:octo-org:shop-api:hooks:7:g-pending")
        assert 590 <= held <= 600


def test_include_delivered_finds_an_acknowledged_delivery_that_is_not_here(
    github: GitHubApi, recover: Recover, db: redis.Redis
) -> None:
    # Answered 202 by a node that was lost with its spool: GitHub counts it delivered.
    lost = github.add("g-lost", push("g-lost"), code=202)
    plain = recover(github)
    assert summary(plain).startswith("examined 1 delivery (1 event): 1 ok, ")
    assert github.redelivered == []

    out = recover(github, "--include-delivered")
    assert out.returncode == 0, out.stdout + out.stderr
    assert summary(out).endswith("0 in flight, 1 redelivered, 0 failed")
    assert github.redelivered == [lost.id]
    assert db.zcard(RUNS) == 1


@pytest.mark.parametrize(
    ("hook", "args"),
    [("/orgs/octo-org/hooks/9", ["--org", "octo-org", "--hook", "9"]), ("/app/hook", ["--app"])],
)
def test_an_organisation_hook_and_the_app_hook(
    listener: Listener, recover: Recover, db: redis.Redis, hook: str, args: list[str]
) -> None:
    api = GitHubApi(TOKEN, hook, deliver_to=listener.base_url + "/hooks/github", secret=GIT_SECRET)
    with serve(api):
        missing = api.add("g-1", push("g-1"))
        out = recover(api, *args, hook=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert api.redelivered == [missing.id]
    assert {c.path for c in api.calls} == {
        f"{hook}/deliveries", f"{hook}/deliveries/{missing.id}",
        f"{hook}/deliveries/{missing.id}/attempts",
    }  # fmt: skip
    assert db.zcard(RUNS) == 1


def test_no_token_is_a_usage_error_that_calls_nothing(github: GitHubApi, recover: Recover) -> None:
    out = recover(github, token=None)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == (
        "error: GITHUB_TOKEN is not set: `realm recover github` needs it to call the "
        "sender's API (see docs/recover.md for what it must allow)\n"
    )
    assert github.calls == []


def test_a_token_that_may_read_but_not_redeliver_fails_each_event_saying_so(
    github: GitHubApi, recover: Recover
) -> None:
    missing = github.add("g-1", push("g-1"))
    denied = (403, {}, {"message": "Resource not accessible by personal access token"})
    github.answer_next(lambda: denied, method="POST")
    out = recover(github)
    assert out.returncode == 1
    assert out.stdout.splitlines()[0] == (
        f"failed  g-1  push  -  {iso(missing.delivered_at)}  GitHub answered 403 to POST "
        f"{HOOK}/deliveries/{missing.id}/attempts: Resource not accessible by personal "
        "access token: the token may not read or redeliver the deliveries of hook 7 of "
        "repository octo-org/shop-api"
    )
    assert github.redelivered == []


def test_a_token_with_a_line_break_is_refused_without_showing_it(
    github: GitHubApi, recover: Recover
) -> None:
    out = recover(github, token="ghp_first\nghp_second")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "error: GITHUB_TOKEN holds a character no token has (a space, a line break, "
        "non-ASCII): `realm recover github` needs it to call the sender's API (see "
        "docs/recover.md for what it must allow)\n"
    )
    assert github.calls == []


def test_a_token_github_refuses_is_named_and_never_shown(
    github: GitHubApi, recover: Recover
) -> None:
    github.add("g-1", push("g-1"))
    out = recover(github, token=TOKEN + "-revoked")
    assert out.returncode == 1
    no_secret(out)
    assert "-revoked" not in out.stdout + out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"error: GitHub answered 401 to GET {HOOK}/deliveries: Bad credentials: "
        "GITHUB_TOKEN was not accepted (expired, revoked or mistyped)"
    )
    assert github.redelivered == []


def test_a_hook_github_does_not_know_is_named(github: GitHubApi, recover: Recover) -> None:
    out = recover(github, "--repo", "octo-org/shop-api", "--hook", "8", hook=False)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "error: GitHub answered 404 to GET /repos/octo-org/shop-api/hooks/8/deliveries: "
        "Not Found: no hook 8 of repository octo-org/shop-api, or the token may not see it "
        "(it needs the admin:repo_hook scope or Webhooks read and write; for an "
        "organisation, admin:org_hook)"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ([], "Error: give one of --repo OWNER/REPO, --org ORG or --app (none was given)"),
        (["--repo", "o/r", "--app"], "Error: give one of --repo OWNER/REPO, --org ORG or --app "
         "(got --repo and --app)"),
        (["--app", "--hook", "3"], "Error: --hook: a GitHub App has one webhook; leave --hook "
         "out with --app"),
        (["--repo", "o/r"], "Error: --hook: the webhook's id is required with --repo"),
        (["--repo", "o", "--hook", "3"], "Error: --repo must be OWNER/REPO (got 'o')"),
        (["--app", "--since", "yesterday"], "Error: --since must be an ISO 8601 time like "
         "2026-05-01T12:00:00Z (UTC unless it names an offset) or a duration like 90m, 2h or "
         "3d, meaning that long ago (got 'yesterday')"),
        (["--app", "--path", "/hooks/plain"], "Error: --path: no trigger of path /hooks/plain "
         "uses verify scheme 'github' (paths with such triggers: /hooks/github)"),
    ],
)  # fmt: skip
def test_usage_errors_say_what_was_wrong(
    github: GitHubApi, recover: Recover, args: list[str], error: str
) -> None:
    out = recover(github, *args, hook=False)
    assert (out.returncode, out.stderr) == (2, error + "\n")
    assert github.calls == []


def test_an_api_url_that_would_send_the_token_in_clear_is_refused(
    github: GitHubApi, recover: Recover
) -> None:
    out = recover(github, "--api-url", "http://github.example.com/api/v3")
    assert out.returncode == 2
    assert out.stderr == (
        "Error: --api-url must be https:// (the token goes with every request); http:// "
        "only to this machine (got 'http://github.example.com/api/v3')\n"
    )


def test_several_github_paths_must_be_chosen_between(
    github: GitHubApi, recover: Recover, tmp_path: Path
) -> None:
    config = tmp_path / "triggers.yaml"
    config.write_text(CONFIG.replace("path: /hooks/plain\n    verify: {scheme: token, header: "
                                     "X-Token, secret_env: GIT_SECRET}",
                                     "path: /hooks/other\n    verify: {scheme: github, "
                                     "secret_env: GIT_SECRET}"))  # fmt: skip
    out = recover(github, "--config", str(config))
    assert (out.returncode, out.stderr) == (
        2,
        "Error: --path: several paths have triggers of verify scheme 'github' "
        "(/hooks/github, /hooks/other): choose one with --path\n",
    )


def test_a_store_that_stops_answering_fails_the_events_it_could_not_check(
    listener: Listener, start_redis: Callable[..., RedisServer]
) -> None:
    server = start_redis()
    api = GitHubApi(TOKEN, HOOK)
    with serve(api):
        first, second = api.add("g-1", push("g-1"), ago=200), api.add("g-2", push("g-2"), ago=100)
        # Redis goes away as the first event's record is read, before its dry run.
        api.on_call = lambda call: server.kill() if call.path.endswith(str(first.id)) else None
        out = Recover(listener, server.url)(api)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        f"failed  g-1  push  -  {iso(first.delivered_at)}  push: STORE_UNAVAILABLE: "
    ), lines[0]
    assert lines[1].startswith(f"failed  g-2  push  -  {iso(second.delivered_at)}  "), lines[1]
    assert lines[2] == (
        "examined 2 deliveries (2 events): 0 ok, 0 already here, 0 not matched, 0 refused, "
        "0 in flight, 0 redelivered, 2 failed"
    )
    assert api.redelivered == []


@pytest.mark.parametrize(
    ("status", "headers", "said", "before", "wait"),
    [
        (403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "+10"}, "", 0, 11.0),
        (429, {"Retry-After": "7"}, "", 0, 7.0),
        (403, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, "", 0, 0.0),
        (403, {}, "You have exceeded a secondary rate limit", 0, 60.0),
        (429, {}, "", 3, 8.0),
        (429, {"Retry-After": "1", "Stripe-Should-Retry": "false"}, "", 0, None),
        (403, {}, "Resource not accessible by personal access token", 0, None),
        (503, {"Retry-After": "1"}, "", 0, None),
    ],
)
def test_rate_limit_replies_are_read_as_each_sender_documents(
    status: int, headers: dict[str, str], said: str, before: int, wait: float | None
) -> None:
    from gateway.recover.http import rate_limit_wait

    if headers.get("x-ratelimit-reset") == "+10":
        headers = {**headers, "x-ratelimit-reset": str(time.time() + 10)}
    got = rate_limit_wait(httpx.Response(status, headers=headers), said, before)
    assert got == wait if wait is None or got is None else abs(got - wait) < 0.5
