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
from fusedserve.service.engine.state import ServiceState, get_engine, get_state
from fusedserve.service.http import v2_body
from fusedserve.service.http.codec import read_body
from fusedserve.service.http.inference import infer

router = APIRouter(prefix="/v2", tags=["open inference protocol"])

State = Annotated[ServiceState, Depends(get_state)]
EngineDep = Annotated[Engine, Depends(get_engine)]


@router.get("", summary="Server metadata")
async def server_metadata() -> dict:
    return {"name": tensors.SERVER_NAME, "version": tensors.SERVER_VERSION, "extensions": list(tensors.EXTENSIONS)}


@router.get("/models/{model}", summary="Model metadata")
@router.get("/models/{model}/versions/{version}", include_in_schema=False)
async def model_metadata(engine: EngineDep, model: str, version: str | None = None) -> dict:
    return tensors.metadata(v2_body.model_info(engine, model, version))


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
    info = v2_body.model_info(engine, model, version)
    c = await engine.model_counts(info.name)

    def ns(seconds: float) -> int:
        return int(seconds * 1e9)

    return {"model_stats": [{
        "name": info.name, "version": info.version, "last_inference": c["last_inference_ms"],
        "inference_count": c["rows"], "execution_count": c["batches"],
        "inference_stats": {
            "success": {"count": c["success"], "ns": ns(c["success_s"])},
            "fail": {"count": c["failures"], "ns": ns(c["failure_s"])},
            "queue": {"count": c["wait_count"], "ns": ns(c["wait_total_s"])},
            "compute_infer": {"count": c["batches"], "ns": ns(c["compute_s"])},
        },
        "batch_stats": [{"batch_size": int(size), "compute_infer": {"count": count}}
                        for size, count in sorted(c["batch_sizes"].items())],
    }]}
