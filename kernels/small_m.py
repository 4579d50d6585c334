"""Weight-streaming kernel for small batches (M up to a few hundred rows).

At small M the GEMM is bound by reading W once (32 MiB for a 4096 x 4096 bf16 layer), so the kernel
is built to stream W at full bandwidth: "swap AB" computes ``Y^T[N, M] = W[N, K] @ X^T[K, M]`` so N
fills the MMA's M side (X's rows fill the narrow side, padded to at least 16), W tiles are read along K in
16-byte vectors and pipelined over ``num_stages`` to keep many bytes in flight, and K is split over
``SPLIT_K`` programs when N alone gives too few programs to fill the GPU. Split-K partial sums go
to an fp32 workspace and a second kernel adds them in a fixed order (deterministic, no atomics),
then applies bias and activation.
"""

import torch
import triton
import triton.language as tl

from kernels.activations import apply_activation

NAME = "triton_small_m"

# Programs to aim for: an H200 has 132 SMs; a couple of programs per SM hides load latency.
_TARGET_PROGRAMS = 264
INTERPRET_CONFIG = dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)


def block_m(M):
    """Width of the X^T tile: the MMA needs >= 16; up to 128 rows share each W tile read."""
    return min(128, max(16, triton.next_power_of_2(M)))


# Shared memory the pipeline may fill (an H200 SM has 227 KB; leave room for the epilogue).
_SMEM_BUDGET = 200 * 1024


# (BLOCK_N, BLOCK_K, num_stages) of the W tiles tried. fp32 runs on FMAs (or TF32): only tiles that
# keep the accumulator in registers without spilling (checked with ptxas for sm_90).
_TILES = ((32, 256, 4), (64, 128, 5), (64, 256, 3), (128, 128, 3), (32, 128, 6))
_FP32_TILES = ((32, 256, 4), (32, 128, 6))


def candidates(M, N, K, dtype):
    """Configs worth timing for this shape: each W tile shape with the split-K that brings the
    program count near ``_TARGET_PROGRAMS``, and half of that split; pipelines are shortened to
    fit in shared memory, or left out if even two stages do not fit."""
    configs = []
    bm = block_m(M)
    column_programs = triton.cdiv(M, bm)
    itemsize = 4 if dtype == torch.float32 else 2
    for block_n, block_k, stages in _FP32_TILES if dtype == torch.float32 else _TILES:
        if (block_n + bm) * block_k * itemsize * stages > _SMEM_BUDGET:
            stages = _SMEM_BUDGET // ((block_n + bm) * block_k * itemsize)
            if stages < 2:
                continue
        k_blocks = triton.cdiv(K, block_k)
        split = 1
        while (triton.cdiv(N, block_n) * column_programs * split * 2 <= _TARGET_PROGRAMS
               and split * 2 <= k_blocks // 2):
            split *= 2
        for s in sorted({split, max(1, split // 2)}):
            configs.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=s, num_warps=4, num_stages=stages))
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
    split_k = meta["SPLIT_K"]
    bm = block_m(M)
    part = out if split_k == 1 else torch.empty((split_k, M, N), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, meta["BLOCK_N"]), split_k, triton.cdiv(M, bm))
    _small_m_kernel[grid](
        x, weight, bias if bias is not None else out, out, part,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ACTIVATION=activation,
        INPUT_PRECISION=input_precision, UPCAST_BF16=upcast_bf16,
        BLOCK_M=bm, **meta,
    )
    if split_k > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](
            part, bias if bias is not None else out, out,
            M, N, out.stride(0),
            HAS_BIAS=bias is not None, ACTIVATION=activation, SPLIT_K=split_k, BLOCK=block,
            num_warps=4,
        )
    return out
