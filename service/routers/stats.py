"""Live kernel timings: GET /kernel-stats, POST /kernel-stats/reset."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from service.state import ServiceState, get_state

router = APIRouter(prefix="/kernel-stats", tags=["stats"])


@router.get("", summary="Per-layer kernel timings, batch sizes and queue waits")
async def kernel_stats(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    snap = state.stats.snapshot()
    snap["served"] = {name: {"in_features": m.in_features, "out_features": m.out_features,
                             "dtype": m.dtype, "backend": m.backend, "device": m.device}
                      for name, m in state.models.items()}
    return snap


@router.post("/reset", summary="Clear every timing and histogram")
async def reset_kernel_stats(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    state.stats.reset()
    return {"reset": True}
