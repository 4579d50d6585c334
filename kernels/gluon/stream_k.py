"""Hopper (sm_90) weight streaming with the K loop dealt out evenly over the SMs (stream-K), in
Gluon: ``Y = act(X @ W^T + b)``, 1 <= M <= 128.

``gluon_small_m`` gives each program one W tile (or one of a few K slices of it): where N makes a
few dozen tiles, most SMs idle, and where it makes a little over a wave, the last wave runs part
full. Here the grid is one or two programs per SM and the layer's ``n_tiles * k_tiles`` K steps are
dealt out in equal contiguous runs: a program streams one tile's K, then the next tile's, so every
SM reads the same share of W. A tile whose K steps two or more programs shared is finished by the
last of them to arrive: each stores its fp32 partial sums (a program has at most two such tiles,
its first and its last), a counter per tile counts them, and the last adds them in program order
(the same sum every run) and applies bias and activation.

Swap AB and the TMA ring as in ``gluon_small_m``: a wgmma computes a ``[BLOCK_N, BLOCK_M]`` tile of
Y^T = W @ X^T. Only the launcher touches CUDA, so importing this module works on a CPU-only machine.
"""

from __future__ import annotations

import torch
import triton

from fusedserve.kernels.device import cuda_sm_count
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.gluon.common import (
    TORCH_TO_GL,
    fence_async_shared,
    gdc_launch_dependents_then_wait,
    gl,
    gluon,
    hopper_unfit,
    mbarrier,
    tma,
    tma_descriptor,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from fusedserve.kernels.gluon.small_m import _acc_layout, _epilogue, block_m
from fusedserve.kernels.rules import SMS
from fusedserve.kernels.triton.small_m import tile_counters

NAME = "gluon_stream_k"
MAX_M = 128  # one X tile: every program's runs cover whole columns of Y^T

# Shared memory the ring of all programs on one SM may fill (as ``gluon_small_m``'s).
_SMEM_BUDGET = 200 * 1024
# (BLOCK_N, num_warps, BLOCK_K) of the tiles timed, each with one and with two programs per SM.
_TILES = ((64, 4, 128), (64, 4, 256), (128, 8, 128))


def candidates(M, N, K, dtype):
    """Configs worth timing: each tile of ``_TILES`` whose K tile is no longer than K, with the
    deepest ring that fits one program per SM (``PER_SM=1``) and two (``PER_SM=2``)."""
    bm, configs = block_m(M), []
    for bn, warps, block_k in _TILES:
        if block_k > max(128, triton.next_power_of_2(K)):
            continue
        for per_sm in (1, 2):
            stages = min(12, _SMEM_BUDGET // per_sm // ((bn + bm) * block_k * 2))
            if stages >= 3:
                configs.append(dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=block_k, PER_SM=per_sm, STAGES=stages,
                                    num_warps=warps))
    return configs


@gluon.jit
def gluon_stream_k_kernel(
    # TMA descriptors: W [N, K] (nn.Linear layout), X [M, K]
    w_desc, x_desc,
    # pointers: bias [N] (unread without HAS_BIAS), Y [M, N], the partial sums [2 * programs, BLOCK_N
    # * BLOCK_M] fp32 and int32 counters, one per W tile (zero between launches)
    b_ptr, y_ptr, part_ptr, lock_ptr,
    # sizes and Y's row stride (its column stride is 1)
    M, N, K, stride_ym,
    # meta-parameters
    HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, STAGES: gl.constexpr,
    USE_PDL: gl.constexpr,  # launched as a programmatic dependent launch: wait before reading X
    num_warps: gl.constexpr,
):
    """This program's run of K steps: Y[:, tile] for each W tile it streams whole, partial sums of
    the (at most two) it shares."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = w_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, BLOCK_M, num_warps)

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    k_tiles = gl.cdiv(K, BLOCK_K)
    steps = gl.cdiv(N, BLOCK_N) * k_tiles  # K steps of the whole layer; each program takes a run
    first = pid * steps // programs
    n_steps = (pid + 1) * steps // programs - first
    first_tile = first // k_tiles

    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()  # barrier initialisation must be visible to the TMA unit
    if USE_PDL:
        gdc_launch_dependents_then_wait()
    for s in gl.static_range(STAGES - 1):
        _issue(w_desc, x_desc, w_bufs, x_bufs, ready, s, first + s, k_tiles, s < n_steps)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    for i in range(n_steps):
        step = first + i
        tile = step // k_tiles
        kt = step - tile * k_tiles
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(w_bufs.index(slot), x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        # At most one wgmma in flight: step i - 1's slot is free for step i + STAGES - 1.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        nxt = i + STAGES - 1
        _issue(w_desc, x_desc, w_bufs, x_bufs, ready, nxt % STAGES, first + nxt, k_tiles, nxt < n_steps)
        if (kt == k_tiles - 1) | (i == n_steps - 1):  # this program's last step of the tile
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if (step - kt >= first) & (kt == k_tiles - 1):  # the whole K of the tile was ours
                _finish(acc, tile, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS, ACTIVATION, acc_layout)
            else:
                _share(acc, tile, tile != first_tile, pid, programs, steps, k_tiles, b_ptr, y_ptr, part_ptr,
                       lock_ptr, M, N, stride_ym, HAS_BIAS, ACTIVATION, acc_layout)
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


@gluon.jit
def _issue(w_desc, x_desc, w_bufs, x_bufs, ready, slot, step, k_tiles, pred):
    # The W and X tiles of K step `step` (tile-major) into ring slot `slot`; its barrier counts both.
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    tile = step // k_tiles
    k = (step - tile * k_tiles) * BLOCK_K
    bar = ready.index(slot)
    mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [tile * BLOCK_N, k], bar, w_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(x_desc, [0, k], bar, x_bufs.index(slot), pred)


@gluon.jit
def _finish(acc, tile, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
            LAYOUT: gl.constexpr):
    # Bias and activation on the tile's full sums (acc[j, i] is Y[i, tile * BLOCK_N + j]), then its store.
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LAYOUT))
    if HAS_BIAS:
        bias = gl.load(b_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
    else:
        bias = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, LAYOUT))
    cols2 = gl.expand_dims(cols, 1)
    rows2 = gl.expand_dims(rows, 0)
    _epilogue(acc, bias, cols2, rows2, (cols2 < N) & (rows2 < M), y_ptr, stride_ym, HAS_BIAS, ACTIVATION)


@gluon.jit
def _share(acc, tile, is_last_tile, pid, programs, steps, k_tiles, b_ptr, y_ptr, part_ptr, lock_ptr, M, N,
           stride_ym, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, LAYOUT: gl.constexpr):
    # Store this program's partial sums of `tile` (slot 0: its first tile, 1: its last), count them;
    # the last program to arrive adds every sharer's in program order and finishes the tile.
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    offs = (gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT)), 1) * BLOCK_M
            + gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LAYOUT)), 0))
    size: gl.constexpr = BLOCK_N * BLOCK_M
    gl.store(part_ptr + (2 * pid + is_last_tile.to(gl.int32)) * size + offs, acc)
    gl.thread_barrier()  # every thread's stores are issued before the counter moves
    # The programs whose runs meet this tile: the owners of its first and last K steps.
    lo = ((tile * k_tiles + 1) * programs - 1) // steps
    hi = (((tile + 1) * k_tiles) * programs - 1) // steps
    lock = lock_ptr + tile
    if gl.atomic_add(lock, 1, sem="acq_rel") == hi - lo:
        total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, LAYOUT)
        for p in range(lo, hi + 1):  # .cg: from L2, never from a stale L1 line
            slot = 2 * p + ((p * steps // programs) // k_tiles != tile).to(gl.int32)
            total += gl.load(part_ptr + slot * size + offs, cache_modifier=".cg")
        _finish(total, tile, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS, ACTIVATION, LAYOUT)
        gl.atomic_xchg(lock, 0)  # ready for the next launch


def descriptors(x, weight, config):
    """TMA descriptors of W and X for ``config`` (``x``/``weight`` may be MockTensors)."""
    return (tma_descriptor(weight, (config["BLOCK_N"], config["BLOCK_K"])),
            tma_descriptor(x, (config["BLOCK_M"], config["BLOCK_K"])))


def programs(N, K, config, sms=SMS) -> int:
    """The grid: ``PER_SM`` programs on each of ``sms`` SMs, never more than the layer's K steps."""
    steps = triton.cdiv(N, config["BLOCK_N"]) * triton.cdiv(K, config["BLOCK_K"])
    return min(steps, sms * config["PER_SM"])


def launch(x, weight, bias, activation, out, config, *, input_precision=None, upcast_bf16=False, pdl=False,
           prefetch_weight=False):
    """Run on checked arguments (the family's launch, ``fusedserve.kernels.family``): ``x
    [M, K]``, ``weight [N, K]`` fp16/bf16 with TMA-aligned rows, ``out [M, N]`` with unit column
    stride, 1 <= M <= MAX_M, on a Hopper GPU; ``config`` from ``candidates``. ``pdl``: launch as a
    programmatic dependent launch. ``prefetch_weight``, ``input_precision`` and ``upcast_bf16`` are
    taken for the signature every family shares and not used."""
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= min(MAX_M, config["BLOCK_M"]):
        raise ValueError(f"x: the stream-K kernel takes 1 to {min(MAX_M, config['BLOCK_M'])} rows here, got M={M}")
    if x.dtype not in TORCH_TO_GL or weight.dtype != x.dtype:
        raise TypeError(f"x, weight: fp16 or bf16 of one dtype, got {x.dtype} and {weight.dtype}")
    locks = tile_counters(x.device)
    if locks is None:
        raise ValueError("the stream-K kernel's first launch on a device must come before any CUDA-graph capture")
    if triton.cdiv(N, config["BLOCK_N"]) > locks.numel():
        raise ValueError(f"config {config}: {triton.cdiv(N, config['BLOCK_N'])} W tiles, more than the "
                         f"{locks.numel()} tile counters")
    grid = programs(N, K, config, cuda_sm_count(x.device))
    part = torch.empty((2 * grid, config["BLOCK_N"] * config["BLOCK_M"]), device=x.device, dtype=torch.float32)
    w_desc, x_desc = descriptors(x, weight, config)
    meta = dict(launch_pdl=True) if pdl else {}
    with torch.cuda.device(x.device):
        gluon_stream_k_kernel[(grid, )](
            w_desc, x_desc, bias if bias is not None else out, out, part, locks, M, N, K, out.stride(0),
            HAS_BIAS=bias is not None, ACTIVATION=activation, STAGES=config["STAGES"], USE_PDL=pdl,
            num_warps=config["num_warps"], **meta)
    return out


def _unfit(p):
    if p.M > MAX_M:
        return f"it takes at most {MAX_M} rows"
    return hopper_unfit(p)


# An experiment the tuner does not time: on 8 shapes of 17-128 rows it ran 1.1-2.2x slower than
# gluon_small_m (docs/kernels.md, "Stream-K"); bench/configs.py and run_kernel still run it by name.
FAMILY = KernelFamily(NAME, unfit=_unfit, offered=lambda p: False,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch)
