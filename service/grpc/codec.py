"""KServe v2 gRPC messages to rows and back: a ``ModelInferRequest`` is decoded into checked float32
rows once, here, by ``service.tensors``' rules; outputs go back in ``raw_output_contents`` (what
Triton always sends and the only form ``tritonclient.grpc`` reads) when the input came raw, as
``tritonclient`` sends it, or in typed ``contents.fp32_contents`` when it came typed. A request
parameter ``binary_data_output`` (bool) chooses either way explicitly. Model configuration and
statistics are ``http.v2_body``'s JSON bodies parsed into their messages: one home for both protocols."""

from __future__ import annotations

import numpy as np
from google.protobuf import json_format

from fusedserve.service import classification, tensors
from fusedserve.service.engine.state import ModelInfo
from fusedserve.service.errors import BadInput
from fusedserve.service.grpc import inference_pb2 as pb
from fusedserve.service.http import v2_body
from fusedserve.service.http.codec import check_rows
from fusedserve.service.tensors import OUTPUT

# The InferTensorContents field that carries each datatype's typed values (FP16 has none: raw only).
TYPED_FIELDS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT8": "int_contents",
                "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                "UINT8": "uint_contents"}
RAW_OUTPUT = "binary_data_output"
# Triton's request parameter: the request's timeout in microseconds (tritonclient's `timeout=`).
TIMEOUT = "timeout"


def _typed_values(spec, dtype: np.dtype) -> np.ndarray:
    field = TYPED_FIELDS.get(spec.datatype)
    if field is None:
        raise BadInput(f"inputs[0] datatype {spec.datatype} has no typed contents field: send it in "
                       "raw_input_contents, or send FP32 in contents.fp32_contents")
    values = getattr(spec.contents, field)
    if not values:  # only a mistake costs a look at the other fields
        sent = [f.name for f, _ in spec.contents.ListFields()]
        if not sent:
            raise BadInput("inputs[0] has no data: send its values in contents.fp32_contents or raw_input_contents")
        raise BadInput(f"inputs[0] is {spec.datatype}, whose values go in contents.{field}; "
                       f"got contents.{', contents.'.join(sent)}")
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:  # e.g. 300 in int_contents of an INT8 input
        raise BadInput(f"inputs[0] holds values outside the range of {spec.datatype}") from None


def _raw_output(request, raw_input: bool) -> bool:
    if RAW_OUTPUT not in request.parameters:
        return raw_input
    param = request.parameters[RAW_OUTPUT]
    if param.WhichOneof("parameter_choice") != "bool_param":
        raise BadInput(f"parameter {RAW_OUTPUT} must be a bool (bool_param)")
    return param.bool_param


def decode(request, info: ModelInfo, max_rows: int) -> tuple[np.ndarray, bool]:
    """The request's input as C-contiguous float32 ``[rows, in_features]``, and whether the output
    goes in ``raw_output_contents``; BadInput (INVALID_ARGUMENT) saying what to fix otherwise."""
    if len(request.inputs) != 1:
        raise BadInput(f"send {tensors.expected(info)}; got {len(request.inputs)} inputs")
    spec = request.inputs[0]
    dtype, shape = tensors.check_input(spec.name, spec.datatype, tuple(spec.shape), info, "inputs[0]")
    raw = request.raw_input_contents
    if raw:
        if len(raw) != 1:
            raise BadInput(f"raw_input_contents must hold one entry per input (1), got {len(raw)}")
        if spec.HasField("contents"):
            raise BadInput("inputs[0] has both contents and raw_input_contents: send one of them")
        x = tensors.from_bytes(raw[0], dtype, shape, "raw_input_contents[0]")
    else:
        x = tensors.from_values(_typed_values(spec, dtype), shape, f"inputs[0].contents ({spec.datatype})")
    for out in request.outputs:
        if out.name != OUTPUT:
            raise BadInput(f"unknown output {out.name!r}: model {info.name!r} has one output, {OUTPUT!r}")
    _class_count(request, info)
    return check_rows(x, "inputs[0]", info.in_features, max_rows), _raw_output(request, bool(raw))


def _class_count(request, info: ModelInfo) -> int | None:
    """The classes an output's ``classification`` parameter asks for, checked; None: raw outputs."""
    for i, out in enumerate(request.outputs):
        if classification.PARAMETER in out.parameters:
            param = out.parameters[classification.PARAMETER]
            where = f"outputs[{i}].parameters.{classification.PARAMETER}"
            if param.WhichOneof("parameter_choice") != "int64_param":
                raise BadInput(f"{where} must be an int64_param")
            return classification.check_count(param.int64_param, info, where)
    return None


def timeout_s(request, limit_s: float) -> float:
    """``limit_s`` shortened by the request's ``timeout`` parameter (microseconds), if it has one."""
    if TIMEOUT in request.parameters:
        us = request.parameters[TIMEOUT].int64_param
        if us > 0:
            return min(limit_s, us / 1e6)
    return limit_s


def encode(request, info: ModelInfo, out: np.ndarray, raw: bool):
    """The ``ModelInferResponse`` for ``out`` ([rows, out_features]), or its top classes where the
    request asks for them (``service.classification``)."""
    out = np.ascontiguousarray(out, dtype=np.float32)
    k = _class_count(request, info)
    if k is not None:
        return _classes(request, info, classification.strings(out, k, info.labels), (out.shape[0], k), raw)
    tensor = pb.ModelInferResponse.InferOutputTensor(name=OUTPUT, datatype=tensors.OUTPUT_DATATYPE, shape=out.shape)
    if raw:
        return pb.ModelInferResponse(model_name=info.name, model_version=info.version, id=request.id,
                                     outputs=[tensor], raw_output_contents=[out.tobytes()])
    tensor.contents.fp32_contents.extend(out.ravel().tolist())
    return pb.ModelInferResponse(model_name=info.name, model_version=info.version, id=request.id, outputs=[tensor])


def _classes(request, info: ModelInfo, strings: list[str], shape: tuple, raw: bool):
    tensor = pb.ModelInferResponse.InferOutputTensor(name=OUTPUT, datatype=classification.DATATYPE, shape=shape)
    response = pb.ModelInferResponse(model_name=info.name, model_version=info.version, id=request.id)
    if raw:
        response.raw_output_contents.append(classification.bytes_tensor(strings))
    else:
        tensor.contents.bytes_contents.extend(s.encode() for s in strings)
    response.outputs.append(tensor)
    return response


def model_metadata(info: ModelInfo):
    """``ModelMetadataResponse`` from the same fields as HTTP's ``GET /v2/models/{m}``."""
    meta = tensors.metadata(info)
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                    inputs=[tensor(**t) for t in meta["inputs"]],
                                    outputs=[tensor(**t) for t in meta["outputs"]])


def server_metadata(control_served: bool):
    return pb.ServerMetadataResponse(name=tensors.SERVER_NAME, version=tensors.SERVER_VERSION,
                                     extensions=v2_body.extensions(control_served))


def model_config(info: ModelInfo, max_batch_size: int, max_delay_ms: float):
    """``ModelConfigResponse`` from the same body as HTTP's ``GET /v2/models/{m}/config``."""
    config = json_format.ParseDict(v2_body.model_config(info, max_batch_size, max_delay_ms), pb.ModelConfig())
    return pb.ModelConfigResponse(config=config)


def statistics(body: dict):
    """``ModelStatisticsResponse`` from HTTP's statistics body (``v2_body.statistics``)."""
    return json_format.ParseDict(body, pb.ModelStatisticsResponse())
