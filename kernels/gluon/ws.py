"""Hopper (sm_90) fused linear in Gluon with warp specialization: ``Y = act(X @ W^T + b)``.

The persistent TMA + wgmma kernels (``triton/tma_persistent.py``, ``gluon/wgmma.py``) run one
warpgroup that both issues the loads and waits on the tensor cores, so a load for a later k-slice
goes out only when that warpgroup gets back to it. Here the roles are split across warps, as
CUTLASS's Hopper kernels do:

- one loader warp walks the same tiles and streams X and W k-slices through a ring of
  ``STAGES`` shared-memory buffers, each with a *ready* barrier (the TMA bytes landed) and an
  *empty* barrier (every consumer is done with it);
- ``CONSUMERS`` (1 or 2) warpgroups wait on *ready*, run async wgmma, release the previous slice
  once its wgmma has completed, and at a tile's end apply bias and activation to their fp32
  accumulator and store it through their own shared-memory buffer with one TMA store.

Two consumers share the work one of two ways. Cooperative (``PINGPONG`` off): each owns
``BLOCK_M // 2`` rows of every tile, so a tile's W slice feeds twice the rows, and both reach their
epilogues together. Ping-pong: they take alternate tiles whole; the ring hands out slices in tile
order, so one consumer's MMAs on its tile run while the other is in its epilogue (the scheme
CUTLASS names the same), at the cost of half the rows per W slice. Either way the loader runs up to
``STAGES`` slices ahead, across tile boundaries. Every consumer is exactly one warpgroup because a
barrier arrive is issued by one thread of its partition: with one warpgroup per partition, that
thread's ``warpgroup_mma_wait`` covers the whole warpgroup's wgmma (a collective operation).

Only the launcher touches CUDA, so importing this module works on a CPU-only machine.
"""

from __future__ import annotations

import torch
import triton

from fusedserve.kernels.activations import apply_activation_gluon
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
    tile_coords,
    tma,
    tma_descriptor,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from fusedserve.kernels.rules import GLUON_SMALL_M_MAX, GLUON_WS_MIN_M, SMALL_M_MAX, SMS

NAME = "gluon_ws"
INTERPRET_CONFIG = None  # Gluon never runs under the interpreter

# Shared memory a config may use (of the 227 KB an H200 SM gives one block; the rest is barriers
# and slack).
SMEM_BUDGET = 224 * 1024
# Registers a thread of the loader warp gets (it only computes addresses) and of the second consumer
# warpgroup; the first consumer, the default partition, gets what maxnreg leaves (max_registers).
_LOADER_REGS: gl.constexpr = gl.constexpr(40)
_CONSUMER_REGS: gl.constexpr = gl.constexpr(232)


# Narrow tiles, offered up to GLUON_SMALL_M_MAX rows, where 128-row tiles leave most SMs idle
# (N=K=4096, M=128: 32 tiles of 128 x 128 against 128 of 64 x 64, cuBLASLt's tile there). Each
# reads its W slice once per 64 rows of X, the second time from L2 (GROUP_M runs the tiles that
# share a slice together).
NARROW_TILES = ((64, 64, 64, 1, False, 1), (64, 64, 128, 1, False, 1), (64, 128, 64, 1, False, 1),
                (64, 128, 128, 1, False, 1))


def _tiles():
    """(BLOCK_M, BLOCK_N, BLOCK_K, CONSUMERS, PINGPONG, EPI_SPLIT) worth timing. Each consumer
    warpgroup holds a ``consumer_rows`` x BLOCK_N fp32 accumulator: 64 x 256 or 128 x 128 is 128
    registers a thread, 64 x 128 is 64. EPI_SPLIT=2 stores the tile in two column halves through a
    buffer half as wide: for 128 x 256 that is what a fourth stage needs. A BLOCK_N that is not a
    power of two (192) is computed as two (``n_parts``)."""
    return ((128, 256, 64, 2, False, 2), (128, 256, 64, 2, False, 1), (256, 128, 64, 2, False, 1),
            (128, 128, 64, 2, True, 1), (128, 128, 64, 2, False, 1), (128, 128, 64, 1, False, 1),
            (128, 192, 64, 2, False, 1), (64, 192, 64, 1, False, 1), (64, 96, 64, 1, False, 1),
            *NARROW_TILES)


def n_parts(block_n):
    """A tile's columns as (power-of-two part, remainder): Triton tensors, TMA boxes and so the
    accumulators are powers of two in every dimension, so a 192-wide tile is a 128-wide and a
    64-wide accumulator fed from two W boxes (two wgmma per k-slice on the same X rows)."""
    first = 1 << (block_n.bit_length() - 1)
    rest = block_n - first
    if rest & (rest - 1):
        raise ValueError(f"BLOCK_N={block_n} is not a power of two plus a power of two")
    return first, rest


def wave_efficiency(M, N, bm, bn, sms):
    """Share of the programs' time doing useful tiles when ``cdiv(M, bm) * cdiv(N, bn)`` tiles run
    in waves of ``sms``, with the columns past N in the last column of tiles counted as waste."""
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    useful = triton.cdiv(M, bm) * N / bn
    return useful / (triton.cdiv(tiles, sms) * sms)


def consumer_rows(config):
    """Rows of a tile one consumer warpgroup computes (and stores)."""
    return config["BLOCK_M"] if config["PINGPONG"] else config["BLOCK_M"] // config["CONSUMERS"]


def smem_bytes(config, itemsize=2):
    """Shared memory a config takes: the operand ring and one output buffer per consumer."""
    ring = config["STAGES"] * (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * itemsize
    return ring + config["CONSUMERS"] * consumer_rows(config) * config["BLOCK_N"] // config["EPI_SPLIT"] * itemsize


def candidates(M, N, K, dtype):
    """Configs worth timing: each tile of ``_tiles`` that does not leave more than half the SMs
    idle at this shape (a 128 x 256 tile at M=512, N=4096 makes 64 tiles for 132 SMs) with the
    deepest ring that fits ``SMEM_BUDGET``, up to 6 stages. A 192-wide tile only where it fills
    the SMs' waves at least 10% better than a 256-wide tile of its height and as well as a 128-wide
    one (N=11008, M=256: 116 tiles of 128 x 192 for 132 SMs, one wave 87% full, against 86 of
    128 x 256, 65%, and 172 of 128 x 128, two waves 65% full). ``NARROW_TILES`` only up to
    ``GLUON_SMALL_M_MAX`` rows."""
    configs = []
    for tile in _tiles():
        bm, bn, bk, consumers, pingpong, epi_split = tile
        if M <= SMALL_M_MAX and bm > 64:
            continue  # (a few rows: only tiles of 64 rows, next to the weight-streaming kernels)
        if tile in NARROW_TILES and M > GLUON_SMALL_M_MAX:
            continue
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        if tiles < SMS // 2 and (bm, bn) != (128, 128):
            continue
        if n_parts(bn)[1]:
            fill = {width: wave_efficiency(M, N, bm, width, SMS) for width in (128, bn, 256)}
            if fill[bn] < 1.1 * fill[256] or fill[bn] < 0.99 * fill[128]:
                continue
        config = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CONSUMERS=consumers, PINGPONG=pingpong,
                      EPI_SPLIT=epi_split, GROUP_M=8, num_warps=4)
        stages = 6
        while stages > 2 and smem_bytes(dict(config, STAGES=stages), dtype.itemsize) > SMEM_BUDGET:
            stages -= 1
        configs.append(dict(config, STAGES=stages))
    # Where the tiles leave SMs idle, each config also without programmatic dependent launch: a
    # dependent launch measured slower there at N=11008 (docs/kernels.md); the tuner decides.
    configs += [dict(c, PDL=False) for c in configs
                if triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]) < SMS]
    return configs


@gluon.constexpr_function
def _acc_layout(SUB_M, BLOCK_N):
    # One warpgroup: its 4 warps stack along M, 16 rows each; one instruction spans all of N.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])


@gluon.jit
def _worker(state, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr,
            PINGPONG: gl.constexpr, EPI_SPLIT: gl.constexpr, SPLIT_N: gl.constexpr, ROLE: gl.constexpr):
    # Worker partitions share one signature; ROLE says which this is: 1 the second consumer
    # warpgroup, 0 the loader.
    if ROLE == 1:
        _consume(state, HAS_BIAS, ACTIVATION, GROUP_M, CONSUMERS, PINGPONG, EPI_SPLIT, SPLIT_N, 1)
    else:
        x_desc, w_desc, w2_desc, y_desc, y2_desc, bias_ptr, x_bufs, w_bufs, w2_bufs, y_bufs, y2_bufs, \
            ready, empty, turn, M, N, K = state
        _load(x_desc, w_desc, w2_desc, x_bufs, w_bufs, w2_bufs, ready, empty, M, N, K, GROUP_M, SPLIT_N)


@gluon.jit
def _load(x_desc, w_desc, w2_desc, x_bufs, w_bufs, w2_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr,
          SPLIT_N: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    N_FIRST: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = N_FIRST + SPLIT_N
    STAGES: gl.constexpr = x_bufs.shape[0]
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    if SPLIT_N > 0:
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes + w2_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    it = 0  # k-slices issued so far, over all tiles: slice it goes to stage it % STAGES
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_tiles):
            slot = it % STAGES
            # A barrier starts as if its phase 1 had completed, so the first pass over the ring
            # (waiting on phase 1) does not block; pass p waits for the consumers' release in p - 1.
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(x_desc, [pid_m * BLOCK_M, ki * BLOCK_K], bar, x_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [pid_n * BLOCK_N, ki * BLOCK_K], bar, w_bufs.index(slot))
            if SPLIT_N > 0:  # the tile's last SPLIT_N rows of W (zero-filled past N)
                tma.async_copy_global_to_shared(w2_desc, [pid_n * BLOCK_N + N_FIRST, ki * BLOCK_K], bar,
                                                w2_bufs.index(slot))
            it += 1


@gluon.jit
def _consume(state, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr,
             PINGPONG: gl.constexpr, EPI_SPLIT: gl.constexpr, SPLIT_N: gl.constexpr, CID: gl.constexpr):
    x_desc, w_desc, w2_desc, y_desc, y2_desc, bias_ptr, x_bufs, w_bufs, w2_bufs, y_bufs, y2_bufs, \
        ready, empty, turn, M, N, K = state
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    N_FIRST: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = N_FIRST + SPLIT_N
    SUB_M: gl.constexpr = BLOCK_M if PINGPONG else BLOCK_M // CONSUMERS  # this warpgroup's rows of a tile
    FIRST_ROW: gl.constexpr = 0 if PINGPONG else CID * SUB_M
    # Ping-pong: this consumer takes every CONSUMERS-th tile of the program's sequence, starting at
    # its CID-th; cooperative: every tile.
    TILE_STRIDE: gl.constexpr = CONSUMERS if PINGPONG else 1
    FIRST_TILE: gl.constexpr = CID if PINGPONG else 0
    STAGES: gl.constexpr = x_bufs.shape[0]
    dtype: gl.constexpr = y_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(SUB_M, N_FIRST)
    acc2_layout: gl.constexpr = _acc_layout(SUB_M, max(SPLIT_N, 8))  # (not used without SPLIT_N)
    y_smem = y_bufs.index(CID)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    step = gl.num_programs(0)
    it = FIRST_TILE * k_tiles  # the loader's count of k-slices before this consumer's next tile
    n = 0  # tiles this consumer has done
    for tile in range(gl.program_id(0) + FIRST_TILE * step, num_pid_m * num_pid_n, TILE_STRIDE * step):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        if PINGPONG:
            # Take turns on the tensor cores: start this tile's MMAs only once the other consumer
            # has released every slice of its tile before this one. That is also what keeps the
            # ready barriers' parity unambiguous: a consumer skipping the other's slices must never
            # wait on a slot two passes ahead of its barrier. The first tile of consumer 0 waits on
            # nothing (a barrier starts as if its phase 1 had completed).
            mbarrier.wait(turn.index(CID), (n & 1) ^ (1 - CID))
        acc = gl.zeros([SUB_M, N_FIRST], gl.float32, acc_layout)
        if SPLIT_N > 0:
            acc2 = gl.zeros([SUB_M, SPLIT_N], gl.float32, acc2_layout)
        for ki in range(k_tiles):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            x_rows = x_bufs.index(slot).slice(FIRST_ROW, SUB_M)  # this warpgroup's rows of X
            acc = warpgroup_mma(x_rows, w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            # At most one slice's wgmma in flight: the previous slice's have completed, so its stage
            # is free.
            if SPLIT_N > 0:
                acc2 = warpgroup_mma(x_rows, w2_bufs.index(slot).permute((1, 0)), acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ki > 0)
            it += 1
        if SPLIT_N > 0:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CID), count=1)  # the other's turn; this one's epilogue overlaps it
        it += (TILE_STRIDE - 1) * k_tiles  # (ping-pong) the other consumer's tile in between
        n += 1

        # Epilogue while the accumulator is still fp32: bias, activation, one downcast, TMA store.
        row = pid_m * BLOCK_M + FIRST_ROW
        acc = _bias_activation(acc, bias_ptr, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION).to(dtype)
        if EPI_SPLIT == 1:
            _store_tile(acc, y_smem, y_desc, row, pid_n * BLOCK_N)
        else:  # two column halves through a half-width buffer (the shared memory buys a stage)
            left, right = acc.reshape([SUB_M, 2, N_FIRST // 2]).permute(0, 2, 1).split()
            _store_tile(left, y_smem, y_desc, row, pid_n * BLOCK_N)
            _store_tile(right, y_smem, y_desc, row, pid_n * BLOCK_N + N_FIRST // 2)
        if SPLIT_N > 0:
            acc2 = _bias_activation(acc2, bias_ptr, pid_n * BLOCK_N + N_FIRST, N, HAS_BIAS, ACTIVATION).to(dtype)
            _store_tile(acc2, y2_bufs.index(CID), y2_desc, row, pid_n * BLOCK_N + N_FIRST)
    tma.store_wait(pendings=0)


@gluon.jit
def _bias_activation(acc, bias_ptr, col, N, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr):
    # acc + bias[col : col + width], then the activation, all in fp32.
    if HAS_BIAS:
        cols = col + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        acc = acc + gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    return apply_activation_gluon(acc, ACTIVATION)


@gluon.jit
def _store_tile(tile, y_smem, y_desc, row, col):
    tma.store_wait(pendings=0)  # the previous store (issued by one thread) has read y_smem,
    gl.thread_barrier()  # and this warpgroup's other threads know it before they overwrite it
    y_smem.store(tile)
    fence_async_shared()  # the generic-proxy writes before the TMA store reads them
    tma.async_copy_shared_to_global(y_desc, [row, col], y_smem)


@gluon.jit
def gluon_ws_kernel(
    # TMA descriptors: X [M, K] in [BLOCK_M, BLOCK_K] tiles; W [N, K] in [BLOCK_N, BLOCK_K] and Y
    # [M, N] in [consumer_rows, BLOCK_N] tiles, or, where BLOCK_N is split (SPLIT_N > 0), the tile's
    # first columns through w_desc/y_desc and its last SPLIT_N through w2_desc/y2_desc; bias [N] is
    # a plain pointer (not read without HAS_BIAS)
    x_desc, w_desc, w2_desc, y_desc, y2_desc, bias_ptr, M, N, K,
    HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, EPI_SPLIT: gl.constexpr, SPLIT_N: gl.constexpr,
    USE_PDL: gl.constexpr,
):
    if USE_PDL:  # X is the previous kernel's output: wait for it before the loader reads it
        gdc_launch_dependents_then_wait()
    dtype: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    y_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + y_desc.block_type.shape, y_desc.layout)
    if SPLIT_N > 0:
        w2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        y2_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + y2_desc.block_type.shape, y2_desc.layout)
    else:  # not read
        w2_bufs = w_bufs
        y2_bufs = y_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ping-pong: whose MMAs
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        # Released by every consumer (cooperative) or by the one whose tile it held (ping-pong).
        mbarrier.init(empty.index(s), count=1 if PINGPONG else CONSUMERS)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    fence_async_shared()  # barrier initialisation visible to the TMA unit

    # What every partition reads; the constexprs go beside it.
    state = (x_desc, w_desc, w2_desc, y_desc, y2_desc, bias_ptr, x_bufs, w_bufs, w2_bufs, y_bufs, y2_bufs,
             ready, empty, turn, M, N, K)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consume, (state, HAS_BIAS, ACTIVATION, GROUP_M, CONSUMERS, PINGPONG, EPI_SPLIT, SPLIT_N, 0)),
            (_worker, (state, HAS_BIAS, ACTIVATION, GROUP_M, CONSUMERS, PINGPONG, EPI_SPLIT, SPLIT_N, 1)),
            (_worker, (state, HAS_BIAS, ACTIVATION, GROUP_M, CONSUMERS, PINGPONG, EPI_SPLIT, SPLIT_N, 0)),
        ], [4, 1], [_CONSUMER_REGS, _LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consume, (state, HAS_BIAS, ACTIVATION, GROUP_M, CONSUMERS, PINGPONG, EPI_SPLIT, SPLIT_N, 0)),
            (_worker, (state, HAS_BIAS, ACTIVATION, GROUP_M, CONSUMERS, PINGPONG, EPI_SPLIT, SPLIT_N, 0)),
        ], [1], [_LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for c in gl.static_range(2):
        mbarrier.invalidate(turn.index(c))


def max_registers(config):
    """The per-thread register cap (``maxnreg``) that lets 4 * (CONSUMERS + 1) warps fit one SM's
    64K registers, rounded down to a multiple of 8."""
    warps = 4 * (config["CONSUMERS"] + 1)
    return (65536 // (warps * 32)) // 8 * 8


def descriptors(x, weight, out, config):
    """TMA descriptors (X, W, W's last columns, Y, Y's last columns) for ``config``: the last two
    repeat W's and Y's where BLOCK_N is a power of two. The tensors may be MockTensors."""
    sub_m = consumer_rows(config)
    first, rest = n_parts(config["BLOCK_N"])
    x_desc = tma_descriptor(x, (config["BLOCK_M"], config["BLOCK_K"]))
    w_desc = tma_descriptor(weight, (first, config["BLOCK_K"]))
    y_desc = tma_descriptor(out, (sub_m, first // config["EPI_SPLIT"]))
    if not rest:
        return x_desc, w_desc, w_desc, y_desc, y_desc
    return (x_desc, w_desc, tma_descriptor(weight, (rest, config["BLOCK_K"])), y_desc,
            tma_descriptor(out, (sub_m, rest)))


def launch(x, weight, bias, activation, out, config, *, input_precision=None, upcast_bf16=False, pdl=False,
           prefetch_weight=False):
    """Run on checked arguments (the family's launch, ``fusedserve.kernels.family``): ``x
    [M, K]``, ``weight [N, K]``, ``out [M, N]``, fp16/bf16 of one dtype, TMA-aligned, on a Hopper
    GPU. ``config`` comes from ``candidates``. ``pdl``: launch as a programmatic dependent launch,
    unless the config says ``PDL=False``.
    ``input_precision``, ``upcast_bf16`` and ``prefetch_weight`` are taken for the signature every
    kernel family shares and not used."""
    M, K = x.shape
    N = weight.shape[0]
    if x.dtype not in TORCH_TO_GL or weight.dtype != x.dtype or out.dtype != x.dtype:
        raise TypeError(f"x, weight, out: fp16 or bf16 of one dtype, got {x.dtype}, {weight.dtype}, {out.dtype}")
    tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    pdl = pdl and config.get("PDL", True)
    meta = dict(launch_pdl=True) if pdl else {}
    with torch.cuda.device(x.device):
        gluon_ws_kernel[(min(cuda_sm_count(x.device), tiles), )](
            *descriptors(x, weight, out, config), bias if bias is not None else out, M, N, K,
            **kernel_meta(config, bias is not None, activation, pdl), **meta)
    return out


def kernel_meta(config, has_bias, activation, pdl):
    """The kernel's compile-time arguments for ``config``."""
    return dict(HAS_BIAS=has_bias, ACTIVATION=activation, STAGES=config["STAGES"], GROUP_M=config["GROUP_M"],
                CONSUMERS=config["CONSUMERS"], PINGPONG=config["PINGPONG"], EPI_SPLIT=config["EPI_SPLIT"],
                SPLIT_N=n_parts(config["BLOCK_N"])[1], USE_PDL=pdl, num_warps=4,
                maxnreg=max_registers(config))


FAMILY = KernelFamily(NAME, unfit=hopper_unfit, offered=lambda p: p.M > GLUON_WS_MIN_M,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch)
