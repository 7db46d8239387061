"""The inspector page (/ui) over HTTP, against a real `realm listen`: the login and its
cookie, CSRF on every change, escaping of what senders sent, each page's facts, and
the answers to bad input. tests/test_ui_browser.py drives the same pages in Chromium."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from gateway.faces.ui.auth import SESSION_SECONDS, UiAuth
from gateway.faces.ui.routes import SECURITY_HEADERS
from gateway.loading import parse_config
from gateway.model.config import RESERVED_PATHS
from gateway.model.errors import ConfigError
from tests import inspector_scaffold
from tests.conftest import WORKFLOWS_YAML
from tests.inspector_scaffold import CONFIG, ENV, HOOK_SECRET, TOKEN, send
from tests.listener import Listener
from tests.servers import RedisServer

gateway = inspector_scaffold.gateway
api = inspector_scaffold.api
HOSTILE = "<script>alert(1)</script>"
DELIVERY_LINK = re.compile(r'href="/ui/deliveries/(dlv-[0-9a-f]{12}-[0-9a-f]{8})"')
CSRF = re.compile(r'name="csrf" value="([0-9a-f]{64})"')


@pytest.fixture
def ui(gateway: Listener, db: redis_sync.Redis) -> Iterator[httpx.Client]:
    """A logged-in browser's worth of HTTP: the session cookie, no bearer token."""
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        login(client)
        yield client


def login(client: httpx.Client) -> None:
    reply = client.post("/ui/login", data={"token": TOKEN, "next": "/ui"})
    assert (reply.status_code, reply.headers["location"]) == (303, "/ui")


def delivery_ids(client: httpx.Client, count: int, query: str = "") -> list[str]:
    """The ids the list page shows, newest first, once it shows ``count`` (the log is
    written every 100 ms: polled, with a deadline)."""
    deadline = time.monotonic() + 10
    while True:
        page = client.get(f"/ui{query}")
        assert page.status_code == 200, page.text
        ids = DELIVERY_LINK.findall(page.text)
        if len(ids) >= count or time.monotonic() > deadline:
            assert len(ids) == count, ids
            return ids
        time.sleep(0.05)


def csrf_of(page: httpx.Response) -> str:
    match = CSRF.search(page.text)
    assert match, page.text
    return match.group(1)


def h1(page: httpx.Response) -> str:
    match = re.search(r"<h1>(.*?)</h1>", page.text)
    assert match, page.text
    return match.group(1)


def alert(page: httpx.Response) -> str:
    """The text of the page's error box (escaped as it is sent)."""
    match = re.search(r'<p class="error" role="alert">(.*?)</p>', page.text, re.S)
    assert match, page.text
    return match.group(1)


# -- who may look -----------------------------------------------------------------------


def test_without_a_token_the_inspector_is_off(module_redis: RedisServer, tmp_path: Path):
    listener = Listener(
        tmp_path, CONFIG, redis_url=module_redis.url, env={"HOOK_TOKEN": HOOK_SECRET}
    ).start()
    try:
        with httpx.Client(base_url=listener.base_url, timeout=10) as client:
            for method, path in (
                ("GET", "/ui"),
                ("GET", "/ui/login"),
                ("POST", "/ui/login"),
                ("GET", "/ui/runs"),
                ("POST", "/ui/logout"),
            ):
                reply = client.request(
                    method, path, data={"token": ""} if method == "POST" else None
                )
                assert reply.status_code == 403, (method, path)
                assert alert(reply) == (
                    "The inspector is off: set REALM_API_TOKEN in the gateway&#x27;s environment "
                    "to enable it (the same token the /v1 API takes), then log in with it here."
                )
                assert "set-cookie" not in reply.headers
    finally:
        listener.stop()


def test_login_sets_a_cookie_that_is_not_the_token(gateway: Listener, db: redis_sync.Redis):
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        away = client.get("/ui/runs", params={"phase": "running"})
        assert (away.status_code, away.headers["location"]) == (
            303,
            "/ui/login?next=%2Fui%2Fruns%3Fphase%3Drunning",
        )
        form = client.get(away.headers["location"])
        assert form.status_code == 200
        assert '<input type="hidden" name="next" value="/ui/runs?phase=running">' in form.text

        wrong = client.post(
            "/ui/login", data={"token": TOKEN + "x", "next": "/ui/runs?phase=running"}
        )
        assert wrong.status_code == 401
        assert alert(wrong) == "That is not the gateway&#x27;s API token (REALM_API_TOKEN)."
        assert "set-cookie" not in wrong.headers
        assert '<input type="hidden" name="next" value="/ui/runs?phase=running">' in wrong.text

        right = client.post("/ui/login", data={"token": TOKEN, "next": "/ui/runs?phase=running"})
        assert (right.status_code, right.headers["location"]) == (303, "/ui/runs?phase=running")
        cookie = right.headers["set-cookie"]
        value = re.match(r"realm_ui=([^;]+);", cookie).group(1)  # type: ignore[union-attr]
        assert TOKEN not in value and re.fullmatch(r"[0-9]{10}\.[0-9a-f]{32}\.[0-9a-f]{64}", value)
        attributes = {part.strip().lower() for part in cookie.split(";")[1:]}
        assert attributes == {
            "httponly",
            f"max-age={SESSION_SECONDS}",
            "path=/ui",
            "samesite=strict",
        }

        runs = client.get("/ui/runs", params={"phase": "running"})
        assert (runs.status_code, h1(runs)) == (200, "Runs")
        # The cookie opens /ui only: /v1 still wants the bearer token.
        assert client.get("/v1/workflows/sync/runs").status_code == 401


@pytest.mark.parametrize(
    "cookie",
    [
        "9999999999." + "0" * 64,  # made up
        UiAuth("another-token").new_session(),  # signed with another token
        UiAuth(TOKEN).new_session(now=time.time() - SESSION_SECONDS - 1),  # expired
        TOKEN,  # the token itself is not a session
        "",
    ],
    ids=["forged", "other-token", "expired", "the-token", "empty"],
)
def test_a_session_not_ours_is_sent_to_login(gateway: Listener, cookie: str):
    with httpx.Client(
        base_url=gateway.base_url, timeout=10, cookies={"realm_ui": cookie}
    ) as client:
        reply = client.get("/ui")
        assert (reply.status_code, reply.headers["location"]) == (303, "/ui/login?next=%2Fui")


@pytest.mark.parametrize(
    "next_path",
    ["https://evil.example/", "//evil.example/ui", "/ui\\@evil.example", "/v1/runs", "/uix"],
)
def test_login_goes_back_to_the_inspector_only(gateway: Listener, next_path: str):
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        reply = client.post("/ui/login", data={"token": TOKEN, "next": next_path})
        assert (reply.status_code, reply.headers["location"]) == (303, "/ui")


def test_changes_need_the_session_and_its_csrf_value(
    ui: httpx.Client, api: httpx.Client, gateway: Listener
):
    run_id = api.post("/v1/workflows/sync/runs", json={"idempotency_key": "k1"}).json()["run_id"]
    page = ui.get(f"/ui/runs/{run_id}")
    csrf = csrf_of(page)
    assert f'action="/ui/runs/{run_id}/cancel"' in page.text

    for form in ({}, {"csrf": ""}, {"csrf": "0" * 64}, {"csrf": csrf[:-1]}):
        refused = ui.post(f"/ui/runs/{run_id}/cancel", data=form)
        assert refused.status_code == 403
        assert alert(refused) == (
            "The form&#x27;s CSRF value is missing or wrong, so nothing was done: "
            "reload the page and try again."
        )
    # The right value without the cookie (another site's form): refused too.
    with httpx.Client(base_url=gateway.base_url, timeout=10) as stranger:
        refused = stranger.post(f"/ui/runs/{run_id}/cancel", data={"csrf": csrf})
        assert refused.status_code == 403
        assert alert(refused) == (
            "You are not logged in (or your session ended): log in, then try again."
        )
    assert api.get(f"/v1/runs/{run_id}").json()["phase"] == "running"

    done = ui.post(f"/ui/runs/{run_id}/cancel", data={"csrf": csrf})
    assert (done.status_code, done.headers["location"]) == (
        303,
        f"/ui/runs/{run_id}?notice=cancelled",
    )
    assert api.get(f"/v1/runs/{run_id}").json()["phase"] == "cancelled"
    shown = ui.get(done.headers["location"])
    assert '<p class="notice" role="status">The run is cancelled.</p>' in shown.text
    assert '<span id="phase"><span class="badge cancelled">cancelled</span></span>' in shown.text
    assert "/cancel" not in shown.text  # no button for an ended run
    again = ui.post(f"/ui/runs/{run_id}/cancel", data={"csrf": csrf})
    assert again.headers["location"] == f"/ui/runs/{run_id}?notice=not-cancelled"


def test_logout_ends_the_session_in_the_browser(ui: httpx.Client):
    page = ui.get("/ui")
    out = ui.post("/ui/logout", data={"csrf": csrf_of(page)})
    assert (out.status_code, out.headers["location"]) == (303, "/ui/login?notice=logged-out")
    assert out.headers["set-cookie"].startswith('realm_ui=""; ')
    assert "max-age=0" in out.headers["set-cookie"].lower()
    assert ui.get("/ui").status_code == 303
    shown = ui.get("/ui/login?notice=logged-out")
    assert '<p class="notice" role="status">You are logged out.</p>' in shown.text


def test_every_page_forbids_scripts_and_framing(ui: httpx.Client, gateway: Listener):
    with httpx.Client(base_url=gateway.base_url, timeout=10) as anonymous:
        replies = [
            ui.get("/ui"),
            ui.get("/ui/runs"),
            anonymous.get("/ui/login"),
            anonymous.get("/ui"),
            ui.get("/ui/deliveries/dlv-000000000000-00000000"),
        ]
    for reply in replies:
        for name, value in SECURITY_HEADERS.items():
            assert reply.headers[name] == value
    assert SECURITY_HEADERS["Content-Security-Policy"] == (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    )
    css = ui.get("/ui/static/ui.css")
    assert (css.status_code, css.headers["content-type"]) == (200, "text/css; charset=utf-8")
    assert ui.get("/ui/static/app.js").status_code == 404
    assert "<script" not in ui.get("/ui").text


# -- what the pages show ----------------------------------------------------------------


def test_what_senders_sent_is_shown_as_text(ui: httpx.Client):
    hostile_key = '"><img src=x onerror=alert(2)>'
    reply = send(ui, hostile_key, {"note": HOSTILE, "kind": "push"}, headers={"X-Note": HOSTILE})
    assert reply.status_code == 202
    run_id = reply.json()["results"][0]["run_id"]
    (delivery_id,) = delivery_ids(ui, 1)
    pages = [
        ui.get("/ui"),
        ui.get(f"/ui/deliveries/{delivery_id}"),
        ui.get("/ui/runs"),
        ui.get(f"/ui/runs/{run_id}"),
        ui.get("/ui/runs", params={"key": hostile_key}),
    ]
    for page in pages:
        assert page.status_code == 200
        assert "<script" not in page.text and "<img" not in page.text
    detail = pages[1].text
    assert "<tr><th>x-note</th><td>&lt;script&gt;alert(1)&lt;/script&gt;</td></tr>" in detail
    assert "&quot;note&quot;: &quot;&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in detail
    assert "&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in pages[3].text
    # The key filter reads the key back exactly: the run is found by it.
    assert f'href="/ui/runs/{run_id}"' in pages[4].text
    assert 'value="&quot;&gt;&lt;img src=x onerror=alert(2)&gt;"' in pages[4].text


def test_a_delivery_shows_each_decision_headers_and_body(ui: httpx.Client):
    body = {"kind": "push", "ref": "refs/heads/main", "items": [1, 2]}
    run_id = send(ui, "evt-1", body).json()["results"][0]["run_id"]
    (delivery_id,) = delivery_ids(ui, 1)
    page = ui.get(f"/ui/deliveries/{delivery_id}")
    assert h1(page) == f"Delivery {delivery_id}"
    rows = [
        dict(re.findall(r'<td data-label="([^"]+)"[^>]*>(.*?)</td>', row))
        for row in re.findall(r'<tr class="trigger">(.*?)</tr>', page.text)
    ]
    assert rows == [
        {
            "Trigger": 'hook<br><span class="hint">→ sync</span>',
            "Signature": '<span class="badge ok">verified</span>',
            "When": "held",
            "Key": "event id <code>evt-1</code><br>key <code>evt-1</code><br>"
            "<details><summary>params</summary><pre>{}</pre></details>",
            "Decision": '<span class="badge started">started</span>',
            "Run": f'<a class="id" href="/ui/runs/{run_id}">{run_id}</a> '
            '<span class="badge running">running</span>',
            "Why": f"Run &#x27;{run_id}&#x27; created for workflow &#x27;sync&#x27;. Ready for "
            "the agent: &#x27;fetch&#x27;.",
        },
        {
            "Trigger": 'hook-deploys<br><span class="hint">→ single</span>',
            "Signature": '<span class="badge ok">verified</span>',
            "When": "did not hold: jsonpath $.kind is &#x27;push&#x27;, "
            "expected &#x27;deploy&#x27;",
            "Key": "",
            "Decision": '<span class="badge ignored">ignored</span>',
            "Run": "",
            "Why": "not matched: jsonpath $.kind is &#x27;push&#x27;, expected &#x27;deploy&#x27;",
        },
    ]
    table = page.text.split('id="headers">')[1].split("</table>")[0]
    headers = dict(re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", table))
    assert headers["x-event-id"] == "evt-1"
    assert "x-token" not in headers
    assert HOOK_SECRET not in page.text
    pretty = json.dumps(body, indent=2).replace('"', "&quot;")
    assert f'<pre id="body">{pretty}</pre>' in page.text
    size = len(json.dumps(body))  # as sent
    assert f'<p class="hint">{size} bytes, JSON, re-indented</p>' in page.text


def test_a_delivery_shows_its_runs_phase_now_and_at_delivery(
    ui: httpx.Client, api: httpx.Client, db: redis_sync.Redis
):
    first = send(ui, "now-1", {"kind": "push"}).json()["results"][0]["run_id"]
    second = send(ui, "now-2", {"kind": "push"}).json()["results"][0]["run_id"]
    both = delivery_ids(ui, 2)
    assert api.post(f"/v1/runs/{first}/cancel").json() == {"cancelled": True}
    # The second run's record is gone, as when it expires.
    assert db.delete(*db.scan_iter(f"*:run:{second}")) == 1

    cells = {}  # each delivery's first Run cell, by the run it names
    for delivery_id in both:
        page = ui.get(f"/ui/deliveries/{delivery_id}")
        assert page.status_code == 200, page.text
        cell = re.findall(r'<td data-label="Run">(.*?)</td>', page.text)[0]
        cells[re.search(r'href="/ui/runs/([0-9a-f-]{36})"', cell).group(1)] = cell  # type: ignore[union-attr]
    link = '<a class="id" href="/ui/runs/{0}">{0}</a>'
    assert cells == {
        first: link.format(first) + ' <span class="badge cancelled">cancelled</span>'
        '<br><span class="hint">running at delivery</span>',
        second: link.format(second) + ' <span class="hint">(gone)</span>'
        '<br><span class="hint">running at delivery</span>',
    }


def test_filters_of_the_delivery_list(ui: httpx.Client):
    send(ui, "p-1", {"kind": "push"})
    send(ui, "ignored", {"id": "o-1"}, path="/hooks/other")
    assert send(ui, "bad", {"kind": "push"}, secret="wrong").status_code == 401
    every = delivery_ids(ui, 3)
    # Ids sort by ms, then at random: each delivery is known by what a filter finds.
    (other,) = delivery_ids(ui, 1, "?path=/hooks/other")
    (newest,) = delivery_ids(ui, 1, "?status=4xx")
    (plain,) = delivery_ids(ui, 1, "?outcome=ignored")
    assert sorted(every) == sorted([other, newest, plain])
    assert sorted(delivery_ids(ui, 2, "?status=202")) == sorted([other, plain])
    assert delivery_ids(ui, 1, "?path=/hooks/plain&outcome=started") == [plain]
    rows = ui.get("/ui", params={"status": "4xx"}).text
    assert '<td data-label="Status"><span class="badge s4xx">401</span></td>' in rows
    assert '<span class="badge unverified">unverified</span>' in rows
    assert '<span class="code">AUTH_REQUIRED</span></td>' in rows
    refused = ui.get(f"/ui/deliveries/{newest}")
    signatures = re.findall(r'<td data-label="Signature">(.*?)</td>', refused.text)
    assert signatures == ['<span class="badge refused">failed</span> token mismatch'] * 2
    assert "Not kept: the delivery was refused before its signature was verified." in refused.text
    assert (
        f"Cannot be replayed: delivery {newest} was refused (401) before it was verified: "
        "the log keeps neither its headers nor its body"
    ) in refused.text

    bad = ui.get("/ui", params={"status": "abc"})
    assert bad.status_code == 422
    assert alert(bad) == (
        "status must be an HTTP status like 202 or a class like 4xx (got &#x27;abc&#x27;)"
    )
    assert 'name="status" list="statuses" value="abc"' in bad.text
    bad = ui.get("/ui", params={"path": "hooks/plain"})
    assert alert(bad) == "path must start with &#x27;/&#x27; (got &#x27;hooks/plain&#x27;)"


def test_list_pages_go_on_with_the_cursor(ui: httpx.Client, api: httpx.Client):
    for i in range(55):
        last = send(ui, f"page-{i}", {"kind": "push"}, path="/hooks/plain")
    # One worker writes its records in order: once the last is listed, all 55 are.
    last_run = last.json()["results"][0]["run_id"]
    deadline = time.monotonic() + 10
    while last_run not in (page := ui.get("/ui")).text and time.monotonic() < deadline:
        time.sleep(0.05)
    first = DELIVERY_LINK.findall(page.text)
    assert len(first) == 50
    more = re.search(r'<a href="(/ui\?cursor=[^"]+)" rel="next">Older deliveries</a>', page.text)
    assert more, page.text
    rest = DELIVERY_LINK.findall(ui.get(more.group(1).replace("&amp;", "&")).text)
    assert len(rest) == 5 and not set(rest) & set(first)

    runs = ui.get("/ui/runs", params={"workflow": "sync"})
    assert len(re.findall(r'<tr class="run">', runs.text)) == 50
    more = re.search(r'<a href="(/ui/runs\?[^"]+)" rel="next">Older runs</a>', runs.text)
    assert more, runs.text
    tail = ui.get(more.group(1).replace("&amp;", "&"))
    assert len(re.findall(r'<tr class="run">', tail.text)) == 5
    assert 'rel="next"' not in tail.text


def test_replay_deduplicates_and_rerun_starts_a_new_run(ui: httpx.Client, api: httpx.Client):
    first_run = send(ui, "r-1", {"kind": "push"}).json()["results"][0]["run_id"]
    (original,) = delivery_ids(ui, 1)
    page = ui.get(f"/ui/deliveries/{original}")

    replayed = ui.post(f"/ui/deliveries/{original}/replay", data={"csrf": csrf_of(page)})
    assert replayed.status_code == 303
    location = replayed.headers["location"]
    match = re.fullmatch(
        r"/ui/deliveries/(dlv-[0-9a-f]{12}-[0-9a-f]{8})\?notice=replayed", location
    )
    assert match and match.group(1) != original
    shown = ui.get(location)
    assert "Replayed: this is the new delivery the replay recorded." in shown.text
    assert (
        f'<tr><th>Replay of</th><td><a class="id" href="/ui/deliveries/{original}">' in shown.text
    )
    row = re.findall(r'<tr class="trigger">(.*?)</tr>', shown.text)[0]
    assert '<span class="badge deduplicated">deduplicated</span>' in row
    assert '<td data-label="Signature"><span class="hint">not checked (a replay)</span>' in row
    assert f'href="/ui/runs/{first_run}"' in row

    rerun = ui.post(f"/ui/deliveries/{original}/replay", data={"csrf": csrf_of(page), "rerun": "1"})
    shown = ui.get(rerun.headers["location"])
    assert "<tr><th>Replayed as</th><td>rerun (new runs)</td></tr>" in shown.text
    row = re.findall(r'<tr class="trigger">(.*?)</tr>', shown.text)[0]
    assert '<span class="badge started">started</span>' in row
    new_run = re.search(r'href="/ui/runs/([0-9a-f-]{36})"', row).group(1)  # type: ignore[union-attr]
    assert new_run != first_run
    assert api.get(f"/v1/runs/{new_run}").json()["rerun_of"] == first_run

    lineage = ui.get(f"/ui/runs/{new_run}").text.split('id="lineage">')[1].split("</ol>")[0]
    items = re.findall(r"<li>(.*?)</li>", lineage)
    assert len(items) == 2
    assert f'href="/ui/runs/{new_run}"' in items[0] and "(this run)" in items[0]
    # The live run was cancelled first, as on_live_match: cancel_existing does.
    assert f'href="/ui/runs/{first_run}"' in items[1]
    assert '<span class="badge cancelled">cancelled</span>' in items[1]

    # A delivery refused before it was verified has nothing to send again.
    assert send(ui, "nope", {}, secret="wrong").status_code == 401
    (refused_id,) = delivery_ids(ui, 1, "?status=401")
    refused = ui.post(f"/ui/deliveries/{refused_id}/replay", data={"csrf": csrf_of(page)})
    assert refused.status_code == 409
    assert alert(refused) == (
        f"STATE_DELIVERY_NOT_REPLAYABLE: delivery {refused_id} was refused (401) before it "
        "was verified: the log keeps neither its headers nor its body"
    )


def test_a_run_shows_its_steps_attempts_and_output(ui: httpx.Client, api: httpx.Client):
    run_id = api.post(
        "/v1/workflows/sync/runs", json={"idempotency_key": "steps", "params": {"n": 1}}
    ).json()["run_id"]

    def steps() -> list[tuple[str, str, str]]:
        page = ui.get(f"/ui/runs/{run_id}")
        assert page.status_code == 200
        return re.findall(
            r'<td data-label="Step">(.*?)</td><td data-label="State">(.*?)</td>'
            r'<td data-label="Attempts">(.*?)</td>',
            page.text,
        )

    assert steps() == [
        ("fetch", "ready: waiting for a runner", "—"),
        ("transform", "waiting", "—"),
        ("load", "waiting", "—"),
    ]
    (taken,) = api.post(
        "/v1/workflows/sync/steps/claim", json={"runner": "t", "lease_seconds": 60}
    ).json()["steps"]
    state = steps()[0]
    assert state[0] == "fetch" and state[2] == "1"
    assert re.fullmatch(r"taken: attempt 1, leased for (59|60) s more", state[1]), state
    failed = api.post(
        f"/v1/runs/{run_id}/fail",
        json={"retry": True, "step": "fetch", "lease": taken["lease"], "error": "<b>boom</b>"},
    )
    assert failed.json()["phase"] == "running"
    state = steps()[0]
    assert re.fullmatch(r"attempt 1 failed: retry in [01] s", state[1]) and state[2] == "1"
    page = ui.get(f"/ui/runs/{run_id}").text
    assert '<tr><th>Error</th><td><span class="error-text">&lt;b&gt;boom&lt;/b&gt;</span>' in page

    api.post(f"/v1/runs/{run_id}/complete", json={"step": "fetch", "output": {"rows": 3}})
    assert steps() == [
        ("fetch", "done", "—"),
        ("transform", "ready: waiting for a runner", "—"),
        ("load", "waiting", "—"),
    ]
    page = ui.get(f"/ui/runs/{run_id}").text
    assert '<pre id="output">{\n  &quot;rows&quot;: 3\n}</pre>' in page
    assert '<pre id="params">{\n  &quot;n&quot;: 1\n}</pre>' in page
    assert 'id="lineage"' not in page  # no rerun_of: no lineage section

    api.post(f"/v1/runs/{run_id}/fail", json={"error": "gave up"})
    assert steps() == [
        ("fetch", "done", "—"),
        ("transform", "failed here", "—"),
        ("load", "not reached", "—"),
    ]


def test_runs_by_workflow_and_phase(ui: httpx.Client, api: httpx.Client):
    a = api.post("/v1/workflows/sync/runs", json={}).json()["run_id"]
    b = api.post("/v1/workflows/sync/runs", json={}).json()["run_id"]
    c = api.post("/v1/workflows/single/runs", json={}).json()["run_id"]
    api.post(f"/v1/runs/{b}/cancel")

    def listed(**query: str) -> list[str]:
        page = ui.get("/ui/runs", params=query)
        assert page.status_code == 200, page.text
        return re.findall(
            r'<td data-label="Run"><a class="id" href="/ui/runs/([0-9a-f-]{36})"', page.text
        )

    # Across workflows the merge is by creation time in ms: two may tie, in any order.
    every = listed()
    assert sorted(every) == sorted([a, b, c]) and [r for r in every if r != c] == [b, a]
    assert listed(workflow="sync") == [b, a]
    assert listed(workflow="sync", phase="running") == [a]
    assert listed(phase="cancelled") == [b]
    assert listed(workflow="single", phase="cancelled") == []
    page = ui.get("/ui/runs", params={"workflow": "sync", "phase": "running"})
    assert '<option value="sync" selected>sync</option>' in page.text
    assert '<option value="running" selected>running</option>' in page.text

    bad = ui.get("/ui/runs", params={"workflow": "nope"})
    assert bad.status_code == 422
    assert alert(bad) == (
        "Workflow &#x27;nope&#x27; is not defined in triggers.yaml (defined: deploy, single, sync)."
    )
    bad = ui.get("/ui/runs", params={"phase": "asleep"})
    assert alert(bad) == (
        "phase must be one of running, completed, failed, cancelled, queued, scheduled"
    )
    bad = ui.get("/ui/runs", params={"cursor": "x"})
    assert alert(bad).startswith("cursor must be the value a previous page returned")


def test_missing_things_are_pages_not_tracebacks(ui: httpx.Client):
    missing = ui.get("/ui/deliveries/dlv-000000000000-00000000")
    assert missing.status_code == 404
    assert alert(missing).startswith(
        "NOT_FOUND_DELIVERY: delivery dlv-000000000000-00000000 is not in the delivery log"
    )
    bad = ui.get("/ui/deliveries/<nope>")
    assert bad.status_code == 422
    assert alert(bad) == (
        "VALIDATION_PARAMS: delivery id &#x27;&lt;nope&gt;&#x27; is not one (ids look like "
        "dlv-0193a1b2c3d4-5e6f7a8b)"
    )
    run = ui.get("/ui/runs/not-a-run")
    assert run.status_code == 404
    assert alert(run) == "NOT_FOUND_RUN: No run &#x27;not-a-run&#x27;: run ids are UUIDs."
    big = ui.post("/ui/login", data={"token": "x" * 20_000})
    assert big.status_code == 413
    assert alert(big) == "the form is over 16384 bytes"


def test_a_store_that_is_down_is_a_503_page(start_redis, tmp_path: Path):
    server = start_redis()
    # A short store timeout: the page answers soon after Redis stops answering.
    config = CONFIG.replace("version: 1\n", "version: 1\nsettings: {redis_timeout: 0.5}\n", 1)
    listener = Listener(tmp_path, config, redis_url=server.url, env=ENV).start()
    try:
        with httpx.Client(base_url=listener.base_url, timeout=10) as client:
            login(client)
            server.stop()
            page = client.get("/ui")
            assert page.status_code == 503
            assert page.headers["retry-after"] == "5"
            assert alert(page).startswith("STORE_UNAVAILABLE: ")
            assert "Traceback" not in listener.log()
    finally:
        listener.stop()


def test_triggers_cannot_take_the_inspector_paths():
    assert "/ui" in RESERVED_PATHS
    for path in ("/ui", "/ui/login"):
        text = (
            WORKFLOWS_YAML + f"triggers:\n  t:\n    workflow: sync\n    path: {path}\n"
            "    verify: {scheme: none}\n    event_id: {header: X-Id}\n"
        )
        with pytest.raises(ConfigError) as caught:
            parse_config(text)
        assert str(caught.value) == (
            f"triggers.yaml: trigger 't': field 'path': {path} is the gateway's own route; "
            "pick another path (reserved: /v1/…, /ui/…, /healthz, /metrics, /openapi.json, "
            "/readyz, /ui, /v1)"
        )


def test_the_deliveries_page_says_what_the_spool_holds_and_badges_accepted() -> None:
    """A delivery kept in the spool is listed as ``accepted`` (it has no run yet), and
    the page says how many this worker's spool holds, and since when."""
    from gateway.faces.ui.delivery_views import deliveries_page
    from gateway.faces.ui.layout import Frame

    item = {
        "delivery_id": "dlv-0193a1b2c3d4-5e6f7a8b", "received_ms": 1_733_000_000_000,
        "path": "/hooks/github", "status": 202, "code": None, "replay_of": None,
        "outcomes": [{"trigger": "github-push", "outcome": "accepted", "run_id": None}],
    }  # fmt: skip
    html = str(deliveries_page([item], {}, ["/hooks/github"], None, Frame(), (3, 41.6)))
    assert (
        '<p class="spool" id="spool">This worker\'s spool holds 3 deliveries the store has '
        "not taken yet (the oldest 42 s old)."
    ) in html
    assert '<span class="badge accepted">accepted</span>' in html
    assert '<option value="accepted">accepted</option>' in html
    # Nothing held: no note.
    assert 'id="spool"' not in str(deliveries_page([item], {}, [], None, Frame(), (0, 0.0)))
    assert 'id="spool"' not in str(deliveries_page([item], {}, [], None, Frame(), None))
