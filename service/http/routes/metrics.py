"""GET /metrics in the Prometheus text format, from the engine's registry (whichever process it runs in)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fusedserve.service.engine.client import Engine
from fusedserve.service.http.dependencies import get_engine

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(engine: Annotated[Engine, Depends(get_engine)]) -> Response:
    return Response(await engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)
