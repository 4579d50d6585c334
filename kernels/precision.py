"""How accurate float32 layers are: the ``input_precision`` of every fp32 ``tl.dot``."""

import os

import torch

from fusedserve.kernels.arguments import interpreting

FP32_PRECISION_ENV = "FUSEDSERVE_FP32_PRECISION"
FP32_PRECISIONS = ("tf32x3", "ieee")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype`` (16-bit dots ignore it).

    float32 follows torch: "tf32" only where ``torch.backends.cuda.matmul.allow_tf32`` allows it.
    Otherwise results must be as accurate as torch's fp32 SGEMM, and ``FUSEDSERVE_FP32_PRECISION``
    says how: "tf32x3" (default: each operand split into a TF32 high part and remainder, three
    tensor-core products summed in fp32) or "ieee" (exact fp32 products on the CUDA cores). The
    interpreter computes exact fp32 products whatever is asked; "ieee" keys its tuning."""
    if dtype != torch.float32:
        return "tf32"
    if interpreting():
        return "ieee"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    choice = os.environ.get(FP32_PRECISION_ENV, "tf32x3")
    if choice not in FP32_PRECISIONS:
        raise ValueError(f"{FP32_PRECISION_ENV} must be one of {FP32_PRECISIONS}, got {choice!r}")
    return choice
