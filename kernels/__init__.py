"""Fused linear-layer kernels: ``Y = act(X @ W^T + b)`` with bias and activation in the GEMM epilogue.

``fused_linear`` runs a layer on the kernel family chosen for its shape (``choosing``: tuned once per
batch bucket, kept in the tune cache); ``fused_linear_with_choice`` also says which ran;
``kernel_choice`` names the choice for a shape; ``run_kernel`` forces one family; ``tune`` times
shapes ahead of time. ``ACTIVATIONS`` is the table of activations every kernel computes;
``KERNELS`` names the registered families (``registry``).
"""

from fusedserve.kernels.activations import ACTIVATIONS
from fusedserve.kernels.fused_linear import fused_linear, fused_linear_with_choice, kernel_choice, run_kernel, tune
from fusedserve.kernels.registry import names as _family_names

KERNELS = _family_names()

__all__ = ["ACTIVATIONS", "KERNELS", "fused_linear", "fused_linear_with_choice", "kernel_choice", "run_kernel",
           "tune"]
