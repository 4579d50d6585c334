"""Open Inference Protocol (KServe v2) REST routes, with the binary tensor data extension, so
``tritonclient.http`` and KServe clients work unmodified. The inference bodies are ``http.v2_body``'s;
the tensor rules (one input "input", one output "output", version "1") are ``service.tensors``, shared
with the gRPC servicer."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from fusedserve.service import tensors
from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ServiceState
from fusedserve.service.http import v2_body
from fusedserve.service.http.codec import read_body
from fusedserve.service.http.dependencies import get_engine, get_state
from fusedserve.service.http.inference import infer

router = APIRouter(prefix="/v2", tags=["open inference protocol"])

State = Annotated[ServiceState, Depends(get_state)]
EngineDep = Annotated[Engine, Depends(get_engine)]


@router.get("", summary="Server metadata")
async def server_metadata(request: Request) -> dict:
    return {"name": tensors.SERVER_NAME, "version": tensors.SERVER_VERSION,
            "extensions": v2_body.extensions(request.app.state.control is not None)}


# Before /models/{model}: Triton's path for every model's statistics (tritonclient's model name "").
@router.get("/models/stats", summary="Inference statistics of every model (Triton's format)")
async def all_model_stats(engine: EngineDep) -> dict:
    return await v2_body.statistics(engine, list(engine.models().values()))


@router.get("/models/{model}", summary="Model metadata")
@router.get("/models/{model}/versions/{version}", include_in_schema=False)
async def model_metadata(engine: EngineDep, model: str, version: str | None = None) -> dict:
    return tensors.metadata(v2_body.model_info(engine, model, version))


@router.get("/models/{model}/config", summary="Model configuration (Triton's, for perf_analyzer and model_analyzer)")
@router.get("/models/{model}/versions/{version}/config", include_in_schema=False)
async def model_config(state: State, engine: EngineDep, model: str, version: str | None = None) -> dict:
    settings = state.settings
    return v2_body.model_config(v2_body.model_info(engine, model, version), settings.rows_per_request,
                                settings.max_delay_ms)


@router.get("/models/{model}/ready", summary="Model readiness")
@router.get("/models/{model}/versions/{version}/ready", include_in_schema=False)
async def model_ready(engine: EngineDep, model: str, version: str | None = None) -> JSONResponse:
    failed = engine.failed()
    if model in failed:  # loaded no further: not ready, and why
        return JSONResponse({"name": model, "ready": False, "error": failed[model]}, status_code=503)
    info = v2_body.model_info(engine, model, version)
    ok = engine.ready()
    return JSONResponse({"name": info.name, "ready": ok}, status_code=200 if ok else 503)


@router.post("/models/{model}/infer", summary="Inference (JSON or binary tensors)")
@router.post("/models/{model}/versions/{version}/infer", include_in_schema=False)
async def model_infer(request: Request, state: State, engine: EngineDep, model: str,
                      version: str | None = None) -> Response:
    info = v2_body.model_info(engine, model, version)
    request.state.model = info.name
    body = await read_body(request, state.settings.max_body_bytes)
    req, x, binary = v2_body.decode(state, info, body, request.headers.get(v2_body.HEADER_LENGTH))
    out = await infer(state, request, info.name, x)
    content, media_type, headers = v2_body.encode(info, req, binary, out)
    return Response(content, media_type=media_type, headers=headers)


@router.get("/models/{model}/stats", summary="Inference statistics (Triton's format)")
@router.get("/models/{model}/versions/{version}/stats", include_in_schema=False)
async def model_stats(engine: EngineDep, model: str, version: str | None = None) -> dict:
    return await v2_body.statistics(engine, [v2_body.model_info(engine, model, version)])
