"""Portable tiled GEMM with a fused bias + activation epilogue (any GPU Triton supports, and the
interpreter).

``Y[M, N] = act(X[M, K] @ W[N, K]^T + b[N])``: each program owns one ``BLOCK_M x BLOCK_N`` tile of Y,
walks K in ``BLOCK_K`` steps with an fp32 accumulator and stores once. Tiles are visited in groups
of ``GROUP_M`` rows so neighbouring programs share W tiles in L2.
"""

import torch
import triton
import triton.language as tl

from fusedserve.kernels.activations import apply_activation
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.precision import dot_precision
from fusedserve.kernels.rules import SMALL_M_MAX
from fusedserve.kernels.triton.common import aligned, dot_acc, grouped_tile, k_align, launch_dependents_then_wait

NAME = "triton_tiled"

# Candidates timed by the autotuner on a GPU for 16-bit inputs (tensor-core MMAs).
CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
]
# fp32 (3xTF32 or TF32 tensor cores, or FMAs with FUSEDSERVE_FP32_PRECISION=ieee): tiles that keep
# the accumulator in registers, spilling a few bytes at most on sm_90 (the 16-bit tiles spill).
FP32_CONFIGS = [
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    # Large batches on FMAs: 8x8 (or 8x4) outputs per thread, short K steps so 4 stages fit.
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=16, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
]
# Under TRITON_INTERPRET=1 timing configs means nothing: one small config keeps CPU runs short.
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)


# Under 3xTF32 (two copies of each operand tile) these spill 650-820 bytes a thread on sm_90.
_FP32X3_SPILLING = ((128, 64, 64), (32, 64, 128))


def candidates(M, N, K, dtype):
    if dtype != torch.float32:
        return CONFIGS
    if dot_precision(dtype) != "tf32x3":
        return FP32_CONFIGS
    return [c for c in FP32_CONFIGS if (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) not in _FP32X3_SPILLING]


@triton.jit
def _tiled_linear_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr,
    # sizes
    M, N, K,
    # row strides in elements (the column stride of x, W and Y is 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32", only meaningful for fp32 inputs
    UPCAST_BF16: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is right
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait before reading x
    K_ALIGN: tl.constexpr = 1,  # a power of two dividing K and both row strides (``common.k_align``)
):
    if USE_PDL:
        launch_dependents_then_wait()
    K, stride_xm, stride_wn = aligned(K, K_ALIGN), aligned(stride_xm, K_ALIGN), aligned(stride_wn, K_ALIGN)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # Rows/columns past the edge wrap around (modulo) so the loads need no M/N mask; the store
    # below is masked, so the wrapped values are never written.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    # W is [N, K]; this reads the [BLOCK_K, BLOCK_N] tile of W^T.
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]

    # Main loop: fp32 accumulator, K tail masked with zeros.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = dot_acc(acc, x, w, INPUT_PRECISION, UPCAST_BF16)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # Epilogue: bias and activation while the accumulator is still in fp32, then one store.
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n).to(tl.float32)
        acc = acc + b[None, :]
    acc = apply_activation(acc, ACTIVATION)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def launch(x, weight, bias, activation, out, config, *, input_precision, upcast_bf16, pdl=False,
           prefetch_weight=False):
    """Run the kernel on checked arguments: ``x [M, K]`` and ``weight [N, K]`` with unit column
    stride, ``out [M, N]`` contiguous, M >= 1. ``config`` is one of ``candidates``/``INTERPRET_CONFIG``.
    (``prefetch_weight`` is the keyword every family takes; this kernel has no use for it.)"""
    M, K = x.shape
    N = weight.shape[0]
    meta = dict(config)
    grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    _tiled_linear_kernel[grid](
        x, weight, bias if bias is not None else out, out,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ACTIVATION=activation,
        INPUT_PRECISION=input_precision, UPCAST_BF16=upcast_bf16,
        USE_PDL=pdl, K_ALIGN=k_align(K, x, weight), **meta, **({"launch_pdl": True} if pdl else {}),
    )
    return out


def _offered(p):
    # Past a few rows, wherever the Hopper TMA kernels cannot run (fp32, other GPUs, the interpreter).
    return p.M > SMALL_M_MAX and not p.hopper_tma


FAMILY = KernelFamily(NAME, unfit=lambda p: None, offered=_offered,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch,
                      interpret_config=INTERPRET_CONFIG)
