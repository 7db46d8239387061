"""Ingress limits (``settings.ingress``): per webhook path, a rate and a burst, counted in
Redis (GCRA) before a delivery's body is read; past it, 429 ``RATE_LIMITED_INGRESS``
with ``Retry-After``.

Real `realm listen` processes (tests/listener.py) and real redis-server processes of the
tests' own, over real HTTP: exactly the burst admitted out of a concurrent flood (an
unlimited path beside it untouched, a bad signature never checked), one limit shared by
two listeners on one Redis, a sender that waits the Retry-After it was given getting
through, a limit added by a hot reload, and a Redis that does not answer the check
letting the delivery through to its usual outcome (spool or 503), never a 500.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from gateway.loading import parse_config
from gateway.model.config import IngressLimit
from gateway.model.errors import ConfigError
from gateway.store.ingress import ingress_key
from tests.listener import Listener, spool_off
from tests.servers import RedisServer

TOKEN = "tok-ingress-5e2a9c7b1d3f4086"
ENV = {"REALM_TRIGGER_TOKEN": TOKEN}
BURST = 5

TRIGGERS = """
version: 1
workflows:
  sink: {steps: [go]}
triggers:
""" + "".join(
    f"""  {name}:
    workflow: sink
    path: /hooks/{name}
    verify: {{scheme: token, header: X-Realm-Token, secret_env: REALM_TRIGGER_TOKEN}}
    event_id: {{header: Idempotency-Key}}
"""
    for name in ("limited", "paced", "open")
)
# /hooks/limited refills one delivery an hour: within a test, exactly its burst passes.
# /hooks/paced refills one every 500 ms: a wait of its Retry-After is a short real wait.
CONFIG = (
    TRIGGERS
    + f"""settings:
  ingress:
    /hooks/limited: {{rate: 1/h, burst: {BURST}}}
    /hooks/paced: {{rate: 2/s, burst: 1}}
"""
)


def headers(token: str = TOKEN) -> dict[str, str]:
    """A delivery of its own (a new event id, so each admitted one starts a run)."""
    return {"X-Realm-Token": token, "Idempotency-Key": uuid.uuid4().hex,
            "Content-Type": "application/json"}  # fmt: skip


def wait_until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def metric_lines(listener: Listener, name: str) -> dict[str, float]:
    """``name``'s samples on /metrics, by their label text."""
    text = httpx.get(f"{listener.base_url}/metrics", timeout=5).text
    return {
        line.rsplit(" ", 1)[0].removeprefix(name): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    }


def log_events(listener: Listener, event: str) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for line in listener.log().splitlines()
        if line.startswith(f'{{"event":"{event}"')
    ]


def assert_rate_limited(reply: httpx.Response, path: str, rate: str, burst: int) -> int:
    """``reply`` is the ingress 429, in the shape of every error reply; its Retry-After."""
    assert reply.status_code == 429, reply.text
    retry_after = reply.headers["Retry-After"]
    assert retry_after.isdigit() and int(retry_after) >= 1, retry_after
    body = reply.json()
    assert set(body) == {"status", "code", "message"}, body
    assert (body["status"], body["code"]) == ("error", "RATE_LIMITED_INGRESS")
    assert f"deliveries to {path} are limited to" in body["message"]
    assert f"(rate {rate}, burst {burst}); retry after {retry_after} s" in body["message"]
    return int(retry_after)


async def post_all(base_url: str, path: str, n: int, token: str = TOKEN) -> list[httpx.Response]:
    """``n`` deliveries to ``path`` at once, each on its own connection."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base_url, timeout=20, limits=limits) as client:
        return await asyncio.gather(
            *(client.post(path, content=b'{"n":%d}' % i, headers=headers(token)) for i in range(n))
        )


@pytest.fixture(scope="module")
def gateway(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    listener = Listener(
        tmp_path_factory.mktemp("ingress"), CONFIG, redis_url=module_redis.url, env=ENV
    ).start()
    yield listener
    listener.stop()


# --------------------------------------------------------------------------- the file


def refusal(settings: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(TRIGGERS + "settings:\n" + settings, env=ENV)
    return str(caught.value)


RATE_FORMS = (
    "must be a count per second, minute or hour like '50/s', '600/m' or '1000/h', the "
    "count from 1 to 1000000"
)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ("  ingress: {/hooks/limited: {rate: 50 per second}}\n",
         f"triggers.yaml: settings: field 'ingress./hooks/limited.rate': {RATE_FORMS} "
         "(got '50 per second')"),
        ("  ingress: {/hooks/limited: {rate: 50/d}}\n",
         f"triggers.yaml: settings: field 'ingress./hooks/limited.rate': {RATE_FORMS} "
         "(got '50/d')"),
        ("  ingress: {/hooks/limited: {rate: 0/s}}\n",
         f"triggers.yaml: settings: field 'ingress./hooks/limited.rate': {RATE_FORMS} "
         "(got '0/s')"),
        ("  ingress: {/hooks/limited: {rate: 1000001/s}}\n",
         f"triggers.yaml: settings: field 'ingress./hooks/limited.rate': {RATE_FORMS} "
         "(got '1000001/s')"),
        ("  ingress: {/hooks/limited: {burst: 3}}\n",
         f"triggers.yaml: settings: field 'ingress./hooks/limited.rate': {RATE_FORMS} "
         "(missing)"),
        ("  ingress: {/hooks/limited: {rate: 5/s, burst: 0}}\n",
         "triggers.yaml: settings: field 'ingress./hooks/limited.burst': must be a whole "
         "number from 1 to 1000000 (got 0)"),
        ("  ingress: {/hooks/limited: {rate: 5/s, burst: 2.5}}\n",
         "triggers.yaml: settings: field 'ingress./hooks/limited.burst': must be a whole "
         "number from 1 to 1000000 (got 2.5)"),
        ("  ingress: {/hooks/limited: {rate: 5/s, burst: true}}\n",
         "triggers.yaml: settings: field 'ingress./hooks/limited.burst': must be a whole "
         "number from 1 to 1000000 (got True)"),
        ("  ingress: {/hooks/limited: {rate: 5/s, brust: 2}}\n",
         "triggers.yaml: settings: field 'ingress./hooks/limited.brust': unknown field (did "
         "you mean 'burst'?); allowed fields: burst, rate"),
        ("  ingress: {/hooks/limited: 5/s}\n",
         "triggers.yaml: settings: field 'ingress./hooks/limited': must be a mapping like "
         "{rate: 50/s, burst: 100} (got '5/s')"),
        ("  ingress: {hooks/limited: {rate: 5/s}}\n",
         "triggers.yaml: settings: field 'ingress.hooks/limited': must be a webhook path "
         "starting with '/' (a trigger's path)"),
        ("  ingress: [/hooks/limited]\n",
         "triggers.yaml: settings: field 'ingress': must be a mapping of webhook path to "
         "{rate: 50/s, burst: 100} (got ['/hooks/limited'])"),
        # A path no trigger serves: most likely a typo that leaves the real one open.
        ("  ingress: {/hooks/limted: {rate: 5/s}}\n",
         "triggers.yaml: settings: field 'ingress./hooks/limted': no trigger serves "
         "/hooks/limted (did you mean '/hooks/limited'?); the triggers' paths: "
         "/hooks/limited, /hooks/open, /hooks/paced"),
    ],
)  # fmt: skip
def test_a_bad_ingress_setting_names_its_field(settings: str, message: str) -> None:
    assert refusal(settings) == message


def test_ingress_settings_parse_with_burst_defaulting_to_the_rates_count() -> None:
    text = TRIGGERS + (
        "settings:\n  ingress:\n    /hooks/limited: {rate: 50/s, burst: 100}\n"
        "    /hooks/paced: {rate: 600/m}\n    /hooks/open: {rate: 1000/h, burst: 1}\n"
    )
    ingress = parse_config(text, env=ENV).settings.ingress
    assert ingress == {
        "/hooks/limited": IngressLimit(count=50, period_ms=1_000, burst=100),
        "/hooks/paced": IngressLimit(count=600, period_ms=60_000, burst=600),
        "/hooks/open": IngressLimit(count=1000, period_ms=3_600_000, burst=1),
    }
    assert [limit.interval_us for limit in ingress.values()] == [20_000, 100_000, 3_600_000]
    assert ingress["/hooks/paced"].rate == "600/m"
    # 3/s does not divide a second in whole µs: rounded up, never more than 3 a second.
    assert IngressLimit(count=3, period_ms=1_000, burst=1).interval_us == 333_334
    # None, absent or empty: no limit anywhere; commands that load no triggers skip the
    # path check (they serve no path).
    assert parse_config(TRIGGERS + "settings: {ingress: }\n", env=ENV).settings.ingress == {}
    assert parse_config(TRIGGERS, env=ENV).settings.ingress == {}
    workflows_only = TRIGGERS + "settings: {ingress: {/hooks/gone: {rate: 1/s}}}\n"
    assert parse_config(workflows_only, with_triggers=False).settings.ingress == {
        "/hooks/gone": IngressLimit(count=1, period_ms=1_000, burst=1)
    }


# --------------------------------------------------------------------------- one listener


async def test_a_flood_gets_exactly_the_burst_and_429s_for_the_rest(
    gateway: Listener, db: redis_sync.Redis
) -> None:
    extra = 4
    label = '{path="/hooks/limited",status="429"}'
    before = metric_lines(gateway, "realm_deliveries_total").get(label, 0)
    replies = await post_all(gateway.base_url, "/hooks/limited", BURST + extra)
    statuses = Counter(r.status_code for r in replies)
    assert statuses == {202: BURST, 429: extra}, [r.text for r in replies]
    for reply in replies:
        if reply.status_code == 202:
            assert reply.json()["results"][0]["outcome"] == "started"
        else:
            # 1/h: the next delivery fits in an hour, less the time the flood took.
            assert 3590 <= assert_rate_limited(reply, "/hooks/limited", "1/h", BURST) <= 3600
    # The limit is checked before the body is read or verified: a wrong token gets the
    # 429 too, not a 401 (no HMAC, no compare is spent on a flood).
    [forged] = await post_all(gateway.base_url, "/hooks/limited", 1, token="not-the-token")
    assert_rate_limited(forged, "/hooks/limited", "1/h", BURST)
    # A path without a limit on the same listener is untouched.
    opened = await post_all(gateway.base_url, "/hooks/open", BURST + extra)
    assert Counter(r.status_code for r in opened) == {202: BURST + extra}
    # One key for the limited path, under the prefix, with the path as its hash tag; it
    # expires once the path would be idle again (here: in about BURST hours).
    assert db.keys("realm:ingress:*") == [ingress_key("realm", "/hooks/limited")]
    assert 0 < db.pttl("realm:ingress:{/hooks/limited}") <= BURST * 3_600_000
    # In /metrics and the delivery log like the other early refusals (a 413, a 503).
    assert metric_lines(gateway, "realm_deliveries_total")[label] - before == extra + 1
    refused = "realm:{deliveries:log}:refused"
    wait_until("the 429s in the delivery log", lambda: db.zcard(refused) == extra + 1)
    wait_until(
        "the 429s in the listener's log",
        lambda: sum(
            1 for line in log_events(gateway, "delivery")
            if line["status"] == 429 and line.get("code") == "RATE_LIMITED_INGRESS"
        ) >= extra + 1,
    )  # fmt: skip


def test_a_sender_that_honours_retry_after_gets_through(
    gateway: Listener, db: redis_sync.Redis
) -> None:
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        first = client.post("/hooks/paced", content=b"{}", headers=headers())
        assert first.status_code == 202, first.text
        delivery = headers()
        again = client.post("/hooks/paced", content=b"{}", headers=delivery)
        retry_after = assert_rate_limited(again, "/hooks/paced", "2/s", 1)
        assert retry_after == 1  # 500 ms to wait, said in whole seconds, rounded up
        time.sleep(retry_after)  # the sender waits what it was told, no more
        later = client.post("/hooks/paced", content=b"{}", headers=delivery)
        assert later.status_code == 202, later.text
        assert later.json()["results"][0]["outcome"] == "started"


def test_a_reload_applies_a_new_ingress_limit(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    listener = Listener(tmp_path, TRIGGERS, redis_url=module_redis.url, env=ENV).start()
    try:
        url = f"{listener.base_url}/hooks/open"
        assert httpx.post(url, content=b"{}", headers=headers(), timeout=10).status_code == 202
        listener.config_path.write_text(
            TRIGGERS + "settings: {ingress: {/hooks/open: {rate: 1/h, burst: 1}}}\n"
        )
        assert listener.process is not None
        os.kill(listener.process.pid, signal.SIGHUP)
        wait_until(
            "the reload to apply",
            lambda: any(x["result"] == "applied" for x in log_events(listener, "config_reload")),
        )
        statuses = [
            httpx.post(url, content=b"{}", headers=headers(), timeout=10).status_code
            for _ in range(3)
        ]
        assert statuses == [202, 429, 429]
    finally:
        listener.stop()


# --------------------------------------------------------------------------- two listeners


@pytest.mark.slow
async def test_two_listeners_on_one_redis_share_the_limit(
    tmp_path: Path, start_redis: Callable[..., RedisServer]
) -> None:
    """Each listener alone would let a burst through; together they let one through."""
    server = start_redis()
    listeners: list[Listener] = []
    try:
        for i in range(2):
            (tmp_path / f"l{i}").mkdir()
            listener = Listener(tmp_path / f"l{i}", CONFIG, redis_url=server.url, env=ENV)
            listeners.append(listener.start())
        each = 2 * BURST
        replies = await asyncio.gather(
            *(post_all(listener.base_url, "/hooks/limited", each) for listener in listeners)
        )
        per_listener = [Counter(r.status_code for r in rs) for rs in replies]
        assert sum(per_listener, Counter()) == {202: BURST, 429: 2 * each - BURST}, per_listener
        for reply in (r for rs in replies for r in rs if r.status_code == 429):
            assert_rate_limited(reply, "/hooks/limited", "1/h", BURST)
    finally:
        for listener in listeners:
            listener.stop()


# --------------------------------------------------------------------------- Redis not answering


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.parametrize(
    ("fault", "spool"), [("kill", True), ("pause", False)], ids=["killed-spool", "paused-no-spool"]
)
def test_a_redis_that_does_not_answer_lets_the_delivery_through(
    tmp_path: Path, start_redis: Callable[..., RedisServer], fault: str, spool: bool
) -> None:
    """Fail open: a killed Redis refuses the check at once, a paused one answers it too
    late; either way the delivery goes on to the claim, which keeps it in the spool
    (202 accepted) or answers 503 as it does with no limit, never a 429 or a 500."""
    server = start_redis()
    text = CONFIG.replace("settings:\n", "settings:\n  redis_timeout: 1\n")
    listener = Listener(
        tmp_path, text if spool else spool_off(text), redis_url=server.url, env=ENV
    ).start()
    url = f"{listener.base_url}/hooks/limited"
    try:
        assert httpx.post(url, content=b"{}", headers=headers(), timeout=10).status_code == 202
        server.kill() if fault == "kill" else server.pause()
        replies = [httpx.post(url, content=b"{}", headers=headers(), timeout=10) for _ in range(2)]
        for reply in replies:
            if spool:
                assert reply.status_code == 202, reply.text
                assert reply.json()["outcome"] == "accepted"
            else:
                assert reply.status_code == 503, reply.text
                assert reply.json()["code"] == "STORE_UNAVAILABLE"
                # The check's own bound (0.5 s) passed, then the claim's redis_timeout.
                assert "did not answer within 1 s" in reply.json()["message"]
        assert metric_lines(listener, "realm_ingress_unchecked_total") == {
            '{path="/hooks/limited"}': 2.0
        }
        # One line when the outage starts, not one per delivery.
        wait_until("the ingress warning", lambda: len(log_events(listener, "ingress")) == 1)
        [failing] = log_events(listener, "ingress")
        assert (failing["state"], failing["path"]) == ("failing", "/hooks/limited")
        assert failing["error"] == (
            "StoreUnavailable" if fault == "kill" else "no answer within 0.5 s"
        )
        if fault == "pause":
            server.resume()
            # Checked again once Redis answers, and said so once.
            reply = httpx.post(url, content=b"{}", headers=headers(), timeout=10)
            assert reply.status_code == 202, reply.text
            wait_until("the recovery line", lambda: len(log_events(listener, "ingress")) == 2)
            recovered = log_events(listener, "ingress")[1]
            assert (recovered["state"], recovered["unchecked"]) == ("recovered", 2)
    finally:
        if fault == "pause" and server.process is not None:
            server.resume()
        listener.stop()
