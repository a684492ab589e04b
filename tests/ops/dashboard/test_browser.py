"""GET /dashboard in a real headless Chromium (the OS package, driven by Selenium through the OS
chromedriver; no browser is downloaded): the page asks for the API key once, its counters, tenant
rows and recent requests change to the right values as requests run, and a click on a request
draws that request's timeline. A screenshot is saved under $PAGODA_TEST_ARTIFACTS (default
test-artifacts/ at the repository's root).

Without a Chromium the test skips, saying so; with PAGODA_REQUIRE_BROWSER=1 (set by .ci/run, which
installs Chromium) a missing browser fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.dashboard.server_helpers import PREFILL_CHUNK, TENANT_KEYS, auth, complete, wait_idle
from tests.serve.serve_helpers import wait_for

REPO = Path(__file__).resolve().parents[3]
ARTIFACTS = Path(os.environ.get("PAGODA_TEST_ARTIFACTS") or REPO / "test-artifacts")


def _find(names: tuple[str, ...], env: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env]
    return next((path for n in names if (path := shutil.which(n))), None)


CHROMIUM = _find(("chromium", "chromium-browser", "google-chrome"), "PAGODA_CHROMIUM")
CHROMEDRIVER = _find(("chromedriver",), "PAGODA_CHROMEDRIVER")
MISSING = ("no Chromium found" if CHROMIUM is None else "no chromedriver found" if CHROMEDRIVER is None
           else "selenium is not installed" if importlib.util.find_spec("selenium") is None else None)
REQUIRED = os.environ.get("PAGODA_REQUIRE_BROWSER") == "1"
# A mark, not a skip inside a fixture: a skipped test starts no server.
pytestmark = pytest.mark.skipif(
    MISSING is not None and not REQUIRED,
    reason=f"{MISSING}: install Chromium and its driver from the OS packages (apt-get install chromium "
           f"chromium-driver) to run the dashboard's browser test",
)


@pytest.fixture(scope="module")
def browser():
    if MISSING is not None:
        pytest.fail(f"PAGODA_REQUIRE_BROWSER=1 but {MISSING}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    # An explicit driver path: Selenium never looks for (or downloads) a driver of its own.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _text(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def _shown(driver, element_id: str) -> bool:
    return driver.execute_script("return !document.getElementById(arguments[0]).hidden", element_id)


def _table(driver, selector: str, key: str) -> dict[str, list[str]]:
    """Rows of a table body by their data attribute, each as its cells' texts."""
    return driver.execute_script(
        """const out = {};
        for (const tr of document.querySelectorAll(arguments[0] + ' tbody tr')) {
          out[tr.dataset[arguments[1]]] = [...tr.querySelectorAll('td')].map(td => td.textContent);
        }
        return out;""", selector, key)


def _counters(driver) -> dict[str, int]:
    ids = ("requests-finished", "prompt-tokens-total", "generation-tokens-total")
    return {i: int(_text(driver, i)) for i in ids}


def test_dashboard_in_chromium(browser, dashboard_server):
    url = dashboard_server.url
    # The page is public, its data is not.
    assert httpx.get(f"{url}/dashboard").status_code == 200
    assert httpx.get(f"{url}/dashboard/snapshot").status_code == 401
    wait_idle(dashboard_server)

    browser.get(f"{url}/dashboard")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    wait_for(lambda: _shown(browser, "key-form"), 30, what="the page to ask for the API key")
    assert not _shown(browser, "board")
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "api-key").send_keys("sk-wrong")
    browser.find_element(By.ID, "key-submit").click()
    wait_for(lambda: "refused" in _text(browser, "key-error"), 30, what="the wrong key to be refused")
    browser.find_element(By.ID, "api-key").send_keys(TENANT_KEYS["team-a"])
    browser.find_element(By.ID, "key-submit").click()
    wait_for(lambda: _shown(browser, "board") and _text(browser, "requests-finished").isdigit(), 30,
             what="the board to show")
    before = _counters(browser)
    tenants_before = _table(browser, "#tenants", "tenant")

    # Distinct prompts (no prefix-cache hits): 40 tokens come in chunks of 16, 16 and 8.
    sent = [("team-a", list(range(100, 140)), 4), ("team-a", list(range(200, 224)), 5),
            ("team-b", list(range(300, 333)), 6)]
    ids = [complete(dashboard_server, tenant, prompt, n)["id"] for tenant, prompt, n in sent]

    want = {"requests-finished": before["requests-finished"] + 3,
            "prompt-tokens-total": before["prompt-tokens-total"] + sum(len(p) for _, p, _ in sent),
            "generation-tokens-total": before["generation-tokens-total"] + sum(n for _, _, n in sent)}
    wait_for(lambda: _counters(browser) == want, 30, what=f"the counters to read {want}")
    # Tokens/s are over the last 10 s, which hold these requests.
    assert float(_text(browser, "prompt-tps")) > 0 and float(_text(browser, "generation-tps")) > 0

    def tenant_requests(name: str, rows: dict) -> int:
        return int(rows[name][2]) if name in rows else 0

    tenants = _table(browser, "#tenants", "tenant")
    assert tenant_requests("team-a", tenants) == tenant_requests("team-a", tenants_before) + 2
    assert tenant_requests("team-b", tenants) == tenant_requests("team-b", tenants_before) + 1
    recent = _table(browser, "#recent", "requestId")
    for rid, (tenant, prompt, n) in zip(ids, sent):
        request, shown_tenant, status, prompt_tokens, generated = recent[rid][:5]
        assert (request, shown_tenant, status, int(prompt_tokens), int(generated)) == (rid, tenant, "finished",
                                                                                      len(prompt), n)
    # Newest first.
    order = browser.execute_script(
        "return [...document.querySelectorAll('#recent tbody tr')].map(tr => tr.dataset.requestId)")
    assert [order.index(rid) for rid in reversed(ids)] == sorted(order.index(rid) for rid in ids)
    # n-gram speculation is on: the acceptance card shows the server's all-time rate, once a
    # repeating prompt has given the proposer something to draft.
    assert _shown(browser, "spec-card")
    complete(dashboard_server, "team-b", [5, 6, 7, 8] * 6, 12)
    wait_idle(dashboard_server)
    metrics = {f.name: f.samples[0].value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
               if f.samples}
    drafted = metrics["pagoda:spec_decode_num_draft_tokens"]
    assert drafted > 0
    rate = f"{100 * metrics['pagoda:spec_decode_num_accepted_tokens'] / drafted:.1f}%"
    wait_for(lambda: _text(browser, "spec-acceptance-total") == rate, 30, what=f"the acceptance rate {rate}")

    # A click on the first request draws its timeline.
    browser.find_element(By.CSS_SELECTOR, f'#recent tr[data-request-id="{ids[0]}"]').click()
    wait_for(lambda: _text(browser, "timeline-title") == ids[0]
             and browser.find_elements(By.CSS_SELECTOR, "#timeline rect[data-kind=finish]"), 30,
             what="the timeline to be drawn")
    bars = browser.execute_script(
        "return [...document.querySelectorAll('#timeline rect')].map(r => [r.dataset.kind, r.dataset.tokens || null])")
    kinds = [k for k, _ in bars]
    assert kinds[0] == "queue" and kinds[-1] == "finish"
    assert [int(t) for k, t in bars if k == "prefill"] == [PREFILL_CHUNK, PREFILL_CHUNK, 40 - 2 * PREFILL_CHUNK]
    # The first token comes from the last chunk; the decode runs made the other three.
    assert sum(int(t) for k, t in bars if k == "decode") == 3
    engine_tl = httpx.get(f"{url}/v1/requests/{ids[0]}/timeline", headers=auth("team-a")).json()
    assert kinds.count("prefill") == sum(e["event"] == "prefill" for e in engine_tl["sequences"][0]["events"])

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The key was asked for once: a reload goes straight to the board.
    browser.refresh()
    finished = str(want["requests-finished"] + 1)  # and the repeating prompt's request
    wait_for(lambda: _shown(browser, "board") and _text(browser, "requests-finished") == finished, 30,
             what="the board after a reload")
    assert not _shown(browser, "key-form")
