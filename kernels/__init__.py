"""Fused linear-layer kernels: ``Y = act(X @ W^T + b)`` with the epilogue fused into the GEMM.

``fused_linear`` is the entry point; ``kernel_choice`` says which kernel and config it uses for a
shape; ``run_kernel`` forces one kernel (benchmarks); ``tune`` times configs ahead of time (kept on disk, see ``kernels.autotune_cache``).
"""

from fusedserve.kernels.activations import ACTIVATIONS
from fusedserve.kernels.fused_linear import KERNELS, fused_linear, kernel_choice, run_kernel
from fusedserve.kernels.pretune import tune

__all__ = ["ACTIVATIONS", "KERNELS", "fused_linear", "kernel_choice", "run_kernel", "tune"]
