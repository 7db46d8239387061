"""Redis under Sentinel: ``redis+sentinel://`` URLs, and a gateway that follows a
promoted primary without a restart (README "Which Redis").

The URL checks need no server. The others run a real primary, its replica and
3 sentinels (tests/sentinel.py, one deployment per module), real `realm`
processes, and ``kill -9`` the primary.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from redis import exceptions as redis_errors

from gateway.link.connection import BadRedisUrl, check_redis_url, redact_url
from gateway.link.sentinel import FollowingPipeline, SentinelUrl, parse_sentinel_url
from tests.conftest import WORKFLOWS_YAML
from tests.exactly_once import CONFIG as HOOK_CONFIG
from tests.exactly_once import ENV as HOOK_ENV
from tests.exactly_once import make_events
from tests.listener import Listener
from tests.sentinel import PASSWORD, SENTINEL_PASSWORD, SentinelDeployment
from tests.test_cli import UUID, realm

TOKEN = "sentinel-api-token-51d0c3"

# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("url", "parts"),
    [
        (
            "redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster",
            SentinelUrl((("10.0.0.1", 26379), ("10.0.0.2", 26380)), "mymaster", password="pw"),
        ),
        (  # `password@` alone is a password; the port defaults to Sentinel's
            "redis+sentinel://s%40cret@sentinel-a,sentinel-b:1/svc/3",
            SentinelUrl((("sentinel-a", 26379), ("sentinel-b", 1)), "svc", 3, password="s@cret"),
        ),
        (
            "redis+sentinel://app:pw@[::1]:5000/svc?sentinel_password=sp&sentinel_username=su",
            SentinelUrl((("::1", 5000),), "svc", 0, "app", "pw", "su", "sp"),
        ),
        ("REDIS+SENTINEL://h:1/svc", SentinelUrl((("h", 1),), "svc")),
    ],
)
def test_sentinel_url_parts(url: str, parts: SentinelUrl) -> None:
    assert parse_sentinel_url(url) == parts
    assert check_redis_url(url) == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://:pw@h:1", "the service name is missing"),
        ("redis+sentinel://:pw@h:1/", "the service name is missing"),
        ("redis+sentinel://:pw@h:1/svc/x", "the path must be /<service> or /<service>/<db number>"),
        ("redis+sentinel://:pw@h:1/svc/0/1", "the path must be /<service>"),
        (
            "redis+sentinel://:pw@h:99999/svc",
            "sentinel address 'h:99999': the port must be 1-65535",
        ),
        ("redis+sentinel://:pw@h:1,,h:2/svc", "a sentinel address is empty"),
        ("redis+sentinel://:pw@:1/svc", "sentinel address ':1' has no host"),
        ("redis+sentinel://:pw@h:1/svc?password=pw", "unknown option 'password'; allowed:"),
    ],
)
def test_a_bad_sentinel_url_is_one_line_without_its_password(url: str, says: str) -> None:
    with pytest.raises(BadRedisUrl) as caught:
        check_redis_url(url)
    message = str(caught.value)
    assert "is not a usable Sentinel URL: " + says in message
    assert "\n" not in message and "pw" not in message.replace("://:***", "")


def test_both_passwords_are_redacted() -> None:
    assert redact_url("redis+sentinel://:d@h:1,h:2/svc/0?sentinel_password=s") == (
        "redis+sentinel://:***@h:1,h:2/svc/0?sentinel_password=***"
    )
    assert redact_url("redis+sentinel://data-pw@h:1/svc") == "redis+sentinel://***@h:1/svc"
    assert redact_url("redis+sentinel://u:d@h/svc") == "redis+sentinel://u:***@h/svc"


def test_cli_refuses_a_bad_sentinel_url_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    done = realm("run", "start", "sync", "--redis-url", "redis+sentinel://:hush@h:1", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: --redis-url: 'redis+sentinel://:***@h:1' is not a usable Sentinel URL: "
        "the service name is missing: redis+sentinel://host:port/<service>"
    )
    assert "hush" not in done.stderr + done.stdout


# --------------------------------------------------------------------------- failover


def _started_run(stdout: str) -> str:
    match = re.search(rf"^run_id: ({UUID})$", stdout, re.M)
    assert match, stdout
    return match.group(1)


@pytest.mark.slow
def test_cli_start_works_before_and_after_a_failover(
    tmp_path: Path, sentinel: SentinelDeployment, sentinel_db: redis_sync.Redis
) -> None:
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    url = sentinel.url()

    def start(key: str) -> subprocess.CompletedProcess[str]:
        return realm("run", "start", "sync", "--key", key, "--redis-url", url, cwd=tmp_path)

    first = start("order-1")
    assert first.returncode == 0, first.stderr
    run_id = _started_run(first.stdout)
    assert "deduped: false" in first.stdout
    shown = f"using Redis at redis+sentinel://:***@127.0.0.1:{sentinel.sentinel_ports[0]},"
    assert shown in first.stderr and "sentinel_password=***" in first.stderr
    assert PASSWORD not in first.stderr and SENTINEL_PASSWORD not in first.stderr

    sentinel.wait_until_agreed()  # the run is on the replica too
    old = sentinel.kill_primary()
    sentinel.wait_for_promotion(old.port)

    again = start("order-1")  # on the promoted replica: the same run, deduplicated
    assert again.returncode == 0, again.stderr
    assert _started_run(again.stdout) == run_id and "deduped: true" in again.stdout
    other = start("order-2")
    assert other.returncode == 0 and "deduped: false" in other.stdout
    with sentinel.client() as primary:
        assert primary.hget(f"realm:{{sync}}:run:{run_id}", "phase") == "running"


def _until_2xx(send, timeout: float) -> tuple[httpx.Response, list[int]]:
    """Send until a 2xx (as a webhook sender retries): the reply and the statuses
    before it."""
    deadline = time.monotonic() + timeout
    statuses: list[int] = []
    while True:
        reply = send()
        if reply.is_success or time.monotonic() > deadline:
            return reply, statuses
        statuses.append(reply.status_code)
        time.sleep(0.05)


@pytest.mark.slow
def test_listener_follows_a_promoted_primary_without_restart(
    tmp_path: Path, sentinel: SentinelDeployment, sentinel_db: redis_sync.Redis
) -> None:
    """Webhooks (the listener's pipelined connection) and the admin API (redis-py's
    Sentinel client) both reach the promoted replica; nothing is restarted."""
    listener = Listener(
        tmp_path, HOOK_CONFIG, redis_url=sentinel.url(),
        env={**HOOK_ENV, "REALM_API_TOKEN": TOKEN}, workers=1,
    ).start()  # fmt: skip
    events = make_events(3, seed=10)
    params = {"repo": "o/r", "sha": "a" * 40}
    try:
        assert listener.process is not None
        pid = listener.process.pid
        with httpx.Client(base_url=listener.base_url, timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as http:  # fmt: skip

            def hook(n: int) -> httpx.Response:
                e = events[n]
                return http.post(e.path, content=e.body, headers=dict(e.headers))

            def api(key: str) -> httpx.Response:
                return http.post("/v1/workflows/deploy/runs",
                                 json={"idempotency_key": key, "params": params})  # fmt: skip

            before_hook, before_api = hook(0), api("k-before")
            assert (before_hook.status_code, before_api.status_code) == (202, 202)
            assert http.get("/readyz").status_code == 200

            sentinel.wait_until_agreed()  # both runs are on the replica too
            old = sentinel.kill_primary()
            promoted_in = sentinel.wait_for_promotion(old.port)

            t0 = time.monotonic()
            after_hook, hook_503s = _until_2xx(lambda: hook(1), timeout=15)
            after_api, api_503s = _until_2xx(lambda: api("k-after"), timeout=15)
            followed_in = time.monotonic() - t0
            assert (after_hook.status_code, after_api.status_code) == (202, 202)
            # Until it found the new primary it said "retry", never anything else.
            assert set(hook_503s + api_503s) <= {503}

            # What was acknowledged before the failover is on the new primary: repeats
            # are deduplicated onto the same runs.
            repeat_hook, repeat_api = hook(0), api("k-before")
            assert repeat_hook.status_code == 200 and repeat_api.status_code == 200
            assert (
                repeat_hook.json()["results"][0]["run_id"]
                == (before_hook.json()["results"][0]["run_id"])
            )
            assert repeat_api.json()["run_id"] == before_api.json()["run_id"]
            assert http.get("/readyz").status_code == 200
        assert listener.process.pid == pid and listener.process.poll() is None
    finally:
        listener.stop()
    print(
        f"\nFIGURES sentinel-follow: promoted_s={promoted_in:.2f} followed_s={followed_in:.2f} "
        f"hook_503s={len(hook_503s)} api_503s={len(api_503s)}"
    )


async def test_a_demoted_primary_is_left_for_the_one_the_sentinels_name(start_redis) -> None:
    """The listener's connection under Sentinel: a READONLY reply (its server was
    demoted while the connection stayed open) fails that call, and the next call
    asks the resolver again and goes to the new primary. The resolver here is the
    test's own: it names first the replica (as sentinels would name a primary
    just before it was demoted), then the primary."""
    primary = start_redis()
    replica = start_redis("--replicaof", "127.0.0.1", str(primary.port))
    named = [replica.port]
    asked: list[int] = []

    async def resolve() -> dict[str, object]:
        asked.append(named[0])
        return {"host": "127.0.0.1", "port": named[0]}

    pipeline = FollowingPipeline({}, timeout=2.0, connect_timeout=2.0, resolver=resolve)
    try:
        with pytest.raises(redis_errors.ReadOnlyError):
            await pipeline.execute("SET", "k", "v")
        named[0] = primary.port
        assert await pipeline.execute("SET", "k", "v") == b"OK"
        assert await pipeline.execute("GET", "k") == b"v"
    finally:
        pipeline.close()
    assert asked == [replica.port, primary.port]  # one connection each, no more
    with redis_sync.Redis(port=primary.port) as db:
        assert db.get("k") == b"v"
