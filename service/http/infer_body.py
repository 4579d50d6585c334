"""The ``POST /infer`` body, ``{"model": optional, "inputs": [[...], ...], "top_k": optional}``, to the model,
its float32 rows and the classes asked for, and the answer, ``{"model", "outputs"[, "classes"]}``; read by the
route and by the hot path alike."""

from __future__ import annotations

import numpy as np

from fusedserve.service import classification
from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.errors import BadInput
from fusedserve.service.http.codec import check_rows, dump_json, parse_json, rows_from_json, simd_rows


def parse(engine: Engine, raw: bytes) -> tuple[ModelInfo, object, int | None]:
    """The model a ``/infer`` body names, its "inputs" (float64 rows when they are well formed, else
    as parsed) and its "top_k" (None: not asked), or BadInput/UnknownModel/NotReady."""
    fast = simd_rows(raw, "inputs") if b'"top_k"' not in raw else None
    if fast is not None and (fast[0] is None or isinstance(fast[0], str)):
        return engine.model(fast[0]), fast[1], None
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadInput('body must be a JSON object like {"model": "digits", "inputs": [[...], ...]}')
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise BadInput(f'"model" must be a string, got {type(name).__name__}')
    if "inputs" not in body:
        raise BadInput('body has no "inputs": send {"inputs": [[...], ...]}, one list of numbers per row')
    info = engine.model(name)
    k = body.get(classification.TOP_K)
    return info, body["inputs"], None if k is None else classification.check_count(k, info, '"top_k"')


def rows(state: ServiceState, info: ModelInfo, inputs, raw: bytes) -> np.ndarray:
    """The "inputs" (parsed from body ``raw``) as float32 rows of ``info``'s width, or BadInput."""
    if isinstance(inputs, np.ndarray):
        return check_rows(inputs, "inputs", info.in_features, state.settings.rows_per_request)
    return rows_from_json(inputs, "inputs", info.in_features, state.settings.rows_per_request, raw)


def encode(info: ModelInfo, out: np.ndarray, top_k: int | None = None) -> bytes:
    answer = {"model": info.name, "outputs": np.ascontiguousarray(out)}
    if top_k is not None:
        answer["classes"] = classification.classes(out, top_k, info.labels)
    return dump_json(answer)
