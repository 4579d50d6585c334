"""The Open Inference Protocol's (KServe v2) tensor rules, one copy for the HTTP routes and the gRPC
servicer: every model has one input, "input" ([-1, in_features]), and one output, "output" FP32
([-1, out_features]), one version served at a time ("1" unless the model has version folders); an
input may come in any of ``DATATYPES`` and is served as float32. Each protocol finds the input's
name, datatype, shape and values in its own body; the checks and the messages saying what to fix
are here."""

from __future__ import annotations

import numpy as np

from fusedserve.service.engine.state import ModelInfo
from fusedserve.service.errors import BadInput, UnknownModel

SERVER_NAME, SERVER_VERSION = "fusedserve", "0.1.0"
EXTENSIONS = ("binary_tensor_data", "classification", "statistics", "model_configuration", "model_repository")
VERSION = "1"  # of a model directory without numbered version folders
INPUT, OUTPUT = "input", "output"
OUTPUT_DATATYPE = "FP32"
DATATYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16,
             "INT32": np.int32, "INT64": np.int64, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8}


def check_version(info: ModelInfo, version: str | None) -> None:
    """No version or "" means the one served."""
    if version and version != info.version:
        raise UnknownModel(f"model {info.name!r} has only version {info.version!r} loaded, not {version!r} "
                           "(the highest version folder is served)")


def metadata(info: ModelInfo) -> dict:
    """The model metadata response's fields (a JSON body over HTTP, a message over gRPC)."""
    return {"name": info.name, "versions": [info.version], "platform": f"fusedserve_{info.backend}",
            "inputs": [{"name": INPUT, "datatype": "FP32", "shape": [-1, info.in_features]}],
            "outputs": [{"name": OUTPUT, "datatype": OUTPUT_DATATYPE, "shape": [-1, info.out_features]}]}


def expected(info: ModelInfo) -> str:
    return f"one input {INPUT!r} of shape [rows, {info.in_features}], datatype FP32"


def check_input(name: str, datatype: object, shape: object, info: ModelInfo, where: str) -> tuple[np.dtype, tuple]:
    """The input's numpy dtype and (rows, in_features) shape, or 422 saying what to send instead."""
    if name != INPUT:
        raise BadInput(f"{where} is named {name!r}; model {info.name!r} takes {expected(info)}")
    if datatype not in DATATYPES:
        raise BadInput(f"{where}.datatype must be one of {sorted(DATATYPES)} (FP32 preferred), got {datatype!r}")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 2
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise BadInput(f"{where}.shape must be [rows, {info.in_features}], got {shape!r}")
    if shape[0] == 0:
        raise BadInput(f"{where} is empty: send at least one row of {info.in_features} numbers")
    if shape[1] != info.in_features:
        raise BadInput(f"{where} rows have {shape[1]} values but the model expects {info.in_features} "
                       f"(in_features): shape must be [rows, {info.in_features}]")
    return np.dtype(DATATYPES[datatype]), (shape[0], shape[1])


def from_bytes(data, dtype: np.dtype, shape: tuple, where: str) -> np.ndarray:
    """Raw little-endian tensor bytes (the binary extension, gRPC's raw contents) as ``shape``."""
    need = shape[0] * shape[1] * dtype.itemsize
    if len(data) != need:
        raise BadInput(f"{where} has {len(data)} bytes but shape {list(shape)} of {dtype.name} needs {need} "
                       f"(rows x {shape[1]} x {dtype.itemsize} bytes)")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def from_values(values: np.ndarray, shape: tuple, where: str) -> np.ndarray:
    """A flat (or evenly nested) array of numbers as ``shape``."""
    if values.dtype.kind not in "iuf":
        raise BadInput(f"{where} must hold only numbers, nested evenly")
    if values.size != shape[0] * shape[1]:
        raise BadInput(f"{where} has {values.size} numbers but shape {list(shape)} needs {shape[0] * shape[1]}")
    return values.reshape(shape)
