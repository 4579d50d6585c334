"""The KServe v2 REST inference bodies, read by the v2 route and by the hot path alike: the model a
request's path names, the JSON header and the binary tensor data extension's bytes after it to float32
rows, and the answer as JSON tensors or binary ones; and the bodies of the Triton extensions tools read
first (model configuration, statistics, the extensions served), which gRPC's codec turns into its
messages. The tensor rules are ``service.tensors``'s."""

from __future__ import annotations

import numpy as np

from fusedserve.service import classification, tensors
from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.errors import BadInput
from fusedserve.service.http.codec import as_array, check_rows, dump_json, parse_json
from fusedserve.service.tensors import OUTPUT

HEADER_LENGTH = "inference-header-content-length"


def model_info(engine: Engine, name: str, version: str | None) -> ModelInfo:
    """The named model (None: the only one) at ``version`` (None: any), or NotReady/UnknownModel."""
    info = engine.model(name)
    tensors.check_version(info, version)
    return info


def extensions(control_served: bool) -> list[str]:
    """``tensors.EXTENSIONS`` less model_repository where no model control answers (a front end of
    --workers N): server metadata lists only what answers."""
    return [e for e in tensors.EXTENSIONS if control_served or e != "model_repository"]


def model_config(info: ModelInfo, max_batch_size: int, max_delay_ms: float) -> dict:
    """Triton's model configuration (its HTTP JSON; ``ParseDict`` makes gRPC's ``ModelConfig``) from
    the model's metadata: dims leave out the batch dimension, which ``max_batch_size`` implies."""
    meta = tensors.metadata(info)

    def tensor(t: dict) -> dict:
        return {"name": t["name"], "data_type": f"TYPE_{t['datatype']}", "dims": t["shape"][1:]}

    return {"name": meta["name"], "platform": meta["platform"], "backend": tensors.SERVER_NAME,
            "max_batch_size": max_batch_size,
            "input": [tensor(t) for t in meta["inputs"]], "output": [tensor(t) for t in meta["outputs"]],
            # the batcher waits at most --max-delay-ms for a batch to fill; it has no preferred sizes
            "dynamic_batching": {"max_queue_delay_microseconds": round(max_delay_ms * 1000)}}


async def statistics(engine: Engine, infos: list[ModelInfo]) -> dict:
    """Triton's statistics response (HTTP JSON; ``ParseDict`` makes gRPC's) for ``infos``."""

    def ns(seconds: float) -> int:
        return int(seconds * 1e9)

    stats = []
    for info in infos:
        c = await engine.model_counts(info.name)
        stats.append({
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
        })
    return {"model_stats": stats}


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data after it (empty without the extension)."""
    if header_length is None:
        return body, memoryview(b"")
    if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(body):
        raise BadInput(f"Inference-Header-Content-Length {header_length!r} must be the byte length "
                       f"of the JSON header, at most the body length {len(body)}")
    n = int(header_length)
    return body[:n], memoryview(body)[n:]


def _parse_infer(body: bytes, header_length: str | None, info: ModelInfo, max_rows: int) -> tuple[dict, np.ndarray]:
    """The request's JSON header and its one input as checked float32 rows: the decoding, once."""
    header, blob = _split_body(body, header_length)
    req = parse_json(header)
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or len(req["inputs"]) != 1:
        raise BadInput(f'body must be {{"inputs": [{{"name": "{tensors.INPUT}", "shape": [rows, {info.in_features}], '
                       f'"datatype": "FP32", "data": [...]}}]}}: {tensors.expected(info)}')
    spec = req["inputs"][0]
    if not isinstance(spec, dict):
        raise BadInput("inputs[0] must be an object with name, shape, datatype and data")
    dtype, shape = tensors.check_input(spec.get("name"), spec.get("datatype"), spec.get("shape"), info, "inputs[0]")
    params = _object(spec.get("parameters"), "inputs[0].parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0:
            raise BadInput(f"inputs[0].parameters.binary_data_size must be a byte count, got {size!r}")
        if size > len(blob):
            raise BadInput(f"inputs[0] declares binary_data_size {size} but only {len(blob)} bytes follow "
                           "the JSON header")
        x = tensors.from_bytes(blob[:size], dtype, shape, "inputs[0] binary data")
    else:
        data = spec.get("data")
        if not isinstance(data, list):
            raise BadInput("inputs[0] needs data (a flat or nested list of numbers) or binary_data_size")
        x = tensors.from_values(as_array(data, "inputs[0].data", "a list of numbers"), shape, "inputs[0].data")
    return req, check_rows(x, "inputs[0]", info.in_features, max_rows)


def _object(value: object, where: str) -> dict:
    """``value`` if it is a JSON object (absent or null: an empty one), else BadInput."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{where} must be an object, got {type(value).__name__}")
    return value


def _wants_binary(req: dict) -> bool:
    outputs = req.get("outputs")
    if outputs is not None and not isinstance(outputs, list):
        raise BadInput(f'"outputs" must be a list of objects like {{"name": "{OUTPUT}"}}, got {type(outputs).__name__}')
    wanted = _object(req.get("parameters"), "parameters").get("binary_data_output", False)
    for i, spec in enumerate(outputs or []):
        spec = _object(spec, f"outputs[{i}]")
        if spec.get("name") not in (None, OUTPUT):
            raise BadInput(f"unknown output {spec.get('name')!r}: this model has one output, {OUTPUT!r}")
        params = _object(spec.get("parameters"), f"outputs[{i}].parameters")
        if "binary_data" in params:
            wanted = params["binary_data"]
    return bool(wanted)


def _class_count(req: dict, info: ModelInfo) -> int | None:
    """The classes the request asks for (``classification`` on its output), checked; None: raw outputs."""
    for i, spec in enumerate(req.get("outputs") or []):  # (each checked an object by _wants_binary)
        params = _object(_object(spec, "").get("parameters"), "")
        if classification.PARAMETER in params:
            where = f"outputs[{i}].parameters.{classification.PARAMETER}"
            return classification.check_count(params[classification.PARAMETER], info, where)
    return None


def decode(state: ServiceState, info: ModelInfo, body: bytes, header_length: str | None
           ) -> tuple[dict, np.ndarray, bool]:
    """The request's JSON header, its float32 rows for ``info``'s model and whether it asks for
    binary outputs; BadInput for anything wrong, before anything is computed."""
    req, x = _parse_infer(body, header_length, info, state.settings.rows_per_request)
    binary = _wants_binary(req)
    _class_count(req, info)
    return req, x, binary


def encode(info: ModelInfo, req: dict, binary: bool, out: np.ndarray) -> tuple[bytes, str, dict]:
    """(body, media type, extra headers) of the answer: JSON tensors, or the binary extension; the
    top classes as strings where the request asks for them (``service.classification``)."""
    k = _class_count(req, info)
    datatype, shape = (tensors.OUTPUT_DATATYPE, list(out.shape)) if k is None else \
        (classification.DATATYPE, [out.shape[0], k])
    result = {"model_name": info.name, "model_version": info.version,
              "outputs": [{"name": OUTPUT, "datatype": datatype, "shape": shape}]}
    if "id" in req:
        result["id"] = req["id"]
    classes = None if k is None else classification.strings(out, k, info.labels)
    if not binary:
        result["outputs"][0]["data"] = np.ascontiguousarray(out).ravel() if classes is None else classes
        return dump_json(result), "application/json", {}
    raw = np.ascontiguousarray(out, dtype=np.float32).tobytes() if classes is None else \
        classification.bytes_tensor(classes)
    result["outputs"][0]["parameters"] = {"binary_data_size": len(raw)}
    header = dump_json(result)
    return header + raw, "application/octet-stream", {"Inference-Header-Content-Length": str(len(header))}

