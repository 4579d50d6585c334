"""Hopper kernel for large batches: TMA tensor descriptors, a persistent grid, pipelined K loop.

``Y[M, N] = act(X[M, K] @ W[N, K]^T + b[N])``. One program per SM walks output tiles in grouped
order (GROUP_M tile rows share W tiles in L2); tiles are moved by TMA through host-side
``TensorDescriptor``s, which also zero-fill loads past the edges and clip stores, so no masks are
needed. Needs 16-byte aligned base pointers and row strides (``rules.tma_compatible``).
"""

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedserve.kernels.activations import apply_activation
from fusedserve.kernels.device import cuda_sm_count
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.rules import SMALL_M_MAX
from fusedserve.kernels.triton.common import launch_dependents_then_wait

NAME = "triton_tma_persistent"

CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    # Storing the output tile in two halves halves its staging buffer, which buys a 4th stage.
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, SPLIT_STORE=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    # Mid-size M (a few hundred rows): small tiles give enough programs to fill 132 SMs.
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
]
# The interpreter runs descriptors too; a small tile keeps CPU tests fast.
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1,
                        SPLIT_STORE=True)
# Programs the interpreter's "persistent" grid uses (it has no SMs); > 1 so tiles are shared out.
_INTERPRET_PROGRAMS = 3


def candidates(M, N, K, dtype):
    return CONFIGS  # 16-bit inputs only (FAMILY.unfit)


@triton.jit
def tma_k_steps(x_desc, w_desc, off_m, off_n, k_first, k_last,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_BF16: tl.constexpr):
    """Main loop: fp32 sums of X[off_m:, :] @ W[off_n:, :]^T over K steps ``k_first`` to ``k_last``,
    tiles moved by TMA (zero-filled past the edges). Shared with ``stream_k``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(k_first, k_last):
        x = x_desc.load([off_m, kt * BLOCK_K])
        w = w_desc.load([off_n, kt * BLOCK_K])
        if UPCAST_BF16:  # interpreter only: its bf16 tl.dot is wrong, fp32 is right
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w.T, acc)
    return acc


@triton.jit
def tma_store_tile(acc, y_desc, b_ptr, off_m, off_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_STORE: tl.constexpr):
    """Epilogue: bias and activation while the accumulator is still in fp32, then a TMA store
    (clipped at the edges), as two [BLOCK_M, BLOCK_N // 2] halves with ``SPLIT_STORE``."""
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    if SPLIT_STORE:
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        y_desc.store([off_m, off_n], left.to(y_desc.dtype))
        y_desc.store([off_m, off_n + BLOCK_N // 2], right.to(y_desc.dtype))
    else:
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@triton.jit
def _tma_persistent_kernel(
    # descriptors: x [M, K], w [N, K], y [M, N]; bias is a plain pointer
    x_desc, w_desc, y_desc, b_ptr,
    # sizes
    M, N, K,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    UPCAST_BF16: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is right
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_STORE: tl.constexpr,  # store the tile as two [BLOCK_M, BLOCK_N // 2] halves
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait before reading x
):
    if USE_PDL:
        launch_dependents_then_wait()
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_in_group = GROUP_M * num_pid_n

    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        # Grouped tile order (see triton/tiled.py).
        first_m = (tile // num_in_group) * GROUP_M
        group_rows = min(num_pid_m - first_m, GROUP_M)
        off_m = (first_m + (tile % num_in_group) % group_rows) * BLOCK_M
        off_n = ((tile % num_in_group) // group_rows) * BLOCK_N

        acc = tma_k_steps(x_desc, w_desc, off_m, off_n, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_BF16)
        tma_store_tile(acc, y_desc, b_ptr, off_m, off_n, N, HAS_BIAS, ACTIVATION, BLOCK_M, BLOCK_N, SPLIT_STORE)


def launch(x, weight, bias, activation, out, config, *, input_precision, upcast_bf16, pdl=False,
           prefetch_weight=False):
    """Run on checked 16-bit arguments that pass ``rules.tma_compatible(x, weight, out)``, M >= 1.
    (``input_precision`` and ``prefetch_weight`` are keywords every family takes; unused here.)"""
    M, K = x.shape
    N = weight.shape[0]
    meta = dict(SPLIT_STORE=False) | dict(config)
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    y_desc = TensorDescriptor.from_tensor(out, [bm, bn // 2 if meta["SPLIT_STORE"] else bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if x.is_cuda:
        programs = cuda_sm_count(x.device)
    else:
        programs = _INTERPRET_PROGRAMS
    programs = min(programs, tiles)
    _tma_persistent_kernel[(programs,)](
        x_desc, w_desc, y_desc, bias if bias is not None else out,
        M, N, K,
        HAS_BIAS=bias is not None, ACTIVATION=activation, UPCAST_BF16=upcast_bf16,
        USE_PDL=pdl, **meta, **({"launch_pdl": True} if pdl else {}),
    )
    return out


def tma_unfit(p):
    """Why a problem cannot run on the TMA descriptors of this kernel (and of ``stream_k``'s), or None."""
    if p.half and p.tma_aligned and (p.capability is None or p.hopper):
        return None
    return "it needs fp16/bf16, 16-byte aligned rows and a Hopper GPU or the interpreter"


FAMILY = KernelFamily(NAME, unfit=tma_unfit, offered=lambda p: p.M > SMALL_M_MAX and p.hopper,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch,
                      interpret_config=INTERPRET_CONFIG)
