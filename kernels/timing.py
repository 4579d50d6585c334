"""Timing records that flow from the model runner to the service's stats.

The runner measures each fused layer (CUDA events on the GPU, ``time.perf_counter`` on the CPU)
and hands one ``LayerTiming`` per layer launch to a sink, which the service aggregates for
``/kernel-stats`` and ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LayerTiming:
    """One measured launch of one layer: ``Y[M, N] = act(X[M, K] @ W[N, K]^T + b)``."""

    model: str  # model name, e.g. "digits"
    layer: str  # launch site inside the model, e.g. "layers.0"
    rows: int  # real rows in the batch
    M: int  # rows computed: the batch padded to its bucket
    N: int
    K: int
    dtype: str  # "float32", "float16", "bfloat16"
    backend: str  # "triton" or "torch"
    kernel: str  # which implementation ran, e.g. "triton_tiled"
    config: str  # the kernel's launch config (autotuned block sizes...), "" when none
    seconds: float  # device time of the launch


class TimingSink(Protocol):
    def record_layer(self, timing: LayerTiming) -> None: ...
