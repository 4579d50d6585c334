"""Split-K GEMM for few output tiles over a long K, with the bias and activation in a second pass.

``Y[M, N] = act(X[M, K] @ W[N, K]^T + b[N])`` where Y's tiles cannot fill the SMs and each walks a
long K: past 64 rows with K in the thousands, on an H100, cuBLAS beat every tiled family of ours
(docs/kernels.md, issue 36), most of whose programs then sat idle. Here ``SPLIT_K`` programs share
each tile, one contiguous share of K each, and store fp32 partial sums ``[SPLIT_K, M, N]``; a
second kernel adds them in a fixed order (the same rows give the same bits whatever else is in the
batch), adds the bias, applies the activation and stores Y. Any GPU Triton supports; the tuner
times it against the others only where the tiles are few and K long (``_offered``). On Hopper's
16-bit TMA problems (``TMA`` configs) the partial sums read X and W through TMA descriptors, which
zero-fill past K, as the persistent TMA kernel does.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedserve.kernels.activations import apply_activation
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.rules import SMALL_M_MAX, SMS
from fusedserve.kernels.triton.common import aligned, dot_acc, grouped_tile, k_align, launch_dependents_then_wait

NAME = "triton_split_k"

# Tiles for 16-bit and for fp32 inputs, each tried at every split in SPLITS. On sm_90 the 16-bit ones
# do not spill (128 x 128 at 4 warps and 128 x 256 spilled ~0.5 kB a thread); fp32's 64 x 64 spills
# 12 bytes with IEEE dots, as triton_tiled's does.
TILES = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
         dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
         dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)]
FP32_TILES = [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)]
SPLITS = (2, 3, 4)
# Offered where 128 x 256 tiles (the TMA kernels' largest) leave at least this share of the SMs idle,
# over at least this long a K.
_IDLE_SHARE, _MIN_K = 0.25, 2048
# Elements of Y per program of the summing kernel.
_SUM_BLOCK = 1024
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, SPLIT_K=3, num_warps=4, num_stages=1)


def _tiles(M, N, config) -> int:
    return triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])


def candidates(M, N, K, dtype, tma=False):
    """Each tile at each split whose programs fit two waves and give every split a K step; with
    ``tma`` (Hopper, 16-bit, TMA-aligned rows) the partial sums load through TMA."""
    tiles = FP32_TILES if dtype == torch.float32 else TILES
    return [dict(t, SPLIT_K=s, **({"TMA": True} if tma else {})) for t in tiles for s in SPLITS
            if _tiles(M, N, t) * s <= 2 * SMS and K >= s * t["BLOCK_K"]]


@triton.jit
def _store_partial(part_ptr, acc, split, pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split ``split``'s fp32 sums of one tile into ``part [SPLIT_K, M, N]``, masked at the edges."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    part_ptrs = part_ptr + split.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(part_ptrs, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _split_k_partial_kernel(
    x_ptr, w_ptr, part_ptr,
    M, N, K, stride_xm, stride_wn,
    K_PER_SPLIT,  # a multiple of BLOCK_K: split s sums K from s * K_PER_SPLIT
    INPUT_PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
    K_ALIGN: tl.constexpr = 1,  # a power of two dividing K and both row strides (``common.k_align``)
):
    if USE_PDL:
        launch_dependents_then_wait()
    K, stride_xm, stride_wn = aligned(K, K_ALIGN), aligned(stride_xm, K_ALIGN), aligned(stride_wn, K_ALIGN)
    K_PER_SPLIT = aligned(K_PER_SPLIT, BLOCK_K)
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # Rows/columns past the edge wrap around (the store is masked), as in triton_tiled.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_left = k_end - k
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = dot_acc(acc, x, w, INPUT_PRECISION, UPCAST_BF16)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_partial(part_ptr, acc, split, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def _split_k_tma_partial_kernel(
    x_desc, w_desc, part_ptr,  # descriptors of x [M, K] and w [N, K]
    M, N,
    K_PER_SPLIT,  # a multiple of BLOCK_K: split s sums K from s * K_PER_SPLIT (TMA zero-fills past K)
    UPCAST_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        launch_dependents_then_wait()
    K_PER_SPLIT = aligned(K_PER_SPLIT, BLOCK_K)
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_start = split * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k])
        w = w_desc.load([pid_n * BLOCK_N, k])
        if UPCAST_BF16:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w.T, acc)
    _store_partial(part_ptr, acc, split, pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def _split_k_sum_kernel(
    part_ptr, b_ptr, y_ptr, M, N, stride_ym,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        launch_dependents_then_wait()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on timing
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    row, col = offs // N, offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + row * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, weight, bias, activation, out, config, *, input_precision, upcast_bf16, pdl=False,
           prefetch_weight=False):
    """Run both kernels on checked arguments (``x [M, K]``, ``weight [N, K]`` with unit column
    stride, ``out [M, N]`` contiguous; for a ``TMA`` config 16-bit and ``rules.tma_compatible``);
    the partial sums live in a new fp32 ``[SPLIT_K, M, N]``. (``prefetch_weight`` is the keyword
    every family takes; these kernels have no use for it.)"""
    M, K = x.shape
    N = weight.shape[0]
    meta = dict(config)
    split, tma = meta.pop("SPLIT_K"), meta.pop("TMA", False)
    k_per_split = triton.cdiv(triton.cdiv(K, split), meta["BLOCK_K"]) * meta["BLOCK_K"]
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    pdl_flag = {"launch_pdl": True} if pdl else {}
    grid = (_tiles(M, N, meta), split)
    if tma:
        x_desc = TensorDescriptor.from_tensor(x, [meta["BLOCK_M"], meta["BLOCK_K"]])
        w_desc = TensorDescriptor.from_tensor(weight, [meta["BLOCK_N"], meta["BLOCK_K"]])
        _split_k_tma_partial_kernel[grid](x_desc, w_desc, part, M, N, k_per_split, UPCAST_BF16=upcast_bf16,
                                          USE_PDL=pdl, **meta, **pdl_flag)
    else:
        _split_k_partial_kernel[grid](
            x, weight, part, M, N, K, x.stride(0), weight.stride(0), k_per_split,
            INPUT_PRECISION=input_precision, UPCAST_BF16=upcast_bf16, USE_PDL=pdl, K_ALIGN=k_align(K, x, weight),
            **meta, **pdl_flag)
    _split_k_sum_kernel[(triton.cdiv(M * N, _SUM_BLOCK),)](
        part, bias if bias is not None else out, out, M, N, out.stride(0), SPLIT_K=split,
        HAS_BIAS=bias is not None, ACTIVATION=activation, BLOCK=_SUM_BLOCK, USE_PDL=pdl, num_warps=4, **pdl_flag)
    return out


def _offered(p):
    """On a GPU, past the weight-streaming rows, where 128 x 256 tiles leave a quarter of the SMs
    idle over a long K. On Hopper's 16-bit TMA problems too (TMA loads): there cuBLAS beat our
    persistent families by up to 1.58x at such shapes (M=683 N=1024 K=4520 bf16, 48 tiles of
    128 x 128, kernels.jsonl:41)."""
    idle = 1 - triton.cdiv(p.M, 128) * triton.cdiv(p.N, 256) / SMS
    return p.capability is not None and p.M > SMALL_M_MAX and p.K >= _MIN_K and idle >= _IDLE_SHARE


def _near_whole(p):
    """A near search times every config but on Hopper's 16-bit TMA problems, where full searches on an
    H100 never chose it (docs/kernels.md, "Split-K left out of Hopper's 16-bit near searches"): there
    it is timed where it won at the nearest measured shapes, as other families are."""
    return not p.hopper_tma


FAMILY = KernelFamily(NAME, unfit=lambda p: None, offered=_offered,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype, tma=p.hopper_tma), launch=launch,
                      interpret_config=INTERPRET_CONFIG, near_whole=_near_whole)
