"""The inspector page in a real headless browser: Debian's ``chromium`` driven by its
``chromium-driver`` through selenium. Logs in, filters, opens a delivery, replays it,
reruns it, cancels a run, filters runs, and reads what the pages show, on a desktop
and a phone-wide window. After every test the browser's console holds no error.

Screenshots go to ``test-artifacts/ui/`` (or ``$REALM_TEST_ARTIFACTS/ui/``).
``REALM_UPDATE_DOCS_SCREENSHOT=1 pytest tests/test_ui_browser.py`` also rewrites
``docs/inspector.png``, the README's picture of the page.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_sync

from tests import inspector_scaffold
from tests.inspector_scaffold import TOKEN, send
from tests.listener import Listener

webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')"
)
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# The Debian packages missing, named in the skip reason with the command that installs them.
MISSING = [name for name, found in (("chromium", CHROMIUM), ("chromium-driver", CHROMEDRIVER))
           if found is None]  # fmt: skip
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"Debian's {' and '.join(MISSING)} {'is' if len(MISSING) == 1 else 'are'} not "
        "installed (apt-get install chromium chromium-driver; .ci/run installs them)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("REALM_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "ui"
DOCS_SCREENSHOT = ROOT / "docs" / "inspector.png"
DESKTOP = (1280, 900)
PHONE = (390, 844)  # an iPhone 12-15's CSS pixels
gateway = inspector_scaffold.gateway
api = inspector_scaffold.api


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={DESKTOP[0]},{DESKTOP[1]}",
        "--force-device-scale-factor=1",
        "--lang=en-US",
    ):
        options.add_argument(argument)
    # The console, for the no-errors check (selenium's get_log("browser")).
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    browser = webdriver.Chrome(options=options, service=service)
    browser.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield browser
    browser.quit()


@pytest.fixture
def page(driver: Any, gateway: Listener, db: redis_sync.Redis) -> Iterator[Any]:
    """The browser at the desktop size, logged in, on an empty store; afterwards its
    console must hold no error (the page has no script: any error is ours)."""
    driver.set_window_size(*DESKTOP)
    driver.get(f"{gateway.base_url}/ui")
    if "/ui/login" in driver.current_url:
        log_in(driver, TOKEN)
    assert heading(driver) == "Deliveries"
    yield driver
    assert console_errors(driver) == []


@pytest.fixture
def hooks(gateway: Listener) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
        yield client


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def log_in(driver: Any, token: str) -> None:
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    click(driver, By.CSS_SELECTOR, "form.login button[type=submit]")


def click(driver: Any, by: str, selector: str) -> None:
    """Click, then wait until the page it led to has loaded."""
    old = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(by, selector).click()
    WebDriverWait(driver, 10).until(lambda d: d.find_element(By.TAG_NAME, "html") != old)
    WebDriverWait(driver, 10).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def heading(driver: Any) -> str:
    return driver.find_element(By.TAG_NAME, "h1").text


def texts(driver: Any, selector: str) -> list[str]:
    return [element.text for element in driver.find_elements(By.CSS_SELECTOR, selector)]


def listed_deliveries(driver: Any) -> list[str]:
    return texts(driver, "#deliveries td[data-label=Delivery] a")


def wait_for_deliveries(driver: Any, url: str, count: int) -> list[str]:
    """Reload ``url`` until its list shows ``count`` deliveries (the log is written
    every 100 ms), with a deadline."""

    def shown(d: Any) -> list[str] | None:
        d.get(url)
        ids = listed_deliveries(d)
        return ids if len(ids) >= count else None

    try:
        ids = WebDriverWait(driver, 10, poll_frequency=0.1).until(shown)
    except TimeoutException:
        ids = listed_deliveries(driver)
    assert len(ids) == count, ids
    return ids


def screenshot(driver: Any, name: str, *, full: bool = False) -> Path:
    """Save what the window shows (``full``: the whole page, by growing the window to
    its height) under the artifacts folder."""
    path = ARTIFACTS / f"{name}.png"
    if full:
        width = driver.get_window_size()["width"]
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(width, min(height + 150, 4000))
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 1000
    return path


def test_login_refuses_a_wrong_token(driver: Any, gateway: Listener, db: redis_sync.Redis):
    driver.delete_all_cookies()
    driver.get(f"{gateway.base_url}/ui/runs")
    assert driver.current_url == f"{gateway.base_url}/ui/login?next=%2Fui%2Fruns"
    log_in(driver, "not-the-token")
    assert heading(driver) == "Log in"
    assert texts(driver, "p.error") == ["That is not the gateway's API token (REALM_API_TOKEN)."]
    screenshot(driver, "login-refused")
    log_in(driver, TOKEN)
    assert (driver.current_url, heading(driver)) == (f"{gateway.base_url}/ui/runs", "Runs")
    # The session cookie is out of the page's reach.
    cookie = driver.get_cookie("realm_ui")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert TOKEN not in cookie["value"]
    # The refused login's own status is the only thing the console reports.
    assert console_errors(driver) == [
        f"{gateway.base_url}/ui/login - Failed to load resource: the server responded with "
        "a status of 401 (Unauthorized)"
    ]


def test_filter_and_open_a_delivery(page: Any, hooks: httpx.Client, gateway: Listener):
    body = {
        "kind": "push",
        "ref": "refs/heads/main",
        "repository": {"full_name": "acme/shop"},
        "commits": [{"id": "9fceb02", "message": "Fix <checkout> rounding"}],
    }
    run_id = send(hooks, "gh-7731", body, headers={"X-GitHub-Event": "push"}).json()["results"][0][
        "run_id"
    ]
    send(hooks, "o-1", {"id": "o-1"}, path="/hooks/other")
    assert send(hooks, "bad", {"kind": "push"}, secret="wrong").status_code == 401
    every = wait_for_deliveries(page, f"{gateway.base_url}/ui", 3)
    screenshot(page, "deliveries")

    # Each filter finds one delivery, a different one each time (ids sort by ms, then
    # at random, so which is which is told by what the rows show).
    field = page.find_element(By.NAME, "path")
    field.send_keys("/hooks/other")
    click(page, By.CSS_SELECTOR, "form.filters button[type=submit]")
    (other,) = listed_deliveries(page)
    assert texts(page, "#deliveries td[data-label=Path]") == ["/hooks/other"]
    page.find_element(By.NAME, "path").clear()
    page.find_element(By.NAME, "status").send_keys("4xx")
    click(page, By.CSS_SELECTOR, "form.filters button[type=submit]")
    (refused,) = listed_deliveries(page)
    assert texts(page, "#deliveries td[data-label=Status]") == ["401"]
    page.find_element(By.NAME, "status").clear()
    Select(page.find_element(By.NAME, "outcome")).select_by_value("ignored")
    click(page, By.CSS_SELECTOR, "form.filters button[type=submit]")
    (plain,) = listed_deliveries(page)
    assert texts(page, "#deliveries td[data-label=Path]") == ["/hooks/plain"]
    assert sorted(every) == sorted([other, refused, plain])

    click(page, By.LINK_TEXT, plain)
    assert heading(page) == f"Delivery {plain}"
    names = texts(page, "#headers th")
    assert "x-event-id" in names and "x-github-event" in names
    assert not [name for name in names if "token" in name or "signature" in name]
    assert page.find_element(By.ID, "body").text == json.dumps(body, indent=2)
    decisions = texts(page, "#triggers td[data-label=Decision]")
    assert decisions == ["started", "ignored"]
    assert texts(page, "#triggers td[data-label=Run]") == [f"{run_id} running", ""]
    assert texts(page, "#triggers td[data-label=Signature]") == ["verified", "verified"]
    assert texts(page, "#triggers td[data-label=When]") == [
        "held",
        "did not hold: jsonpath $.kind is 'push', expected 'deploy'",
    ]
    why = texts(page, "#triggers td[data-label=Why]")
    assert why[0] == f"Run '{run_id}' created for workflow 'sync'. Ready for the agent: 'fetch'."
    assert why[1] == "not matched: jsonpath $.kind is 'push', expected 'deploy'"
    screenshot(page, "delivery", full=True)
    if os.environ.get("REALM_UPDATE_DOCS_SCREENSHOT") == "1":
        page.set_window_size(1100, DESKTOP[1])
        shutil.copyfile(screenshot(page, "docs-inspector", full=True), DOCS_SCREENSHOT)


def test_replay_then_rerun(page: Any, hooks: httpx.Client, api: httpx.Client, gateway: Listener):
    first_run = send(hooks, "r-1", {"kind": "push"}).json()["results"][0]["run_id"]
    (original,) = wait_for_deliveries(page, f"{gateway.base_url}/ui", 1)
    click(page, By.LINK_TEXT, original)

    click(page, By.CSS_SELECTOR, "form.replay button[type=submit]")
    replay_id = heading(page).removeprefix("Delivery ")
    assert replay_id != original
    assert texts(page, "p.notice") == ["Replayed: this is the new delivery the replay recorded."]
    assert page.find_element(By.XPATH, "//th[.='Replay of']/following-sibling::td").text == original
    assert texts(page, "#triggers td[data-label=Decision]") == ["deduplicated", "ignored"]
    assert texts(page, "#triggers td[data-label=Run]") == [f"{first_run} running", ""]
    assert texts(page, "#triggers td[data-label=Signature]") == ["not checked (a replay)"] * 2
    screenshot(page, "replayed")

    page.get(f"{gateway.base_url}/ui")
    assert "replay" in texts(page, "#deliveries td[data-label=Delivery]")[0]
    click(page, By.LINK_TEXT, original)
    page.find_element(By.NAME, "rerun").click()
    click(page, By.CSS_SELECTOR, "form.replay button[type=submit]")
    assert texts(page, "#triggers td[data-label=Decision]") == ["started", "ignored"]
    new_run = page.find_element(By.CSS_SELECTOR, "#triggers td[data-label=Run] a").text
    assert new_run != first_run
    click(page, By.LINK_TEXT, new_run)
    assert heading(page) == f"Run {new_run}"
    lineage = texts(page, "#lineage li")
    assert len(lineage) == 2
    assert lineage[0] == f"{new_run} running (this run)"
    assert lineage[1].startswith(f"{first_run} cancelled created ")
    assert api.get(f"/v1/runs/{new_run}").json()["rerun_of"] == first_run
    screenshot(page, "run-lineage", full=True)
    # The first delivery's page: its run as it is now, and as it was then.
    page.get(f"{gateway.base_url}/ui/deliveries/{original}")
    assert texts(page, "#triggers td[data-label=Run]") == [
        f"{first_run} cancelled\nrunning at delivery",
        "",
    ]


def test_cancel_a_run(page: Any, api: httpx.Client, gateway: Listener):
    run_id = api.post("/v1/workflows/sync/runs", json={"idempotency_key": "c-1"}).json()["run_id"]
    page.get(f"{gateway.base_url}/ui/runs/{run_id}")
    assert page.find_element(By.ID, "phase").text == "running"
    click(page, By.CSS_SELECTOR, "form.cancel button[type=submit]")
    assert page.current_url == f"{gateway.base_url}/ui/runs/{run_id}?notice=cancelled"
    assert page.find_element(By.ID, "phase").text == "cancelled"
    assert texts(page, "p.notice") == ["The run is cancelled."]
    assert page.find_elements(By.CSS_SELECTOR, "form.cancel") == []
    assert api.get(f"/v1/runs/{run_id}").json()["phase"] == "cancelled"


def test_runs_by_workflow_and_phase(page: Any, api: httpx.Client, gateway: Listener):
    kept = api.post("/v1/workflows/sync/runs", json={}).json()["run_id"]
    ended = api.post("/v1/workflows/sync/runs", json={}).json()["run_id"]
    other = api.post("/v1/workflows/single/runs", json={}).json()["run_id"]
    api.post(f"/v1/runs/{ended}/cancel")
    page.get(f"{gateway.base_url}/ui/runs")
    every = texts(page, "#runs td[data-label=Run]")  # across workflows: ms ties possible
    assert sorted(every) == sorted([other, ended, kept])
    assert [run for run in every if run != other] == [ended, kept]

    Select(page.find_element(By.NAME, "workflow")).select_by_value("sync")
    Select(page.find_element(By.NAME, "phase")).select_by_value("cancelled")
    click(page, By.CSS_SELECTOR, "form.filters button[type=submit]")
    assert texts(page, "#runs td[data-label=Run]") == [ended]
    assert texts(page, "#runs td[data-label=Phase]") == ["cancelled"]
    Select(page.find_element(By.NAME, "phase")).select_by_value("running")
    click(page, By.CSS_SELECTOR, "form.filters button[type=submit]")
    assert texts(page, "#runs td[data-label=Run]") == [kept]
    screenshot(page, "runs")


def test_readable_on_a_phone(page: Any, hooks: httpx.Client, gateway: Listener):
    body = {"kind": "push", "ref": "refs/heads/main", "note": "x" * 300}
    send(hooks, "phone-1", body)
    send(hooks, "phone-2", {"id": "o-2"}, path="/hooks/other")
    newest, older = wait_for_deliveries(page, f"{gateway.base_url}/ui", 2)
    page.set_window_size(*PHONE)
    page.get(f"{gateway.base_url}/ui")

    def fits(d: Any) -> bool:
        # Nothing wider than the screen: no sideways scrolling.
        return d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")

    assert page.execute_script("return window.innerWidth") <= PHONE[0]
    assert fits(page)
    # One card per delivery, each cell labelled (the list's header row is hidden).
    assert not page.find_element(By.CSS_SELECTOR, "#deliveries thead").is_displayed()
    screenshot(page, "phone-deliveries")
    click(page, By.LINK_TEXT, older)
    assert fits(page)
    page.get(f"{gateway.base_url}/ui/deliveries/{newest}")
    assert fits(page)
    screenshot(page, "phone-delivery", full=True)
