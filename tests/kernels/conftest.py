"""Helpers shared by the kernel tests."""

import torch


def make(M, N, K, dtype, seed=0, device="cuda"):
    """Seeded ``x [M, K]``, ``w [N, K]`` (scaled by 1/sqrt(K), so outputs stay near unit size) and
    ``b [N]`` of ``dtype``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=g).to(dtype)
    w = (torch.randn(N, K, device=device, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device=device, generator=g).to(dtype)
    return x, w, b
