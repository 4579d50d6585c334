"""Input normalization in one launch: ``out = ((x - shift) * scale).to(dtype)``.

What ``models.MLP.normalize`` computes, which torch runs as two or three elementwise kernels
(subtract, multiply, cast). Before a model's first layer each of those is a launch of its own; on an
H200 a small launch costs 1.5-2 us inside a CUDA graph, more than the work. This is one launch, a
programmatic dependent one where supported: it lets the first layer start launching (and streaming
its weights) at once and waits for the previous kernel only before reading ``x``.
"""

import torch
import triton
import triton.language as tl

from fusedserve.kernels.arguments import DTYPES, check_normalization, interpreting
from fusedserve.kernels.device import pdl_supported
from fusedserve.kernels.triton.common import launch_dependents_then_wait

NAME = "triton_normalize"
# Elements per program: 8 per thread at 4 warps (two 16-byte fp32 vectors).
BLOCK = 1024


@triton.jit
def _normalize_kernel(
    # pointers: x [M, K] float32, shift and scale [K] float32, out [M, K] in the model dtype
    x_ptr, shift_ptr, scale_ptr, out_ptr,
    # sizes and row strides (column strides are 1)
    M, K, stride_x, stride_out,
    # meta-parameters
    USE_PDL: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[m, k] = (x[m, k] - shift[k]) * scale[k], in fp32, rounded once to out's dtype."""
    if USE_PDL:
        launch_dependents_then_wait()
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * K
    row, col = idx // K, idx % K
    x = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0.0)
    shift = tl.load(shift_ptr + col, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + col, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_out + col, ((x - shift) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def normalize(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``((x - shift) * scale).to(dtype)`` for float32 ``x [M, K]`` and float32 ``shift``/``scale``
    ``[K]``, in one launch: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Bit-equal to
    the torch expression (the same fp32 subtract and multiply, then one round-to-nearest-even)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"x must be a float32 [M, K] tensor, got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{list(getattr(x, 'shape', []))}")
    K = x.shape[1]
    check_normalization(shift, scale, K, x.device)
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {DTYPES}, got {dtype}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        raise ValueError(f"x is on {x.device}; normalize runs on CUDA (or CPU under TRITON_INTERPRET=1)")
    if x.stride(1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    out = torch.empty(M, K, device=x.device, dtype=dtype)
    if M * K == 0:
        return out
    pdl = pdl_supported(x.device)
    _normalize_kernel[(triton.cdiv(M * K, BLOCK),)](
        x, shift, scale, out, M, K, x.stride(0), out.stride(0), USE_PDL=pdl, BLOCK=BLOCK,
        **({"launch_pdl": True} if pdl else {}))
    return out
