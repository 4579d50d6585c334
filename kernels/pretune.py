"""Tune shapes ahead of time (before serving, before CUDA-graph capture)."""

import sys
import time

import torch

from fusedserve.kernels.fused_linear import fused_linear, kernel_choice


def tune(shapes, dtype=torch.bfloat16, device="cuda", activation="relu", progress=True):
    """Run ``fused_linear`` once on every ``(M, N, K)`` in ``shapes`` so each kernel's config for
    that batch bucket is timed and written to the tune cache (``kernels.autotune_cache``).

    Returns ``{(M, N, K): (kernel name, config string)}``. With ``progress``, prints one line per
    shape to stderr as it finishes.
    """
    shapes = [tuple(int(d) for d in s) for s in shapes]
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"shapes must be (M, N, K) triples of positive ints, got {s}")
    device = torch.device(device)
    chosen = {}
    for i, (M, N, K) in enumerate(shapes, 1):
        x = torch.randn(M, K, device=device).to(dtype)
        w = (torch.randn(N, K, device=device) * K ** -0.5).to(dtype)
        b = torch.randn(N, device=device).to(dtype)
        start = time.perf_counter()
        fused_linear(x, w, b, activation)
        chosen[(M, N, K)] = kernel_choice(M, N, K, dtype, device)
        if progress:
            name, config = chosen[(M, N, K)]
            print(f"[tune {i}/{len(shapes)}] M={M} N={N} K={K} {str(dtype).removeprefix('torch.')}: "
                  f"{name} {config} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return chosen
