"""MLP models built from fused linear layers: definition, loading, importing (ONNX, PyTorch,
scikit-learn), running, the shipped repository."""

from fusedserve.kernels.rules import batch_buckets
from fusedserve.models.importing import from_onnx, from_sklearn, from_torch
from fusedserve.models.loading import (
    DEFAULT_REPOSITORY,
    latest_version,
    load_model,
    load_repository,
    model_directories,
    save_model,
)
from fusedserve.models.mlp import BACKENDS, DTYPES, MLP, FusedLinear, MLPConfig
from fusedserve.models.precompile import warm_up
from fusedserve.models.runner import ModelRunner

__all__ = [
    "BACKENDS",
    "DEFAULT_REPOSITORY",
    "DTYPES",
    "MLP",
    "FusedLinear",
    "MLPConfig",
    "ModelRunner",
    "batch_buckets",
    "from_onnx",
    "from_sklearn",
    "from_torch",
    "latest_version",
    "load_model",
    "load_repository",
    "model_directories",
    "save_model",
    "warm_up",
]
