"""POST /infer: rows through a model; the body and the answer are ``http.infer_body``'s."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from fusedserve.service.engine.state import ServiceState
from fusedserve.service.http import infer_body
from fusedserve.service.http.codec import read_body
from fusedserve.service.http.dependencies import get_state
from fusedserve.service.http.inference import infer

router = APIRouter(tags=["inference"])


# Its body, answer and example in the OpenAPI document: routes.openapi (the body is read raw, unvalidated).
@router.post("/infer", summary="Run rows through a model")
async def infer_route(request: Request, state: Annotated[ServiceState, Depends(get_state)]) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    info, inputs, top_k = infer_body.parse(request.app.state.engine, raw)
    request.state.model = info.name
    x = infer_body.rows(state, info, inputs, raw)
    out = await infer(state, request, info.name, x)
    return Response(infer_body.encode(info, out, top_k), media_type="application/json")
