"""Live kernel timings: GET /kernel-stats, POST /kernel-stats/reset (the engine's, whichever process
it runs in)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from fusedserve.service.engine.client import Engine
from fusedserve.service.http.dependencies import get_engine

router = APIRouter(prefix="/kernel-stats", tags=["stats"])


@router.get("", summary="Per-layer kernel timings, batch sizes and queue waits")
async def kernel_stats(engine: Annotated[Engine, Depends(get_engine)]) -> dict:
    return await engine.kernel_stats()


@router.post("/reset", summary="Clear every timing and histogram")
async def reset_kernel_stats(engine: Annotated[Engine, Depends(get_engine)]) -> dict:
    await engine.reset_stats()
    return {"reset": True}
