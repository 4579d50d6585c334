"""The live page of a server with two CPU engines (``--devices cpu,cpu``), in a real headless browser
(tests/service/dashboard/test_dashboard_browser.py's, skipped as it is): each model's totals, and a row per
device whose requests add up to them."""

import httpx
import pytest

from ..conftest import Server, write_repository
from .test_dashboard_browser import _count, _field, _wait, browser  # noqa: F401 - browser is a fixture

pytestmark = pytest.mark.slow
ROWS = ("return [...document.querySelectorAll('section[data-model=\"tiny\"] table[data-table=\"devices\"] tbody tr')]"
        ".map(r => [r.dataset.device, r.querySelector('[data-field=\"requests\"]').textContent])")


@pytest.mark.timeout(90)
def test_page_shows_each_device_and_the_totals(browser, tmp_path):  # noqa: F811 - the imported fixture
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--devices", "cpu,cpu",
               "--workers", "1")
    try:
        s.wait_ready()
        browser.get(s.url + "/dashboard")
        _wait(browser, "the served models", lambda d: _count(d, "section.model") == 2)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for i in range(20):  # one after another: the engines take turns
                assert c.post("/infer", json={"model": "tiny", "inputs": [[0.1 * i, 1.0, 2.0]]}).status_code == 200
        _wait(browser, "20 requests to tiny", lambda d: _field(d, "tiny", "requests") == "20")
        rows = _wait(browser, "a row per device", lambda d: d.execute_script(ROWS))
        assert [device for device, _ in rows] == ["cpu:0", "cpu:1"], rows
        assert sum(int(n) for _, n in rows) == 20 and all(int(n) > 0 for _, n in rows), rows
        assert "cpu:0,cpu:1" in browser.find_element("css selector", 'section[data-model="tiny"] .meta').text
        assert _count(browser, 'section[data-model="tiny"] svg[data-chart="roofline"]'), "no roofline: no peaks"
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, f"console errors: {errors}"
    finally:
        s.stop()
