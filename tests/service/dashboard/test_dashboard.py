"""The live page's routes in memory: / redirecting to /dashboard, and its assets served from the package."""

import re

import pytest

from fusedserve.service.http.routes import dashboard


async def test_root_redirects_to_the_page(client):
    r = await client.get("/")
    assert r.status_code == 302 and r.headers["location"] == "dashboard", (r.status_code, r.headers)
    r = await client.get("/", follow_redirects=True)
    assert r.status_code == 200 and str(r.url) == "http://localhost/dashboard", r.url


async def test_page_and_its_assets_are_served_from_the_package(client):
    r = await client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.headers
    html = r.text
    for name, media in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        assert f'"dashboard/{name}"' in html, f"the page does not load {name}"
        a = await client.get(f"/dashboard/{name}")
        assert a.status_code == 200 and a.headers["content-type"].startswith(media), (name, a.headers)
        assert a.headers["cache-control"] == "no-cache"
    for name in ("nope.js", "index.html", "..%2Fapp.py"):
        r = await client.get(f"/dashboard/{name}")
        assert r.status_code == 404 and "error" in r.json(), (name, r.text)


@pytest.mark.parametrize("name", sorted(dashboard.ASSETS))
def test_assets_fetch_nothing_from_the_network(name):
    # Offline machines serve this page: every URL in it is relative to the server itself.
    text = dashboard.asset(name).decode()
    urls = re.findall(r"(?:https?:)?//[\w.-]+\.\w+", text)
    assert all(u == "http://www.w3.org" for u in urls), f"{name} names outside hosts: {urls}"
    assert len(text) < 20_000, f"{name} is {len(text)} bytes: keep the page small"
