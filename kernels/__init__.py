"""Fused linear-layer kernels: ``Y = act(X @ W^T + b)`` with the epilogue fused into the GEMM.

``fused_linear`` is the entry point; ``kernel_choice`` says which kernel and config it uses for a
shape; ``tune`` times configs ahead of time (kept on disk, see ``kernels.autotune_cache``).
"""

from kernels.activations import ACTIVATIONS
from kernels.fused_linear import fused_linear, kernel_choice
from kernels.pretune import tune

__all__ = ["ACTIVATIONS", "fused_linear", "kernel_choice", "tune"]
