"""GET /metrics in the Prometheus text format, from this app's own registry."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fusedserve.service.state import ServiceState, get_state

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(state: Annotated[ServiceState, Depends(get_state)]) -> Response:
    state.collect_timings()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
