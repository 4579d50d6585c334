"""The live page: GET /dashboard (and / redirecting to it) with its script and style, shipped in the
package (service/dashboard/) and drawn in the browser from /model-stats and /kernel-stats. Nothing
is fetched from anywhere else, so it works on a machine with no network."""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response
from starlette.exceptions import HTTPException

router = APIRouter(tags=["dashboard"])

# The assets the page is made of, and their media types: nothing else under the folder is served.
ASSETS = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
# Revalidate on each load: a page left open across an upgrade picks up the new assets.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


@functools.cache
def asset(name: str) -> bytes:
    return (resources.files("fusedserve.service") / "dashboard" / name).read_bytes()


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("dashboard", status_code=302)  # relative: works under a path prefix


@router.get("/dashboard", summary="Live page: request rates, latencies, kernel timings, rooflines")
async def page() -> Response:
    return Response(asset("index.html"), media_type=ASSETS["index.html"], headers=_HEADERS)


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        raise HTTPException(404, f"no dashboard asset {name!r}; the page is at /dashboard")
    return Response(asset(name), media_type=ASSETS[name], headers=_HEADERS)
