"""Hopper (sm_90) weight streaming for small batches, in Gluon: ``Y = act(X @ W^T + b)``, M <= 256.

Below a few hundred rows a layer is bound by reading W once, so everything here serves that
stream. "Swap AB": each wgmma computes a ``[BLOCK_N, BLOCK_M]`` tile of Y^T = W @ X^T, so W's rows
fill the instruction's 64-row side and the batch only its narrow side (n = 8 to 128: M is padded
to 8, not to 64). Each program owns ``BLOCK_N`` rows of W, one of ``SPLIT_K`` slices of K and
``BLOCK_M`` rows of X; splitting M gives a narrow layer more programs without split-K's fp32
partial sums (the programs sharing a W tile run together, so W comes from HBM about once). TMA
brings W and X tiles into a ring of ``STAGES`` shared-memory slots, one mbarrier each: a few bulk
copies keep ~150-200 KB in flight per SM. As a programmatic dependent launch it waits for the
previous kernel before reading X; with ``prefetch_weight`` it reads just its first W tile before
that wait (docs/kernels.md has the measurements behind these choices).

Split-K partial sums go to an fp32 workspace; the last split of each tile to arrive (a counter per
tile) adds them in split order (deterministic) and applies bias and activation, in this launch.

Only the launcher touches CUDA, so importing this module works on a CPU-only machine.
"""

from __future__ import annotations

import torch
import triton

from fusedserve.kernels.activations import apply_activation_gluon
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
from fusedserve.kernels.provisional import closest_config
from fusedserve.kernels.rules import GLUON_SMALL_M_MAX, SHORT_K, SMS, short_and_wide, w_tiles
from fusedserve.kernels.triton.small_m import tile_counters

NAME = "gluon_small_m"
MAX_M = GLUON_SMALL_M_MAX  # rows of X one launch takes (in tiles of at most 128)
INTERPRET_CONFIG = None  # Gluon never runs under the interpreter

# Shared memory the ring may fill (an sm_90 SM has 227 KB; the rest is for barriers and spills).
_SMEM_BUDGET = 200 * 1024


# Programs worth launching: two per SM of an H200; more M splits than that only re-read W.
_MAX_PROGRAMS = 2 * SMS


def block_m(M):
    """The tallest X tile for M rows: wgmma's n is at least 8, and past 128 the batch is split (a
    64 x 128 fp32 accumulator is 64 registers a thread). Rows past M are zero-filled by TMA."""
    return min(128, max(8, triton.next_power_of_2(M)))


def _row_tiles(M, N):
    """X tile heights worth timing: the tallest, then halves down to wgmma's n = 8 while the grid
    stays within ``_MAX_PROGRAMS`` (with 64-row W tiles)."""
    heights, h = [], block_m(M)
    while h >= 8 and (not heights or triton.cdiv(N, 64) * triton.cdiv(M, h) <= _MAX_PROGRAMS):
        heights.append(h)
        h //= 2
    return heights


# (BLOCK_K, STAGES) of the 64-row W tiles worth timing (None: the deepest ring that fits). From the
# sweep: 256 deep won at M <= 16 and for narrow layers, 128 deep with a deep ring at M = 32 and 64,
# and with a 4-deep ring for the widest layer timed (N=11008).
_DEPTHS = ((256, None), (128, None), (128, 4), (64, None))
# The K splits offered with the tallest X tile.
_SPLITS = (1, 2)
# Wider W tiles (rows, warps, from this many rows of X) offered with the tallest X tile: 128 rows
# on 8 warps ran 0.88-0.92x the 64-row tile's time at M=20-40 (configs.jsonl, docs/kernels.md).
_WIDE_TILES: tuple[tuple[int, int, int], ...] = ((128, 8, 17), )


def candidates(M, N, K, dtype):
    """Configs worth timing: 64-row W tiles at the depths of ``_DEPTHS`` with the tallest X tile,
    each unsplit and split along K (``_SPLITS``, where each part keeps >= 2 K tiles); then, unsplit
    along K, the shorter X tiles of ``_row_tiles`` at the two deepest tiles of ``_DEPTHS``; then the
    wider W tiles of ``_WIDE_TILES`` with the tallest X tile. Where a grid has more programs than an
    H200 has SMs, each ring comes twice: sized so that two programs share an SM, and as deep as one
    program alone can have (the last wave then runs part full, which still won at N=11008:
    docs/kernels.md)."""
    configs = []
    for i, bm in enumerate(_row_tiles(M, N)):
        for block_k, stages in _DEPTHS if i == 0 else _DEPTHS[:2]:
            for s in _SPLITS if i == 0 else (1, ):
                _add_rings(configs, M, N, K, dict(BLOCK_N=64, BLOCK_M=bm, BLOCK_K=block_k, SPLIT_K=s, num_warps=4),
                           stages)
    bm = block_m(M)
    for rows, warps, min_m in _WIDE_TILES:
        for block_k, stages in _DEPTHS[:2] if M >= min_m else ():
            for s in _SPLITS:
                _add_rings(configs, M, N, K, dict(BLOCK_N=rows, BLOCK_M=bm, BLOCK_K=block_k, SPLIT_K=s,
                                                  num_warps=warps), stages)
    return configs


def _add_rings(configs, M, N, K, tile, stages):
    """``tile`` with its ring (``stages`` deep, or the deepest that fits where None) added to
    ``configs`` unless there, too shallow, or split into parts of under 2 K tiles; a second, half-size
    ring where the grid is over one wave."""
    bn, bm, block_k, s = tile["BLOCK_N"], tile["BLOCK_M"], tile["BLOCK_K"], tile["SPLIT_K"]
    programs = triton.cdiv(N, bn) * triton.cdiv(M, bm) * s
    for budget in ((_SMEM_BUDGET // 2, ) if programs > SMS else ()) + (_SMEM_BUDGET, ):
        deepest = min(12, budget // ((bn + bm) * block_k * 2))
        depth = deepest if stages is None else min(stages, deepest)
        if depth < 3 or (block_k == 64 and bm <= 64):  # 64 deep only pays where X's tile is wide
            continue
        config = dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=block_k, SPLIT_K=s, STAGES=depth, num_warps=tile["num_warps"])
        if (s == 1 or triton.cdiv(K, block_k) >= 2 * s) and config not in configs:
            configs.append(config)


@gluon.constexpr_function
def _acc_layout(BLOCK_N, BLOCK_M, num_warps):
    # Y^T tile [BLOCK_N, BLOCK_M]: warps stack along W's rows, 16 each; one instruction spans M.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, BLOCK_M, 16])


@gluon.jit
def gluon_small_m_kernel(
    # TMA descriptors: W [N, K] (nn.Linear layout), X [M, K]
    w_desc, x_desc,
    # pointers: bias [N] (unread without HAS_BIAS), Y [M, N], split-K workspace [SPLIT_K, M, N] fp32
    # and int32 tile counters (both unread when SPLIT_K == 1)
    b_ptr, y_ptr, part_ptr, lock_ptr,
    # sizes and Y's row stride (its column stride is 1)
    M, N, K, stride_ym,
    # meta-parameters
    HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
    USE_PDL: gl.constexpr,  # launched as a programmatic dependent launch: wait before reading X
    PREFETCH_W: gl.constexpr,  # W is constant: read its first tile before that wait (needs USE_PDL)
    num_warps: gl.constexpr,
):
    """Y[m, n] = act(sum_k X[m, k] W[n, k] + b[n]) for this program's BLOCK_N columns and K slice."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = w_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, BLOCK_M, num_warps)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M
    # This program's K tiles (possibly none; the K tail is zero-filled by TMA).
    k_tiles = gl.cdiv(K, BLOCK_K)
    per_split = gl.cdiv(k_tiles, SPLIT_K)
    kt_start = pid_k * per_split
    n_k = gl.minimum(per_split, k_tiles - kt_start)

    # The ring: STAGES slots of a W tile and an X tile, one barrier per slot counting both.
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()  # barrier initialisation must be visible to the TMA unit

    if PREFETCH_W:
        # W is constant: its first tile may be read while the previous kernel still runs. One tile
        # only, to cover this launch's first-load latency (filling the whole ring before the wait
        # measured 0.4-0.5 us slower: its bytes only compete with the previous kernel's stream).
        # The slot's barrier counts both tiles, so the X copy may follow after the wait.
        bar = ready.index(0)
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=n_k > 0)
        tma.async_copy_global_to_shared(w_desc, [off_n, kt_start * BLOCK_K], bar, w_bufs.index(0), n_k > 0)
    if USE_PDL:
        gdc_launch_dependents_then_wait()
    # The bias is loaded now and used after the main loop, so its trip to memory overlaps the loop
    # instead of adding to the program's tail.
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))  # along N
    if HAS_BIAS:
        bias = gl.load(b_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
    else:
        bias = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, acc_layout))
    # Prologue: the first STAGES - 1 slots (slot 0's W tile is in flight already with PREFETCH_W).
    if PREFETCH_W:
        tma.async_copy_global_to_shared(x_desc, [off_m, kt_start * BLOCK_K], ready.index(0), x_bufs.index(0),
                                        n_k > 0)
    for s in gl.static_range(1 if PREFETCH_W else 0, STAGES - 1):
        _issue(w_desc, x_desc, w_bufs, x_bufs, ready, s, off_n, off_m, (kt_start + s) * BLOCK_K, s < n_k)

    # Main loop: the wgmma on slot i overlaps the copies into the other STAGES - 1 slots.
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    for i in range(n_k):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        # A = W tile [BLOCK_N, BLOCK_K]; B = X tile [BLOCK_M, BLOCK_K] read as [BLOCK_K, BLOCK_M].
        acc = warpgroup_mma(w_bufs.index(slot), x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        # At most one wgmma in flight: tile i - 1 is consumed, so its slot takes tile i + STAGES - 1.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        nxt = i + STAGES - 1
        _issue(w_desc, x_desc, w_bufs, x_bufs, ready, nxt % STAGES, off_n, off_m, (kt_start + nxt) * BLOCK_K,
               nxt < n_k)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    # Epilogue. acc[j, i] is Y[i, off_n + j] (fp32).
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))  # along M
    cols2 = gl.expand_dims(cols, 1)
    rows2 = gl.expand_dims(rows, 0)
    mask = (cols2 < N) & (rows2 < M)
    if SPLIT_K > 1:
        # Every split stores its partial sums; the last to arrive adds them all in split order.
        p_offs = rows2.to(gl.int64) * N + cols2
        gl.store(part_ptr + pid_k * M * N + p_offs, acc, mask=mask)
        # Every thread's partial store is issued before the tile's counter moves (the barrier);
        # the counter's acq_rel orders those stores before the last split's reads.
        gl.thread_barrier()
        lock = lock_ptr + pid_m * gl.num_programs(0) + pid_n  # one counter per output tile
        arrived = gl.atomic_add(lock, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
            for split in range(SPLIT_K):  # .cg: from L2, never from a stale L1 line
                acc += gl.load(part_ptr + split * M * N + p_offs, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(acc, bias, cols2, rows2, mask, y_ptr, stride_ym, HAS_BIAS, ACTIVATION)
            gl.atomic_xchg(lock, 0)  # ready for the next launch
    else:
        _epilogue(acc, bias, cols2, rows2, mask, y_ptr, stride_ym, HAS_BIAS, ACTIVATION)


@gluon.jit
def _issue(w_desc, x_desc, w_bufs, x_bufs, ready, slot, off_n, off_m, k, pred):
    # The W and X tiles at k into ring slot `slot`; its barrier completes when both have landed.
    bar = ready.index(slot)
    mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_bufs.index(slot), pred)


@gluon.jit
def _epilogue(acc, bias, cols2, rows2, mask, y_ptr, stride_ym, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr):
    # Bias and activation while the accumulator is still in fp32, then one store of the tile.
    if HAS_BIAS:
        acc = acc + gl.expand_dims(bias, 1)
    acc = apply_activation_gluon(acc, ACTIVATION)
    gl.store(y_ptr + rows2.to(gl.int64) * stride_ym + cols2, acc.to(y_ptr.dtype.element_ty), mask=mask)


def descriptors(x, weight, config):
    """TMA descriptors of W and X for ``config`` (``x``/``weight`` may be MockTensors)."""
    w_desc = tma_descriptor(weight, (config["BLOCK_N"], config["BLOCK_K"]))
    x_desc = tma_descriptor(x, (config.get("BLOCK_M", block_m(x.shape[0])), config["BLOCK_K"]))
    return w_desc, x_desc


def launch(x, weight, bias, activation, out, config, *, input_precision=None, upcast_bf16=False, pdl=False,
           prefetch_weight=False):
    """Run on checked arguments (the family's launch, ``fusedserve.kernels.family``): ``x
    [M, K]``, ``weight [N, K]`` fp16/bf16 with TMA-aligned rows, ``out [M, N]`` with unit column
    stride, 1 <= M <= MAX_M, on a Hopper GPU. ``config`` comes from ``candidates``. ``pdl``: launch
    as a programmatic dependent launch; ``prefetch_weight`` (with ``pdl``): W is constant, so its
    first tile is read before waiting on the previous kernel. ``input_precision`` and
    ``upcast_bf16`` are taken for the signature every kernel family shares and not used (16-bit
    inputs only)."""
    M, K = x.shape
    N = weight.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"x: the Gluon small-M kernel takes 1 to {MAX_M} rows, got M={M}")
    if x.dtype not in TORCH_TO_GL or weight.dtype != x.dtype:
        raise TypeError(f"x, weight: fp16 or bf16 of one dtype, got {x.dtype} and {weight.dtype}")
    split = config["SPLIT_K"]
    n_tiles, m_tiles = triton.cdiv(N, config["BLOCK_N"]), triton.cdiv(M, config.get("BLOCK_M", block_m(M)))
    locks = out
    if split > 1:
        locks = tile_counters(x.device)
        if locks is None:  # first split-K launch inside a graph capture: unsplit is as right
            split, locks = 1, out
        elif n_tiles * m_tiles > locks.numel():
            raise ValueError(f"config {config}: split-K over {n_tiles * m_tiles} tiles, more than the "
                             f"{locks.numel()} tile counters")
    grid = (n_tiles, split, m_tiles)
    part = out if split == 1 else torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    w_desc, x_desc = descriptors(x, weight, config)
    meta = dict(launch_pdl=True) if pdl else {}
    with torch.cuda.device(x.device):
        gluon_small_m_kernel[grid](
            w_desc, x_desc, bias if bias is not None else out, out, part, locks, M, N, K, out.stride(0),
            HAS_BIAS=bias is not None, ACTIVATION=activation, SPLIT_K=split, STAGES=config["STAGES"],
            USE_PDL=pdl, PREFETCH_W=pdl and prefetch_weight, num_warps=config["num_warps"], **meta)
    return out


def _unfit(p):
    if p.M > MAX_M:
        return f"it takes at most {MAX_M} rows"
    return hopper_unfit(p)


# Before tuning, K is split in two where fewer programs than this stream a K at least this long: 63 of
# the 64 tuned H100 shapes of the table agree (docs/kernels.md, "Provisional choices").
_SPLIT_BELOW_PROGRAMS, _SPLIT_MIN_K = 32, 3072
# Up to this many rows (one X tile of wgmma's narrowest n) short and wide layers start on 128-wide K tiles,
# and from 2 rows the others with K >= ``SHORT_K`` on 256-wide ones in a 5-deep ring.
_SHORT_TILE_MAX_M = 8


def _provisional_first(p) -> bool:
    """One short and wide 16-bit row (``rules.short_and_wide``): this kernel ran it 1.25-1.75x faster
    than the GEMV, which claims the other single rows."""
    return p.M == 1 and p.hopper_tma and short_and_wide(p)


def _provisional_config(p, configs: list[dict], measured: dict) -> dict:
    """The candidate closest to the measured config, its K tiles 128 wide where K is short and W
    wide at up to 8 rows (they won all 6 such tuned H100 shapes), 256 wide in a 5-deep ring at 2 to 8
    rows where K >= ``SHORT_K`` (tuned so on 5 of 6 such H100 shapes that started 128 wide and 4
    deep, 1.07-1.14x slower: docs/kernels.md, "Provisional against tuned"), and K split in two
    where few programs stream a long K (``_SPLIT_BELOW_PROGRAMS``, ``_SPLIT_MIN_K``)."""
    want = dict(measured)
    if p.M <= _SHORT_TILE_MAX_M and short_and_wide(p):
        want["BLOCK_K"] = 128
    elif 2 <= p.M <= _SHORT_TILE_MAX_M and p.K >= SHORT_K:
        want.update(BLOCK_K=256, STAGES=5)
    programs = w_tiles(p) * triton.cdiv(p.M, measured.get("BLOCK_M", block_m(p.M)))
    want["SPLIT_K"] = 2 if programs < _SPLIT_BELOW_PROGRAMS and p.K >= _SPLIT_MIN_K else 1
    fitting = [c for c in configs if all(c[k] == want[k] for k in ("BLOCK_K", "SPLIT_K") if k in want)]
    return closest_config(fitting or configs, want)


FAMILY = KernelFamily(NAME, unfit=_unfit, offered=lambda p: True,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch,
                      provisional_first=_provisional_first, provisional_config=_provisional_config)
