"""Stream-K GEMM for Hopper's 16-bit rows: the K steps of the tiles past the full waves shared out.

``Y[M, N] = act(X[M, K] @ W[N, K]^T + b[N])``. A persistent grid of one program per SM. Tiles that
fill whole waves run as in ``tma_persistent``, one program each (``DP_TILES``); the rest (the last,
partial wave, with ``SK_WAVES`` full waves before it) are cut into their K steps, and each program
takes an equal contiguous run of those steps, which may start and end inside a tile. A program that
covers a whole tile stores it; one that covers part of a tile stores its fp32 partial sums, and the
last program to arrive at that tile adds every part in program order (the same bits whatever the
timing), applies the bias and activation and stores Y. For few tiles over a long K (M=2494 N=328
K=13936: 60 tiles of 128 x 128 on 132 SMs) most SMs would otherwise idle; there cuBLAS ran up to
1.47x faster than our tiled families (docs/kernels.md).
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedserve.kernels.device import cuda_sm_count
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.rules import SMS
from fusedserve.kernels.triton.common import grouped_tile, launch_dependents_then_wait
from fusedserve.kernels.triton.tma_persistent import tma_k_steps, tma_store_tile, tma_unfit

NAME = "triton_stream_k"

# Tiles timed, each with the stream-K part over the partial wave alone (SK_WAVES=0) and over it and
# one full wave before it (SK_WAVES=1: longer runs of K steps per program, fewer tiles cut short).
TILES = [dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
         dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5)]
SK_WAVES = (0, 1)
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, SK_WAVES=1, num_warps=4, num_stages=1)
# Programs the interpreter's grid uses (it has no SMs); > 1 so K steps are shared out.
_INTERPRET_PROGRAMS = 3


def schedule(M, N, K, config, programs):
    """``(dp_tiles, sk_per, sk_extra, programs)``: how ``config`` deals the layer to ``programs``
    persistent programs. The first ``dp_tiles`` tiles run whole; the rest's K steps are dealt
    ``sk_per`` to a program, one more to each of the first ``sk_extra``."""
    tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    k_tiles = triton.cdiv(K, config["BLOCK_K"])
    waves, partial = divmod(tiles, programs)
    dp_tiles = tiles if partial == 0 else max(0, waves - config["SK_WAVES"]) * programs
    sk_steps = (tiles - dp_tiles) * k_tiles
    if dp_tiles == 0:  # no whole tiles to share the grid with: no more programs than K steps
        programs = min(programs, sk_steps)
    return dp_tiles, sk_steps // programs, sk_steps % programs, programs


def candidates(M, N, K, dtype):
    """Each tile at each ``SK_WAVES`` that gives the stream-K part work (a partial last wave), once
    per distinct schedule on 132 SMs. (16-bit inputs only: ``FAMILY.unfit``.)"""
    found, seen = [], set()
    for tile in TILES:
        for waves in SK_WAVES:
            config = dict(tile, SK_WAVES=waves)
            plan = schedule(M, N, K, config, SMS)
            if plan[1:3] != (0, 0) and (str(tile), plan) not in seen:
                seen.add((str(tile), plan))
                found.append(config)
    return found


@triton.jit
def _first_step(program, SK_PER, SK_EXTRA):
    """The first stream-K step of ``program``'s run."""
    return program * SK_PER + tl.minimum(program, SK_EXTRA)


@triton.jit
def _owner(step, SK_PER, SK_EXTRA):
    """The program whose run holds stream-K step ``step``."""
    long_steps = SK_EXTRA * (SK_PER + 1)
    return tl.where(step < long_steps, step // (SK_PER + 1),
                    SK_EXTRA + (step - long_steps) // tl.maximum(SK_PER, 1))


@triton.jit
def _part_ptrs(part_ptr, program, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to ``program``'s partial tile ``slot`` (0: its run's first tile, 1: its last) in
    ``part [programs, 2, BLOCK_M, BLOCK_N]``."""
    base = (program * 2 + slot) * (BLOCK_M * BLOCK_N)  # under 2**31: at most 2 * 132 tiles of 128 x 256
    return part_ptr + base + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _sum_parts(part_ptr, tile_step, tile_steps, SK_PER, SK_EXTRA,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A shared tile's sums: every part, in program order. The first program's part is its run's
    last tile unless its run starts at this tile; every later program's run starts here."""
    first, last = _owner(tile_step, SK_PER, SK_EXTRA), _owner(tile_step + tile_steps - 1, SK_PER, SK_EXTRA)
    slot = (_first_step(first, SK_PER, SK_EXTRA) < tile_step).to(tl.int32)
    acc = tl.load(_part_ptrs(part_ptr, first, slot, BLOCK_M, BLOCK_N), cache_modifier=".cg")
    for program in range(first + 1, last + 1):
        acc += tl.load(_part_ptrs(part_ptr, program, 0, BLOCK_M, BLOCK_N), cache_modifier=".cg")
    return acc


@triton.jit
def _stream_k_kernel(
    # descriptors: x [M, K], w [N, K], y [M, N]; bias is a plain pointer
    x_desc, w_desc, y_desc, b_ptr,
    part_ptr,  # fp32 [programs, 2, BLOCK_M, BLOCK_N]: partial sums of a run's first and last tile
    count_ptr,  # int32 [tiles - DP_TILES], zeros: parts stored so far of each stream-K tile
    # sizes
    M, N, K,
    # the schedule (``schedule``)
    DP_TILES, SK_PER, SK_EXTRA,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait before reading x
):
    if USE_PDL:
        launch_dependents_then_wait()
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)

    # Whole tiles, one program each, in grouped order.
    for tile in tl.range(pid, DP_TILES, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tma_k_steps(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, k_tiles,
                          BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_BF16)
        tma_store_tile(acc, y_desc, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION,
                       BLOCK_M, BLOCK_N, False)

    # This program's run of the remaining tiles' K steps, a tile (or part of one) at a time.
    start = _first_step(pid, SK_PER, SK_EXTRA)
    end = start + SK_PER + (pid < SK_EXTRA).to(tl.int32)
    step = start
    while step < end:
        sk_tile = step // k_tiles
        k_first = step - sk_tile * k_tiles
        k_last = tl.minimum(k_tiles, k_first + end - step)
        pid_m, pid_n = grouped_tile(DP_TILES + sk_tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tma_k_steps(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_first, k_last,
                          BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_BF16)
        if (k_first == 0) & (k_last == k_tiles):
            tma_store_tile(acc, y_desc, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION,
                           BLOCK_M, BLOCK_N, False)
        else:
            # Store this part, then count it (the atomic releases the stores of every thread after the
            # barrier); the tile's last part to arrive adds them all.
            tl.store(_part_ptrs(part_ptr, pid, (step > start).to(tl.int32), BLOCK_M, BLOCK_N), acc)
            tl.debug_barrier()
            tile_step = sk_tile * k_tiles
            parts = _owner(tile_step + k_tiles - 1, SK_PER, SK_EXTRA) - _owner(tile_step, SK_PER, SK_EXTRA) + 1
            if tl.atomic_add(count_ptr + sk_tile, 1) == parts - 1:
                acc = _sum_parts(part_ptr, tile_step, k_tiles, SK_PER, SK_EXTRA, BLOCK_M, BLOCK_N)
                tma_store_tile(acc, y_desc, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, ACTIVATION,
                               BLOCK_M, BLOCK_N, False)
        step += k_last - k_first


def launch(x, weight, bias, activation, out, config, *, input_precision, upcast_bf16, pdl=False,
           prefetch_weight=False):
    """Run on checked 16-bit arguments that pass ``rules.tma_compatible(x, weight, out)``, M >= 1; the
    partial sums and tile counters are new buffers (the counters zeroed). (``input_precision`` and
    ``prefetch_weight`` are keywords every family takes; unused here.)"""
    M, K = x.shape
    N = weight.shape[0]
    meta = dict(config)
    waves = meta.pop("SK_WAVES")
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    programs = cuda_sm_count(x.device) if x.is_cuda else _INTERPRET_PROGRAMS
    dp_tiles, sk_per, sk_extra, programs = schedule(M, N, K, dict(meta, SK_WAVES=waves), programs)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    part = torch.empty((programs, 2, bm, bn) if dp_tiles < tiles else (1,), device=x.device, dtype=torch.float32)
    counts = torch.zeros(max(1, tiles - dp_tiles), device=x.device, dtype=torch.int32)
    _stream_k_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), bias if bias is not None else out, part, counts,
        M, N, K, dp_tiles, sk_per, sk_extra,
        HAS_BIAS=bias is not None, ACTIVATION=activation, UPCAST_BF16=upcast_bf16,
        USE_PDL=pdl, **meta, **({"launch_pdl": True} if pdl else {}),
    )
    return out


# Not timed by the tuner: on an H100 every candidate ran 0.41-0.82x cuBLAS at 12 few-tile long-K
# shapes (bench/results/configs.jsonl); it runs by name (``bench/configs.py triton_stream_k``).
FAMILY = KernelFamily(NAME, unfit=tma_unfit, offered=lambda p: False,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch,
                      interpret_config=INTERPRET_CONFIG)
