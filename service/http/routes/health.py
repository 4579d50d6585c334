"""Liveness and readiness probes (Open Inference Protocol paths, plus /healthz and /readyz)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from fusedserve.service.engine.client import Engine
from fusedserve.service.http.dependencies import get_engine

router = APIRouter(tags=["health"])
EngineDep = Annotated[Engine, Depends(get_engine)]


@router.get("/v2/health/live", summary="The process is up")
@router.get("/healthz", include_in_schema=False)
async def live(engine: EngineDep) -> JSONResponse:
    # A dead batch loop cannot recover in-process, nor can a front end whose engine process is gone
    # and not yet back: failing liveness gets the process (or pod) restarted.
    if not engine.live():
        return JSONResponse({"live": False, "error": engine.reason()}, status_code=503)
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="Models are loaded and warm, and the server is not draining")
@router.get("/readyz", include_in_schema=False)
async def ready(engine: EngineDep) -> JSONResponse:
    if engine.ready():
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "error": engine.reason()}, status_code=503, headers={"Retry-After": "1"})
