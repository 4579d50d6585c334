"""Which kernel runs a given linear layer: a pure function of the shape and the device's traits,
so the rules can be tested without a GPU."""

import torch

TILED = "triton_tiled"
SMALL_M = "triton_small_m"
TMA_PERSISTENT = "triton_tma_persistent"
GLUON = "gluon_wgmma"

# Up to this many rows the layer is bound by reading W (on an H200 every M below ~200 is), and the
# weight-streaming kernel's X^T tile (16..64 wide) still covers the batch in one program column.
SMALL_M_MAX = 64
# From here on a large-M GEMM is compute-bound; the hand-written Gluon WGMMA kernel is offered here.
GLUON_MIN_M = 1024
# Autotune keys bucket M up to this; larger batches share the biggest bucket's config.
M_BUCKET_CAP = 4096


def m_bucket(M):
    """Batch size rounded up to a power of two (capped), the M part of every autotune key."""
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    return min(M_BUCKET_CAP, 1 << (M - 1).bit_length())


def choose_kernel(M, N, K, dtype, *, capability, tma_aligned, gluon_ok=False):
    """Name of the kernel for ``act(X[M, K] @ W[N, K]^T + b)``.

    ``capability`` is the CUDA compute capability ``(major, minor)``, or None under the interpreter.
    ``tma_aligned`` says whether x, W and the output meet TMA's 16-byte alignment rules.
    ``gluon_ok`` says whether the Gluon kernel imported and accepts this shape/dtype/device.

    Rules, first match wins:
      1. ``M <= SMALL_M_MAX``: ``triton_small_m`` (swap-AB weight streaming, split-K), any device.
      2. Hopper (major 9), fp16/bf16, ``M >= GLUON_MIN_M``, ``gluon_ok`` and ``tma_aligned``:
         ``gluon_wgmma`` (it loads through TMA too).
      3. Hopper, fp16/bf16 and ``tma_aligned``: ``triton_tma_persistent``.
      4. Otherwise (fp32, other GPUs, the interpreter, misaligned views): ``triton_tiled``.
    """
    if M <= SMALL_M_MAX:
        return SMALL_M
    hopper_16bit = capability is not None and capability[0] == 9 and dtype in (torch.float16, torch.bfloat16)
    if hopper_16bit and gluon_ok and tma_aligned and M >= GLUON_MIN_M:
        return GLUON
    if hopper_16bit and tma_aligned:
        return TMA_PERSISTENT
    return TILED
