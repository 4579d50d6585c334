"""Weight-streaming kernel for small batches (M up to a few hundred rows).

At small M the GEMM is bound by reading W once (32 MiB for a 4096 x 4096 bf16 layer), so the kernel
is built to stream W at full bandwidth: "swap AB" computes ``Y^T[N, M] = W[N, K] @ X^T[K, M]`` so N
fills the MMA's M side (X's rows fill the narrow side, padded to at least 16), W tiles are read along K in
16-byte vectors and pipelined over ``num_stages`` to keep many bytes in flight, and K is split over
``SPLIT_K`` programs when N alone gives too few programs to fill the GPU. Split-K partial sums go
to an fp32 workspace and a second kernel adds them in a fixed order (deterministic, no atomics),
then applies bias and activation.

For a handful of rows a second kernel, the GEMV variant (config ``GEMV=True``), skips the tensor
cores: it multiplies each W tile by each row of X on the CUDA cores and sums along K, so M is not
padded to 16 and fp32 products are exact. The tuner times both variants.
"""

import torch
import triton
import triton.language as tl

from kernels.activations import apply_activation

NAME = "triton_small_m"

# Programs to aim for: an H200 has 132 SMs; split-K is chosen to give about 2 and about 4 programs
# per SM, so each SM has several tiles' loads in flight at once (bandwidth needs bytes in flight).
_TARGET_PROGRAMS = 264
INTERPRET_CONFIG = dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)
INTERPRET_GEMV_CONFIG = dict(GEMV=True, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)


def block_m(M):
    """Width of the X^T tile: the MMA needs >= 16; up to 128 rows share each W tile read."""
    return min(128, max(16, triton.next_power_of_2(M)))


# Shared memory the pipeline may fill (an H200 SM has 227 KB; leave room for the epilogue).
_SMEM_BUDGET = 200 * 1024

# (BLOCK_N, BLOCK_K, num_stages) of the W tiles of the tensor-core variant. fp32 runs on FMAs (or
# TF32): only tiles that keep the accumulator in registers without spilling (ptxas, sm_90).
_TILES = ((32, 256, 4), (64, 128, 5), (64, 256, 3), (32, 128, 6), (128, 128, 3))
_FP32_TILES = ((32, 256, 4), (32, 128, 6))
# The GEMV variant (no tensor cores) for a handful of rows: the MMA would pad M to 16 and waste 15/16
# of its work, and fp32 gets exact products without TF32. Up to GEMV_MAX_M rows it can run; it is a
# tuning candidate up to _GEMV_TUNE_M rows (fp32 up to 16: there the tensor-core variant is IEEE
# FMA code as well). (BLOCK_N, BLOCK_K, num_warps): 16 KB or 32 KB of W per tile, 16-byte loads.
GEMV_MAX_M = 16
_GEMV_TUNE_M = {torch.float32: 16, torch.float16: 4, torch.bfloat16: 4}
_GEMV_TILES = ((16, 512, 4), (32, 256, 4), (32, 512, 8))
_FP32_GEMV_TILES = ((16, 256, 4), (32, 128, 4), (32, 256, 8))
_GEMV_STAGES = 3  # with ~120 registers, 3-4 programs per SM: 6-8 W tiles (100+ KB) in flight per SM


def _splits(programs, k_blocks):
    """Split-K factors giving about 2 and about 4 programs per SM, each split >= 2 K blocks."""
    split = 1
    while programs * split * 2 <= _TARGET_PROGRAMS and split * 2 <= k_blocks // 2:
        split *= 2
    more = programs * split * 2 <= 2 * _TARGET_PROGRAMS and split * 4 <= k_blocks
    return sorted({split, split * 2 if more else split})


def candidates(M, N, K, dtype):
    """Configs worth timing for this shape (at most 8). Tensor-core tiles, each with the split-K
    factors of ``_splits``, pipelines shortened to fit in shared memory (or the tile left out);
    for a few rows, GEMV tiles (``GEMV=True``) take the place of some tensor-core tiles."""
    bm = block_m(M)
    column_programs = triton.cdiv(M, bm)
    itemsize = 4 if dtype == torch.float32 else 2
    gemv = M <= _GEMV_TUNE_M[dtype]
    tiles = _FP32_TILES if dtype == torch.float32 else _TILES
    if gemv:
        tiles = tiles[:2]
    elif M <= 64:
        tiles = tiles[:4]  # one 32- or 64-row tile per W read: the 128-row tile only pays off later
    else:
        tiles = tiles[:3] + tiles[4:]
    configs = []
    for block_n, block_k, stages in tiles:
        if (block_n + bm) * block_k * itemsize * stages > _SMEM_BUDGET:
            stages = _SMEM_BUDGET // ((block_n + bm) * block_k * itemsize)
            if stages < 2:
                continue
        splits = _splits(triton.cdiv(N, block_n) * column_programs, triton.cdiv(K, block_k))
        for s in splits[-1:] if gemv else splits:
            configs.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=s, num_warps=4, num_stages=stages))
    if gemv:
        for block_n, block_k, warps in _FP32_GEMV_TILES if dtype == torch.float32 else _GEMV_TILES:
            for s in _splits(triton.cdiv(N, block_n), triton.cdiv(K, block_k)):
                configs.append(dict(GEMV=True, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=s,
                                    num_warps=warps, num_stages=_GEMV_STAGES))
    return configs


@triton.jit
def _small_m_kernel(
    # pointers (part_ptr: fp32 workspace [SPLIT_K, M, N], used only when SPLIT_K > 1)
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr,
    # sizes
    M, N, K,
    # row strides in elements (column strides are 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32", only meaningful for fp32 inputs
    UPCAST_BF16: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is right
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)

    # This program's share of K, in whole BLOCK_K steps.
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_start = pid_k * per_split
    kb_stop = tl.minimum(kb_start + per_split, k_blocks)

    # Edge rows/columns wrap (modulo) so loads need no M/N mask; stores are masked.
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_k = kb_start * BLOCK_K + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]

    # Main loop: acc = W_tile @ X_tile^T in fp32.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(kb_start, kb_stop):
        k_left = K - kb * BLOCK_K
        k_in = tl.arange(0, BLOCK_K) < k_left
        w = tl.load(w_ptrs, mask=k_in[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_in[:, None], other=0.0)
        if UPCAST_BF16:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, x, acc, input_precision=INPUT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (n), along acc's rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output rows (m), along acc's columns
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    if SPLIT_K == 1:
        # Epilogue: bias and activation while the accumulator is still in fp32, then one store.
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n).to(tl.float32)[:, None]
        acc = apply_activation(acc, ACTIVATION)
        y_ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = part_ptr + (pid_k * M + rows[None, :]).to(tl.int64) * N + cols[:, None]
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _gemv_kernel(
    # pointers (part_ptr: fp32 workspace [SPLIT_K, M, N], used only when SPLIT_K > 1)
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr,
    # sizes
    M, N, K,
    # row strides in elements (column strides are 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,  # W tiles in flight per program (cp.async pipeline through shared memory)
):
    # No tensor cores: each W tile is multiplied by each of the (few) rows of X on the CUDA cores and
    # summed along K. Exact fp32 products for every dtype (no TF32, no padding of M to 16), and W is
    # read in 16-byte vectors along K.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)

    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_start = pid_k * per_split
    kb_stop = tl.minimum(kb_start + per_split, k_blocks)

    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # edge columns wrap; stores are masked
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (kb_start * BLOCK_K + offs_k)[None, :]

    if BLOCK_M == 1:
        # One row: an elementwise [BLOCK_N, BLOCK_K] accumulator, reduced across K once at the end.
        wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for kb in tl.range(kb_start, kb_stop, num_stages=STAGES):
            k = kb * BLOCK_K + offs_k
            w = tl.load(w_ptrs, mask=(k < K)[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            wide += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        acc = tl.sum(wide, axis=1)[None, :]
    else:
        # A few rows: each W tile is reduced against every row (rows past M repeat row M-1's data
        # and are never stored).
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(kb_start, kb_stop, num_stages=STAGES):
            k = kb * BLOCK_K + offs_k
            w = tl.load(w_ptrs, mask=(k < K)[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + k, mask=k < K, other=0.0)
                dot_m = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
                acc = tl.where(rows[:, None] == m, acc + dot_m[None, :], acc)
            w_ptrs += BLOCK_K

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
        acc = apply_activation(acc, ACTIVATION)
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = part_ptr + (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr, b_ptr, y_ptr,
    M, N, stride_ym,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    # Sum the SPLIT_K partial tiles in order 0..SPLIT_K-1 (the same order every run), then the epilogue.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + (offs // N).to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, weight, bias, activation, out, config, *, input_precision, upcast_bf16):
    """Run on checked arguments: ``x [M, K]`` and ``weight [N, K]`` with unit column stride,
    ``out [M, N]`` with unit column stride, M >= 1. ``config`` comes from ``candidates`` or
    ``INTERPRET_CONFIG``."""
    M, K = x.shape
    N = weight.shape[0]
    meta = dict(config)
    gemv = meta.pop("GEMV", False)
    split_k = meta["SPLIT_K"]
    part = out if split_k == 1 else torch.empty((split_k, M, N), device=x.device, dtype=torch.float32)
    common = (x, weight, bias if bias is not None else out, out, part, M, N, K,
              x.stride(0), weight.stride(0), out.stride(0))
    if gemv:
        if M > GEMV_MAX_M:
            raise ValueError(f"config {config}: the GEMV variant takes at most {GEMV_MAX_M} rows, got M={M}")
        grid = (triton.cdiv(N, meta["BLOCK_N"]), split_k)
        _gemv_kernel[grid](*common, HAS_BIAS=bias is not None, ACTIVATION=activation,
                           BLOCK_M=triton.next_power_of_2(M), STAGES=meta["num_stages"], **meta)
    else:
        bm = block_m(M)
        grid = (triton.cdiv(N, meta["BLOCK_N"]), split_k, triton.cdiv(M, bm))
        _small_m_kernel[grid](*common, HAS_BIAS=bias is not None, ACTIVATION=activation,
                              INPUT_PRECISION=input_precision, UPCAST_BF16=upcast_bf16, BLOCK_M=bm, **meta)
    if split_k > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](
            part, bias if bias is not None else out, out,
            M, N, out.stride(0),
            HAS_BIAS=bias is not None, ACTIVATION=activation, SPLIT_K=split_k, BLOCK=block,
            num_warps=4,
        )
    return out
