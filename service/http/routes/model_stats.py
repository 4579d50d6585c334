"""GET /model-stats: per model what a person watching the service asks first (request rate, latency
p50/p99, queue depth, errors by HTTP status) and the peak rates of the devices the models run on;
built by ``service.stats.model_stats`` where the models are."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from fusedserve.service.engine.client import Engine
from fusedserve.service.http.dependencies import get_engine

router = APIRouter(tags=["stats"])


@router.get("/model-stats", summary="Per model: request rate, latency, queue depth, errors by status")
async def model_stats(engine: Annotated[Engine, Depends(get_engine)]) -> dict:
    return await engine.model_stats()
