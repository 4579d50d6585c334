"""The ``POST /infer`` body, ``{"model": optional, "inputs": [[...], ...]}``, to the model and its float32
rows, and the answer, ``{"model", "outputs"}``; read by the route and by the hot path alike."""

from __future__ import annotations

import numpy as np

from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.errors import BadInput
from fusedserve.service.http.codec import check_rows, dump_json, parse_json, rows_from_json, simd_rows


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
