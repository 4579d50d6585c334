"""Open Inference Protocol (KServe v2) REST routes, with the binary tensor data extension, so
``tritonclient.http`` and KServe clients work unmodified. Each model has one input ("input",
FP32 [-1, in_features]) and one output ("output", FP32 [-1, out_features]), version "1"."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from fusedserve.service.errors import BadInput, UnknownModel
from fusedserve.service.inference import infer
from fusedserve.service.inputs import check_rows, dump_json, parse_json, read_body
from fusedserve.service.state import ModelInfo, ServiceState, get_state

router = APIRouter(prefix="/v2", tags=["open inference protocol"])

VERSION = "1"
INPUT, OUTPUT = "input", "output"
HEADER_LENGTH = "inference-header-content-length"
DATATYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16,
             "INT32": np.int32, "INT64": np.int64, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8}

State = Annotated[ServiceState, Depends(get_state)]


def _model(state: ServiceState, name: str, version: str | None) -> ModelInfo:
    info = state.model(name)
    if version is not None and version != VERSION:
        raise UnknownModel(f"model {name!r} has only version {VERSION!r}, not {version!r}")
    return info


@router.get("", summary="Server metadata")
async def server_metadata() -> dict:
    return {"name": "fusedserve", "version": "0.1.0", "extensions": ["binary_tensor_data", "statistics"]}


@router.get("/models/{model}", summary="Model metadata")
@router.get("/models/{model}/versions/{version}", include_in_schema=False)
async def model_metadata(state: State, model: str, version: str | None = None) -> dict:
    info = _model(state, model, version)
    return {
        "name": info.name, "versions": [VERSION], "platform": f"fusedserve_{info.backend}",
        "inputs": [{"name": INPUT, "datatype": "FP32", "shape": [-1, info.in_features]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, info.out_features]}],
    }


@router.get("/models/{model}/ready", summary="Model readiness")
@router.get("/models/{model}/versions/{version}/ready", include_in_schema=False)
async def model_ready(state: State, model: str, version: str | None = None) -> JSONResponse:
    info = _model(state, model, version)
    ok = state.ready
    return JSONResponse({"name": info.name, "ready": ok}, status_code=200 if ok else 503)


def _binary_input(spec: dict, blob: memoryview, offset: int, size: int, shape, dtype) -> np.ndarray:
    if offset + size > len(blob):
        raise BadInput(f"input {spec.get('name')!r} declares binary_data_size {size} but only "
                       f"{len(blob) - offset} bytes follow the JSON header")
    try:
        return np.frombuffer(blob[offset:offset + size], dtype=dtype).reshape(shape)
    except ValueError:
        raise BadInput(f"input {spec.get('name')!r}: {size} bytes of {np.dtype(dtype).name} do not fill "
                       f"shape {shape}") from None


def _parse_infer(body: bytes, header_length: str | None, info: ModelInfo, max_rows: int) -> tuple[dict, np.ndarray]:
    blob = memoryview(b"")
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadInput(f"Inference-Header-Content-Length {header_length!r} must be the byte length "
                           f"of the JSON header, at most the body length {len(body)}")
        n = int(header_length)
        blob = memoryview(body)[n:]
        body = body[:n]
    req = parse_json(body)
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or len(req["inputs"]) != 1:
        raise BadInput(f'body must be {{"inputs": [{{"name": "{INPUT}", "shape": [rows, {info.in_features}], '
                       f'"datatype": "FP32", "data": [...]}}]}} with exactly one input')
    spec = req["inputs"][0]
    if not isinstance(spec, dict):
        raise BadInput("inputs[0] must be an object with name, shape, datatype and data")
    shape = spec.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise BadInput(f"inputs[0].shape must be [rows, {info.in_features}], got {shape!r}")
    datatype = spec.get("datatype")
    if datatype not in DATATYPES:
        raise BadInput(f"inputs[0].datatype must be one of {sorted(DATATYPES)}, got {datatype!r}")
    params = spec.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadInput("inputs[0].parameters must be an object")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0:
            raise BadInput(f"inputs[0].parameters.binary_data_size must be a byte count, got {size!r}")
        x = _binary_input(spec, blob, 0, size, shape, DATATYPES[datatype])
    else:
        data = spec.get("data")
        if not isinstance(data, list):
            raise BadInput("inputs[0] needs data (a flat or nested list of numbers) or binary_data_size")
        if shape[0] == 0:
            raise BadInput(f"inputs[0] is empty: send at least one row of {info.in_features} numbers")
        flat = np.array(data)
        if flat.dtype.kind not in "iuf":
            raise BadInput("inputs[0].data must hold only numbers, nested evenly")
        if flat.size != shape[0] * shape[1]:
            raise BadInput(f"inputs[0].data has {flat.size} numbers but shape {shape} needs {shape[0] * shape[1]}")
        x = flat.reshape(shape)
    return req, check_rows(x, "inputs[0]", info.in_features, max_rows)


def _wants_binary(req: dict) -> bool:
    for spec in req.get("outputs") or []:
        if isinstance(spec, dict) and spec.get("name") not in (None, OUTPUT):
            raise BadInput(f"unknown output {spec.get('name')!r}: this model has one output, {OUTPUT!r}")
        if isinstance(spec, dict) and "binary_data" in (spec.get("parameters") or {}):
            return bool(spec["parameters"]["binary_data"])
    return bool((req.get("parameters") or {}).get("binary_data_output", False))


@router.post("/models/{model}/infer", summary="Inference (JSON or binary tensors)")
@router.post("/models/{model}/versions/{version}/infer", include_in_schema=False)
async def model_infer(request: Request, state: State, model: str, version: str | None = None) -> Response:
    info = _model(state, model, version)
    request.state.model = info.name
    body = await read_body(request, state.settings.max_body_bytes)
    req, x = _parse_infer(body, request.headers.get(HEADER_LENGTH), info, state.settings.rows_per_request)
    binary = _wants_binary(req)
    out = await infer(state, request, info.name, x)
    result = {"model_name": info.name, "model_version": VERSION,
              "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": list(out.shape)}]}
    if "id" in req:
        result["id"] = req["id"]
    if not binary:
        result["outputs"][0]["data"] = np.ascontiguousarray(out).ravel()
        return Response(dump_json(result), media_type="application/json")
    raw = np.ascontiguousarray(out, dtype=np.float32).tobytes()
    result["outputs"][0]["parameters"] = {"binary_data_size": len(raw)}
    header = dump_json(result)
    return Response(header + raw, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})


@router.get("/models/{model}/stats", summary="Inference statistics (Triton's format)")
@router.get("/models/{model}/versions/{version}/stats", include_in_schema=False)
async def model_stats(state: State, model: str, version: str | None = None) -> dict:
    info = _model(state, model, version)
    c = state.stats.model_counts(info.name)

    def ns(seconds: float) -> int:
        return int(seconds * 1e9)

    return {"model_stats": [{
        "name": info.name, "version": VERSION, "last_inference": c["last_inference_ms"],
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
