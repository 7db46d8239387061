"""The inspector's sessions over real HTTP, against real `realm listen` processes: a
logout ends the session in every worker at once (its cookie and CSRF value stop
working), login attempts are limited per client, and the cookie is ``Secure`` when a
trusted proxy says the browser came over HTTPS (``settings.trusted_proxies``)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
import redis as redis_sync

from gateway.faces.ui.auth import LOGIN_ATTEMPTS, LOGIN_WINDOW_SECONDS
from gateway.loading import parse_config
from gateway.model.errors import ConfigError
from tests.inspector_scaffold import CONFIG, ENV, TOKEN
from tests.listener import Listener
from tests.servers import RedisServer

CSRF = re.compile(r'name="csrf" value="([0-9a-f]{64})"')


def with_settings(settings: str) -> str:
    return CONFIG.replace("version: 1\n", f"version: 1\nsettings: {settings}\n", 1)


@pytest.fixture(scope="module")
def behind_proxy(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    """Two workers that trust the loopback address as their TLS proxy."""
    listener = Listener(
        tmp_path_factory.mktemp("ui-proxy"),
        with_settings("{trusted_proxies: [127.0.0.1, '10.0.0.0/8']}"),
        redis_url=module_redis.url,
        env=ENV,
        workers=2,
    ).start()
    yield listener
    listener.stop()


@pytest.fixture(scope="module")
def direct(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    """One worker that trusts a proxy elsewhere: the loopback's forwarded headers are
    anyone's words."""
    listener = Listener(
        tmp_path_factory.mktemp("ui-direct"),
        with_settings("{trusted_proxies: [192.0.2.7]}"),
        redis_url=module_redis.url,
        env=ENV,
    ).start()
    yield listener
    listener.stop()


def login(client: httpx.Client, **headers: str) -> httpx.Response:
    reply = client.post("/ui/login", data={"token": TOKEN, "next": "/ui"}, headers=headers)
    assert (reply.status_code, reply.headers["location"]) == (303, "/ui"), reply.text
    return reply


def cookie_attributes(reply: httpx.Response) -> set[str]:
    return {part.strip().lower() for part in reply.headers["set-cookie"].split(";")[1:]}


def test_logout_ends_the_session_in_every_worker(behind_proxy: Listener, db: redis_sync.Redis):
    base = behind_proxy.base_url
    with (
        httpx.Client(base_url=base, timeout=10) as browser,
        httpx.Client(base_url=base, timeout=10) as other_browser,
    ):
        login(browser)
        login(other_browser)
        session = browser.cookies["realm_ui"]
        run_id = browser.post(
            "/v1/workflows/sync/runs", headers={"Authorization": f"Bearer {TOKEN}"}, json={}
        ).json()["run_id"]
        page = browser.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200
        csrf = CSRF.search(page.text).group(1)  # type: ignore[union-attr]

        out = browser.post("/ui/logout", data={"csrf": csrf})
        assert (out.status_code, out.headers["location"]) == (303, "/ui/login?notice=logged-out")

        # The cookie kept by someone else, sent on fresh connections (either worker).
        for _ in range(12):
            with httpx.Client(base_url=base, timeout=10, cookies={"realm_ui": session}) as copy:
                reply = copy.get("/ui")
                assert (reply.status_code, reply.headers["location"]) == (
                    303,
                    "/ui/login?next=%2Fui",
                )
                refused = copy.post(f"/ui/runs/{run_id}/cancel", data={"csrf": csrf})
                assert refused.status_code == 403
                assert "You are not logged in (or your session ended)" in refused.text
        run = browser.get(f"/v1/runs/{run_id}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert run.json()["phase"] == "running"
        # Only that session ended: another browser's goes on.
        assert other_browser.get("/ui").status_code == 200


def test_login_attempts_are_limited_per_client(behind_proxy: Listener, db: redis_sync.Redis):
    with httpx.Client(base_url=behind_proxy.base_url, timeout=10) as client:
        mallory = {"X-Forwarded-For": "203.0.113.9"}
        for _ in range(LOGIN_ATTEMPTS):
            wrong = client.post("/ui/login", data={"token": "guess"}, headers=mallory)
            assert wrong.status_code == 401
        # Past the limit even the right token is not looked at.
        limited = client.post("/ui/login", data={"token": TOKEN}, headers=mallory)
        assert limited.status_code == 429
        wait = int(limited.headers["retry-after"])
        assert 1 <= wait <= LOGIN_WINDOW_SECONDS
        assert (
            "Too many login attempts from your address (10 a minute at most): "
            f"try again in {wait} s."
        ) in limited.text
        assert "set-cookie" not in limited.headers
        # The window is bounded: the count expires with it.
        (key,) = db.scan_iter("*{ui:logins}*")
        assert key.endswith(":203.0.113.9") and 0 < db.ttl(key) <= LOGIN_WINDOW_SECONDS
        # Another client behind the same proxy still logs in.
        login(client, **{"X-Forwarded-For": "203.0.113.9, 198.51.100.4"})
    assert "Traceback" not in behind_proxy.log()


def test_forwarded_headers_of_an_untrusted_peer_are_ignored(direct: Listener, db: redis_sync.Redis):
    with httpx.Client(base_url=direct.base_url, timeout=10) as client:
        # Each attempt claims another address: all count against the peer's.
        for i in range(LOGIN_ATTEMPTS):
            client.post(
                "/ui/login", data={"token": "guess"}, headers={"X-Forwarded-For": f"1.2.3.{i}"}
            )
        limited = client.post(
            "/ui/login", data={"token": TOKEN}, headers={"X-Forwarded-For": "9.9.9.9"}
        )
        assert limited.status_code == 429
        db.flushall()
        # And a claim of HTTPS makes no Secure cookie.
        reply = login(client, **{"X-Forwarded-Proto": "https"})
        assert "secure" not in cookie_attributes(reply)


def test_the_cookie_is_secure_behind_a_trusted_tls_proxy(
    behind_proxy: Listener, db: redis_sync.Redis
):
    with httpx.Client(base_url=behind_proxy.base_url, timeout=10) as client:
        plain = login(client)
        assert "secure" not in cookie_attributes(plain)
        tls = {"X-Forwarded-Proto": "https"}
        secure = login(client, **tls)
        assert cookie_attributes(secure) == {
            "httponly", "max-age=43200", "path=/ui", "samesite=strict", "secure",
        }  # fmt: skip
        # (httpx keeps a Secure cookie off plain HTTP, as a browser would: sent by hand.)
        value = re.match(r"realm_ui=([^;]+);", secure.headers["set-cookie"]).group(1)  # type: ignore[union-attr]
        by_hand = {**tls, "Cookie": f"realm_ui={value}"}
        client.cookies.clear()
        csrf = CSRF.search(client.get("/ui", headers=by_hand).text).group(1)  # type: ignore[union-attr]
        out = client.post("/ui/logout", data={"csrf": csrf}, headers=by_hand)
        assert out.headers["location"] == "/ui/login?notice=logged-out"
        assert "secure" in cookie_attributes(out) and "max-age=0" in cookie_attributes(out)


def test_a_bad_trusted_proxy_is_a_config_error():
    for value, field, got in (
        ("[10.0.0.300]", "trusted_proxies[0]", "'10.0.0.300'"),
        ("[10.0.0.0/8, 5]", "trusted_proxies[1]", "5"),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_config(with_settings(f"{{trusted_proxies: {value}}}"))
        assert str(caught.value) == (
            f"triggers.yaml: settings: field '{field}': must be an IP address like 10.0.0.7 "
            f"or a network like 10.0.0.0/8 (got {got})"
        )
    with pytest.raises(ConfigError) as caught:
        parse_config(with_settings("{trusted_proxies: 127.0.0.1}"))
    assert str(caught.value) == (
        "triggers.yaml: settings: field 'trusted_proxies': must be a list of addresses or "
        "networks (got '127.0.0.1')"
    )
