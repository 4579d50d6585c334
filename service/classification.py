"""A model's top classes, one copy for every protocol: the classification extension of the Open
Inference Protocol as Triton serves it (``"parameters": {"classification": k}`` on a requested output,
answered as a BYTES tensor [rows, k] of ``"<score>:<index>[:<label>]"`` strings, over HTTP and gRPC) and
``/infer``'s ``"top_k"`` (each row's k best classes as objects). Labels are the model's (``labels.json``)."""

from __future__ import annotations

import struct

import numpy as np

from fusedserve.service.engine.state import ModelInfo
from fusedserve.service.errors import BadInput

PARAMETER = "classification"  # the v2 output parameter
TOP_K = "top_k"  # /infer's body key
DATATYPE = "BYTES"


def check_count(value: object, info: ModelInfo, where: str) -> int:
    """``value`` as a number of classes to return, or BadInput saying what fits."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= info.out_features:
        raise BadInput(f"{where} must be a whole number of classes from 1 to {info.out_features} (model "
                       f"{info.name!r} has {info.out_features} outputs), got {value!r}")
    return value


def top(out: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, scores)`` [rows, k] of each row's ``k`` highest outputs, highest first (on a tie,
    the lower index first)."""
    order = np.argsort(-out, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(out, order, axis=1)


def strings(out: np.ndarray, k: int, labels) -> list[str]:
    """The extension's strings, row after row: ``"0.912000:3:cat"`` (``"0.912000:3"`` without labels)."""
    indices, scores = top(out, k)
    return [f"{score:f}:{index}" + (f":{labels[index]}" if labels else "")
            for row_indices, row_scores in zip(indices.tolist(), scores.tolist(), strict=True)
            for index, score in zip(row_indices, row_scores, strict=True)]


def bytes_tensor(items: list[str]) -> bytes:
    """A BYTES tensor's raw contents: each element's length (4 bytes, little-endian), then its bytes."""
    encoded = [s.encode() for s in items]
    return b"".join(struct.pack("<I", len(e)) + e for e in encoded)


def classes(out: np.ndarray, k: int, labels) -> list[list[dict]]:
    """/infer's answer: per row, its ``k`` best classes as ``{"index", "score"[, "label"]}``."""
    indices, scores = top(out, k)
    return [[{"index": i, "score": s, **({"label": labels[i]} if labels else {})}
             for i, s in zip(row_indices, row_scores, strict=True)]
            for row_indices, row_scores in zip(indices.tolist(), scores.tolist(), strict=True)]
