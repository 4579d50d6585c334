"""POST /infer: {"model": optional, "inputs": [[...], ...]} -> {"model", "outputs"}."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request, Response

from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ModelInfo, ServiceState, get_state
from fusedserve.service.errors import BadInput
from fusedserve.service.http.codec import check_rows, dump_json, parse_json, read_body, rows_from_json, simd_rows
from fusedserve.service.http.inference import infer

router = APIRouter(tags=["inference"])

# "model" may be left out when the server has one model; each row has in_features numbers.
_EXAMPLE = {"model": "mymodel", "inputs": [[0.5, 3.0, -1.25], [1.0, 0.0, 2.0]]}


@router.post(
    "/infer",
    summary="Run rows through a model",
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"example": _EXAMPLE}}}},
)
async def infer_route(request: Request, state: Annotated[ServiceState, Depends(get_state)]) -> Response:
    raw = await read_body(request, state.settings.max_body_bytes)
    info, inputs = parse(request.app.state.engine, raw)
    request.state.model = info.name
    x = rows(state, info, inputs, raw)
    return Response(encode(info, await infer(state, request, info.name, x)), media_type="application/json")


def parse(engine: Engine, raw: bytes) -> tuple[ModelInfo, object]:
    """The model a ``/infer`` body names and its "inputs" (float64 rows when they are well formed, else
    as parsed), or BadInput/UnknownModel/NotReady."""
    fast = simd_rows(raw, "inputs")
    if fast is not None and (fast[0] is None or isinstance(fast[0], str)):
        return engine.model(fast[0]), fast[1]
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadInput('body must be a JSON object like {"model": "digits", "inputs": [[...], ...]}')
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise BadInput(f'"model" must be a string, got {type(name).__name__}')
    if "inputs" not in body:
        raise BadInput('body has no "inputs": send {"inputs": [[...], ...]}, one list of numbers per row')
    return engine.model(name), body["inputs"]


def rows(state: ServiceState, info: ModelInfo, inputs, raw: bytes) -> np.ndarray:
    """The "inputs" (parsed from body ``raw``) as float32 rows of ``info``'s width, or BadInput."""
    if isinstance(inputs, np.ndarray):
        return check_rows(inputs, "inputs", info.in_features, state.settings.rows_per_request)
    return rows_from_json(inputs, "inputs", info.in_features, state.settings.rows_per_request, raw)


def encode(info: ModelInfo, out: np.ndarray) -> bytes:
    return dump_json({"model": info.name, "outputs": np.ascontiguousarray(out)})
