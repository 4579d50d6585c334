"""Liveness and readiness probes (Open Inference Protocol paths, plus /healthz and /readyz)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from fusedserve.service.state import ServiceState, get_state

router = APIRouter(tags=["health"])


@router.get("/v2/health/live", summary="The process is up")
@router.get("/healthz", include_in_schema=False)
async def live(state: Annotated[ServiceState, Depends(get_state)]) -> JSONResponse:
    # A dead batch loop cannot recover in-process: failing liveness gets the process restarted.
    stalled = state.stalled
    if stalled:
        return JSONResponse({"live": False, "error": f"the batch loop stopped for {stalled}"}, status_code=503)
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="Models are loaded and warm, and the server is not draining")
@router.get("/readyz", include_in_schema=False)
async def ready(state: Annotated[ServiceState, Depends(get_state)]) -> JSONResponse:
    if state.ready:
        return JSONResponse({"ready": True})
    reason = ("draining" if state.draining else
              f"start-up failed: {state.startup_error}" if state.startup_error else
              f"the batch loop stopped for {state.stalled}" if state.stalled else "warming up")
    return JSONResponse({"ready": False, "error": reason}, status_code=503, headers={"Retry-After": "1"})
