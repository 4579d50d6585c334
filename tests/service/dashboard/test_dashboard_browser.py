"""The live page in a real headless browser (Debian's chromium and chromium-driver, driven by selenium)
against a real ``fusedserve serve`` on a loopback port: it loads with no console errors, lists the
served models, its figures move after a burst of requests, and its reset button clears them.

Skips, saying what is missing, without chromium, chromedriver or selenium; ``make browser-test``
installs them where it can and fails instead of skipping (FUSEDSERVE_REQUIRE_BROWSER=1). The
screenshot goes to FUSEDSERVE_DASHBOARD_SCREENSHOT (``make browser-test``: docs/dashboard_cpu.png)."""

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from fusedserve.service.stats.peaks import gpu_peaks
from tools.dashboard_shot import browser_paths, capture, chrome, full_page_png, replay

from ..conftest import Server, write_repository

pytestmark = pytest.mark.slow
KEY = "s3cret"
# Stands in for the API-key auth of the server: every fetch without this key answers 401.
FAKE_AUTH = """
window.__sent = [];
const realFetch = window.fetch.bind(window);
window.fetch = (url, options = {}) => {
  const auth = new Headers(options.headers || {}).get("Authorization");
  window.__sent.push([String(url), auth]);
  if (auth !== "Bearer %s") return Promise.resolve(new Response(
    JSON.stringify({error: "missing or wrong API key"}), {status: 401, headers: {"Content-Type": "application/json"}}));
  return realFetch(url, options);
};
""" % KEY


def _missing() -> list[str]:
    binary, driver = browser_paths()
    missing = [name for name, path in (("chromium", binary), ("chromedriver (chromium-driver)", driver)) if not path]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    return missing


@pytest.fixture(scope="module")
def browser():
    missing = _missing()
    if missing:
        why = f"the browser test needs {', '.join(missing)}; Debian: apt-get install chromium chromium-driver"
        if os.environ.get("FUSEDSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    driver = chrome()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = write_repository(tmp_path_factory.mktemp("repo"))
    s = Server(repo, tmp_path_factory.mktemp("log") / "server.log", "--max-batch-size", "16")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _wait(driver, what: str, check, timeout_s: float = 20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = check(driver)
        if got:
            return got
        time.sleep(0.1)
    status = driver.find_element("id", "status").text
    raise AssertionError(f"the page never showed {what} (status line: {status!r})")


# The page redraws its figures on every poll: read it in one script, never through held elements.
def _field(driver, model: str, field: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : ''",
                                 f'section[data-model="{model}"] [data-field="{field}"]')


def _count(driver, selector: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length", selector)


def _burst(server, ok: int, bad: int) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for i in range(ok):
            r = c.post("/infer", json={"model": "tiny" if i % 4 else "wide",
                                       "inputs": [[0.1 * i] * (3 if i % 4 else 5)] * (1 + i % 3)})
            assert r.status_code == 200, r.text
        for _ in range(bad):
            assert c.post("/infer", json={"model": "tiny", "inputs": [[1.0]]}).status_code == 422


def test_page_lists_models_moves_under_load_and_resets(browser, server, tmp_path):
    httpx.post(server.url + "/kernel-stats/reset", timeout=10)
    browser.get(server.url + "/")
    assert browser.current_url == server.url + "/dashboard", browser.current_url
    names = _wait(browser, "the served models", lambda d: d.execute_script(
        "return [...document.querySelectorAll('section.model')].map(s => s.dataset.model)"))
    assert names == ["tiny", "wide"], names
    assert _field(browser, "tiny", "requests") == "0" and _field(browser, "tiny", "errors") == "none"
    devices = browser.find_element("id", "devices").text
    assert "CPU" in devices and "estimate" in devices

    _burst(server, ok=40, bad=3)  # tiny: 30 answered + 3 refused; wide: 10
    _wait(browser, "33 requests to tiny", lambda d: _field(d, "tiny", "requests") == "33")
    assert _field(browser, "wide", "requests") == "10"
    assert _field(browser, "tiny", "errors") == "422 ×3", _field(browser, "tiny", "errors")
    assert _field(browser, "tiny", "latency-p50") not in ("", "–")
    tiny = 'section[data-model="tiny"] '
    _wait(browser, "timed layers of tiny", lambda d: _count(d, tiny + 'table[data-table="layers"] tbody tr'))
    assert _count(browser, tiny + 'svg[data-chart="roofline"] circle'), "no layer on the roofline"
    assert _count(browser, tiny + 'svg[data-chart="batch-sizes"] rect.bar'), "no batch-size bars"
    shot = Path(os.environ.get("FUSEDSERVE_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    assert full_page_png(browser, shot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    browser.find_element("id", "pause").click()  # paused, the page holds its figures...
    _burst(server, ok=4, bad=0)  # tiny: 3 more
    time.sleep(2.5)
    assert _field(browser, "tiny", "requests") == "33", "the page redrew while paused"
    browser.find_element("id", "pause").click()  # ...and catches up once resumed
    _wait(browser, "36 requests to tiny", lambda d: _field(d, "tiny", "requests") == "36")

    browser.find_element("id", "reset").click()
    _wait(browser, "the figures cleared", lambda d: _field(d, "tiny", "requests") == "0")
    assert _field(browser, "tiny", "errors") == "none" and _field(browser, "wide", "requests") == "0"
    assert not _count(browser, 'table[data-table="layers"]'), "layer rows survived the reset"
    assert "error" not in browser.find_element("id", "status").get_attribute("class")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"console errors: {errors}"


def test_a_capture_replays_into_the_page(browser, server, tmp_path):
    # How a GPU host's figures reach a screenshot: saved there, drawn here by the same page. The
    # capture is dressed as an H200's whose buckets are provisional or tuned (the startup work).
    _burst(server, ok=8, bad=1)
    end = time.monotonic() + 10  # layer timings are sampled (at most one per min_interval_s)
    while not any(r["model"] == "tiny" for r in httpx.get(server.url + "/kernel-stats").json()["layers"]):
        assert time.monotonic() < end, "no layer of tiny timed"
        _burst(server, ok=2, bad=0)
        time.sleep(0.05)
    data = capture(server.url, tmp_path / "capture.json")
    requests = data["model_stats"]["models"]["tiny"]["requests"]
    assert requests >= 7, data["model_stats"]
    for model in data["model_stats"]["models"].values():
        model["device"] = "cuda:0"
    data["model_stats"]["devices"] = {"cuda:0": gpu_peaks("NVIDIA H200")}
    tiny_layers = [r for r in data["kernel_stats"]["layers"] if r["model"] == "tiny"]
    buckets = sorted({r["M"] for r in tiny_layers})
    data["kernel_stats"]["served"]["tiny"]["choices"] = {str(b): "provisional" if i % 2 else "tuned"
                                                         for i, b in enumerate(buckets)}
    (tmp_path / "h200.json").write_text(json.dumps(data))
    png = replay(tmp_path / "h200.json", tmp_path / "replay.png", driver=browser)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _field(browser, "tiny", "requests") == str(requests)
    assert "replayed" in browser.find_element("id", "status").text
    device = browser.execute_script("const p = document.querySelector('[data-device=\"cuda:0\"]');"
                                    "return [p.textContent, p.querySelector('.estimate') !== null]")
    assert "NVIDIA H200" in device[0] and "797 TFLOP/s bfloat16" in device[0] and not device[1], device
    choices = browser.execute_script("return [...document.querySelectorAll("
                                     "'section[data-model=\"tiny\"] td[class^=choice-]')].map(c => c.textContent)")
    want = [data["kernel_stats"]["served"]["tiny"]["choices"][str(r["M"])] for r in tiny_layers]
    assert choices == want, (choices, want)
    assert not _count(browser, 'section[data-model="wide"] td[class^=choice-]'), "wide reports no choices"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"console errors: {errors}"


@pytest.fixture
def fake_auth(browser):
    """Every page loaded while this lives answers its fetches 401 unless they carry KEY."""
    script = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FAKE_AUTH})
    yield
    browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]})
    browser.execute_script("sessionStorage.clear()")


def test_page_asks_for_the_key_on_401_and_sends_it(browser, server, fake_auth):
    browser.get(server.url + "/dashboard")
    _wait(browser, "the key prompt", lambda d: d.find_element("id", "auth").is_displayed())
    assert not _count(browser, "section.model")
    browser.find_element("id", "key").send_keys(KEY)
    browser.find_element("css selector", "#auth button[type=submit]").click()
    _wait(browser, "the models once the key was given", lambda d: _count(d, "section.model"))
    assert not browser.find_element("id", "auth").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('fusedserve-api-key')") == KEY
    browser.find_element("id", "reset").click()
    _wait(browser, "the reset sent", lambda d: any(
        "reset" in url for url, _ in d.execute_script("return window.__sent")))
    sent = browser.execute_script("return window.__sent")
    first_keyed = next(i for i, (_, auth) in enumerate(sent) if auth)
    assert all(auth == f"Bearer {KEY}" for _, auth in sent[first_keyed:]), sent
    browser.refresh()  # the key outlives a reload of the tab: no prompt again
    _wait(browser, "the models after a reload", lambda d: _count(d, "section.model"))
    assert not browser.find_element("id", "auth").is_displayed()
