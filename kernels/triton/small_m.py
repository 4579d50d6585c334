"""Weight-streaming kernel for small batches (M up to a few hundred rows).

At small M the GEMM is bound by reading W once (32 MiB for a 4096 x 4096 bf16 layer), so the kernel
is built to stream W at full bandwidth: "swap AB" computes ``Y^T[N, M] = W[N, K] @ X^T[K, M]`` so N
fills the MMA's M side (X's rows fill the narrow side, padded to at least 16), W tiles are read along K in
16-byte vectors and pipelined over ``num_stages`` to keep many bytes in flight, and K is split over
``SPLIT_K`` programs when N alone gives too few programs to fill the GPU. Split-K partial sums go
to an fp32 workspace; the last split of each output tile to finish (a counter per tile) adds them
in a fixed order (deterministic) and applies bias and activation, in the same launch.

For a handful of rows a second kernel, the GEMV variant (config ``GEMV=True``), skips the tensor
cores: it multiplies each W tile by each row of X on the CUDA cores and sums along K, so M is not
padded to 16 and fp32 products are exact. The tuner times both variants.
"""

import torch
import triton
import triton.language as tl

from fusedserve.kernels.activations import apply_activation
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.precision import dot_precision
from fusedserve.kernels.provisional import closest_config
from fusedserve.kernels.rules import MID_M_MAX, SMALL_M_MAX, SMS, short_and_wide
from fusedserve.kernels.triton.common import aligned, dot_acc, k_align, launch_dependents_then_wait

NAME = "triton_small_m"

INTERPRET_CONFIG = dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)
INTERPRET_GEMV_CONFIG = dict(GEMV=True, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)


def block_m(M):
    """Width of the X^T tile: the MMA needs >= 16; up to 128 rows share each W tile read."""
    return min(128, max(16, triton.next_power_of_2(M)))


# Shared memory the pipeline may fill (an H200 SM has 227 KB; leave room for the epilogue). Where it
# can, the budget counts one buffer more than num_stages: the weight prefetch (``prefetch_weight``)
# peels the first step off the loop and holds its tile apart.
_SMEM_BUDGET = 200 * 1024

# (BLOCK_N, BLOCK_K, num_stages) of the tensor-core variant, from a tile sweep (see
# docs/kernels.md): with X^T 16..64 wide, 64-row W tiles won from M=4 to 64. fp32: only tiles that
# keep the accumulator in registers without spilling on sm_90; 3xTF32 holds two copies of each
# operand tile, and there the 256-deep one spills 5-10 KB a thread (docs/kernels.md).
_TILES = ((64, 256, 3), (64, 128, 5), (32, 256, 4), (128, 128, 3))
_FP32_TILES = ((32, 256, 4), (32, 128, 6))
_FP32X3_TILES = ((32, 128, 6),)
# The GEMV variant (no tensor cores) for a handful of rows, where the MMA would pad M to 16: it runs
# up to GEMV_MAX_M rows and is a tuning candidate up to _GEMV_TUNE_M (16-bit past 8 rows its FMAs
# take as long as streaming W). (BLOCK_N, BLOCK_K, num_warps, num_stages): one row streams best
# from many small programs each reading 16 KB tiles.
GEMV_MAX_M = 16
_GEMV_TUNE_M = {torch.float32: 16, torch.float16: 8, torch.bfloat16: 8}
_GEMV_TILES = ((8, 1024, 4, 2), (16, 512, 4, 3), (16, 1024, 8, 2), (4, 1024, 4, 3))
_FP32_GEMV_TILES = ((8, 512, 4, 2), (16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 8, 3))
# Several rows keep a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator in registers: tiles of this many
# elements, 64 registers a thread at 8 warps; (BLOCK_K, num_stages) to try, BLOCK_N from the rest.
_GEMV_ROWS_ELEMENTS = 16384
_GEMV_ROWS_DEPTHS = ((256, 4), (512, 3), (1024, 2))


def _gemv_tiles(M, dtype):
    """GEMV tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows."""
    if M == 1:
        return _FP32_GEMV_TILES if dtype == torch.float32 else _GEMV_TILES
    bm = triton.next_power_of_2(M)
    tiles = []
    for block_k, stages in _GEMV_ROWS_DEPTHS:
        block_n = _GEMV_ROWS_ELEMENTS // (bm * block_k)
        if 2 <= block_n <= 32:
            tiles.append((block_n, block_k, 8, stages))
    return tiles


# Split K only while the grid stays within about 4 programs per SM of an H200 (132 SMs).
_MAX_PROGRAMS = 4 * SMS


def _splits(programs, k_blocks, ways=(1, 2, 4, 8)):
    """Split-K factors worth timing: unsplit, and each split that leaves every program >= 2 K
    blocks and the grid within ``_MAX_PROGRAMS``; at most the three smallest that add programs
    where the grid has fewer than 2 per SM."""
    fits = [s for s in ways if s == 1 or (s * 2 <= k_blocks and programs * s <= _MAX_PROGRAMS)]
    if programs >= _MAX_PROGRAMS // 2:
        return fits[:2]
    return fits[:3]


def _tensor_core_tiles(dtype):
    if dtype != torch.float32:
        return _TILES
    return _FP32X3_TILES if dot_precision(dtype) == "tf32x3" else _FP32_TILES


def candidates(M, N, K, dtype):
    """Configs worth timing for this shape (at most 12): tensor-core tiles, each with the split-K
    factors of ``_splits``, pipelines shortened to fit in shared memory (or the tile left out);
    for a few rows, GEMV tiles (``GEMV=True``) first, then the two best tensor-core tiles."""
    bm = block_m(M)
    column_programs = triton.cdiv(M, bm)
    itemsize = 4 if dtype == torch.float32 else 2
    configs = []
    if M <= _GEMV_TUNE_M[dtype]:
        for block_n, block_k, warps, stages in _gemv_tiles(M, dtype):
            for s in _splits(triton.cdiv(N, block_n), triton.cdiv(K, block_k), ways=(1, 2)):
                configs.append(dict(GEMV=True, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=s,
                                    num_warps=warps, num_stages=stages))
        if M == 1 and dtype == torch.bfloat16:  # (past one row the pairs' unpacking spills registers)
            configs[2:2] = [dict(c, PAIRS=True) for c in configs[:2]]
    tiles = _tensor_core_tiles(dtype)
    if configs:
        tiles = tiles[:2]
    elif M <= 64:
        tiles = tiles[:3]  # one 16- to 64-row X^T tile per W read: the 128-row W tile pays off later
    for block_n, block_k, stages in tiles:
        stage_bytes = (block_n + bm) * block_k * itemsize
        fits = _SMEM_BUDGET // stage_bytes
        # Room for the prefetched tile where there is some; else the config may not fit with the
        # prefetch, and the tuner skips it there (configs that do not fit are left out quietly).
        stages = min(stages, fits - 1 if fits > 2 else fits)
        if stages < 2:
            continue
        for s in _splits(triton.cdiv(N, block_n) * column_programs, triton.cdiv(K, block_k)):
            configs.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=s, num_warps=4, num_stages=stages))
    return configs[:12]


@triton.jit
def _small_m_kernel(
    # pointers (part_ptr: fp32 workspace [SPLIT_K, M, N] and lock_ptr: int32 tile counters, both
    # used only when SPLIT_K > 1)
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K,
    # row strides in elements (column strides are 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32", only meaningful for fp32 inputs
    UPCAST_BF16: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is right
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait before reading x
    PREFETCH_W: tl.constexpr,  # W is constant: read its first tile before that wait
    K_ALIGN: tl.constexpr = 1,  # a power of two dividing K and both row strides (``common.k_align``)
):
    K, stride_xm, stride_wn = aligned(K, K_ALIGN), aligned(stride_xm, K_ALIGN), aligned(stride_wn, K_ALIGN)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)

    # This program's share of K, in whole BLOCK_K steps (possibly none).
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

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    kb_first = kb_start
    if PREFETCH_W:
        # The first W tile is read while the previous kernel may still run (nothing writes W), so
        # this launch's memory traffic starts before the previous one's ends; the first step is
        # peeled off the loop for that.
        k_in = (offs_k < K) & (kb_start < kb_stop)
        w = tl.load(w_ptrs, mask=k_in[None, :], other=0.0)
        bias = _wait_then_load_bias(b_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, USE_PDL, HAS_BIAS)
        x = tl.load(x_ptrs, mask=k_in[:, None], other=0.0)
        acc = dot_acc(acc, w, x, INPUT_PRECISION, UPCAST_BF16)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        kb_first += 1
    else:
        bias = _wait_then_load_bias(b_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, USE_PDL, HAS_BIAS)

    # Main loop: acc = W_tile @ X_tile^T in fp32.
    for kb in range(kb_first, kb_stop):
        k_in = tl.arange(0, BLOCK_K) < K - kb * BLOCK_K
        w = tl.load(w_ptrs, mask=k_in[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_in[:, None], other=0.0)
        acc = dot_acc(acc, w, x, INPUT_PRECISION, UPCAST_BF16)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (n), along acc's rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output rows (m), along acc's columns
    _finish(acc, cols, rows, bias, y_ptr, part_ptr, lock_ptr, M, N, stride_ym,
            pid_m * tl.num_programs(0) + pid_n, pid_k, HAS_BIAS, ACTIVATION, SPLIT_K)


@triton.jit
def _gemv_kernel(
    # pointers (part_ptr: fp32 workspace [SPLIT_K, M, N] and lock_ptr: int32 tile counters, both
    # used only when SPLIT_K > 1)
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K,
    # row strides in elements (column strides are 1)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,  # W tiles in flight per program (cp.async pipeline through shared memory)
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent launch: wait before reading x
    PREFETCH_W: tl.constexpr,  # W is constant: read its first tile before that wait
    PAIRS: tl.constexpr,  # bf16 W read as int32 pairs (K and W's row stride even; see _w_tile)
    K_ALIGN: tl.constexpr = 1,  # a power of two dividing K and both row strides (``common.k_align``)
):
    # No tensor cores: each W tile is multiplied by each of the (few) rows of X on the CUDA cores and
    # summed along K. Exact fp32 products for every dtype (no TF32, no padding of M to 16), and W is
    # read in 16-byte vectors along K.
    K, stride_xm, stride_wn = aligned(K, K_ALIGN), aligned(stride_xm, K_ALIGN), aligned(stride_wn, K_ALIGN)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)

    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_start = pid_k * per_split
    kb_stop = tl.minimum(kb_start + per_split, k_blocks)

    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # edge columns wrap; stores are masked
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    if PAIRS:  # int32 elements, half as many per row
        w_ptrs = (w_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_wn // 2)
                  + (kb_start * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2))[None, :])
    else:
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (kb_start * BLOCK_K + offs_k)[None, :]

    # Elementwise accumulators, reduced across K once at the end (no reduction per K step): for one
    # row [BLOCK_N, BLOCK_K]; for several [BLOCK_M, BLOCK_N, BLOCK_K] (rows past M repeat row M-1
    # and are never stored).
    x_rows = tl.minimum(rows, M - 1).to(tl.int64) * stride_xm
    wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    wide3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    kb_first = kb_start
    if PREFETCH_W:
        # As in _small_m_kernel: the first W tile is read before waiting on the previous kernel.
        k = kb_start * BLOCK_K + offs_k
        k_in = (k < K) & (kb_start < kb_stop)
        w = _w_tile(w_ptrs, kb_start, K, kb_start < kb_stop, BLOCK_N, BLOCK_K, PAIRS)
        bias = _wait_then_load_bias(b_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, USE_PDL, HAS_BIAS)
        wide, wide3 = _gemv_step(wide, wide3, w, x_ptr, x_rows, k, k_in, BLOCK_M)
        w_ptrs += BLOCK_K // 2 if PAIRS else BLOCK_K
        kb_first += 1
    else:
        bias = _wait_then_load_bias(b_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, USE_PDL, HAS_BIAS)

    for kb in tl.range(kb_first, kb_stop, num_stages=STAGES):
        k = kb * BLOCK_K + offs_k
        k_in = k < K
        w = _w_tile(w_ptrs, kb, K, True, BLOCK_N, BLOCK_K, PAIRS)
        wide, wide3 = _gemv_step(wide, wide3, w, x_ptr, x_rows, k, k_in, BLOCK_M)
        w_ptrs += BLOCK_K // 2 if PAIRS else BLOCK_K
    if BLOCK_M == 1:
        acc = tl.sum(wide, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        acc = tl.trans(tl.sum(wide3, axis=2))  # [BLOCK_N, BLOCK_M]

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _finish(acc, cols, rows, bias, y_ptr, part_ptr, lock_ptr, M, N, stride_ym, pid_n, pid_k,
            HAS_BIAS, ACTIVATION, SPLIT_K)


@triton.jit
def _w_tile(w_ptrs, kb, K, live, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS: tl.constexpr):
    """W's K block ``kb`` as an fp32 [BLOCK_N, BLOCK_K] tile (zeros past K, or where not ``live``).

    PAIRS: ``w_ptrs`` point at [BLOCK_N, BLOCK_K // 2] int32 words, each two bf16 of W. A bf16 is
    the top half of an fp32, so each half becomes fp32 with one integer op (a shift for the low
    one, a mask for the high one) where ``cvt.f32.bf16`` compiles to more (sm_90: 1.6 instructions
    an element). The halves are interleaved back into K order."""
    if PAIRS:
        p = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        words = tl.load(w_ptrs, mask=((p < K // 2) & live)[None, :], other=0)
        low = (words << 16).to(tl.float32, bitcast=True)  # W[n, 2p]
        high = (words & -65536).to(tl.float32, bitcast=True)  # W[n, 2p + 1] (-65536 is 0xFFFF0000)
        w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
    else:
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptrs, mask=((k < K) & live)[None, :], other=0.0).to(tl.float32)
    return w


@triton.jit
def _gemv_step(wide, wide3, w, x_ptr, x_rows, k, k_in, BLOCK_M: tl.constexpr):
    """Add the products of the fp32 W tile ``w`` [BLOCK_N, BLOCK_K] with X's columns ``k`` to the
    one-row accumulator ``wide`` (BLOCK_M == 1) or the several-row ``wide3``; returns both."""
    if BLOCK_M == 1:
        wide += w * tl.load(x_ptr + k, mask=k_in, other=0.0).to(tl.float32)[None, :]
    else:
        x = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=k_in[None, :], other=0.0)
        wide3 += x.to(tl.float32)[:, None, :] * w[None, :, :]
    return wide, wide3


@triton.jit
def _wait_then_load_bias(b_ptr, cols, N, USE_PDL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """In a programmatic dependent launch, wait for the previous kernel (``launch_dependents_then_wait``);
    then issue the load of the bias for output columns ``cols`` (fp32; zeros without a bias). It is
    issued before the main loop and used after it, so its trip to memory overlaps the loop instead
    of adding to every program's tail."""
    if USE_PDL:
        launch_dependents_then_wait()
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros(cols.shape, dtype=tl.float32)
    return bias


@triton.jit
def _finish(acc, cols, rows, bias, y_ptr, part_ptr, lock_ptr, M, N, stride_ym, lock_index, pid_k,
            HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr):
    """Epilogue of one output tile. ``acc [BLOCK_N, BLOCK_M]`` holds fp32 sums for output columns
    ``cols`` (along N) and rows ``rows`` (along M), ``bias`` the fp32 bias of ``cols``. With
    split-K, every split stores its partial sums; the last split of the tile to arrive adds all of
    them in split order (the same order every run: deterministic) and applies the epilogue, all in
    this one launch."""
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    if SPLIT_K > 1:
        p_offs = rows[None, :].to(tl.int64) * N + cols[:, None]
        tl.store(part_ptr + pid_k * M * N + p_offs, acc, mask=mask)
        # Every thread's partial store is issued before the tile's counter moves (the barrier);
        # the counter's acq_rel orders those stores before the last split's reads.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + lock_index, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros_like(acc)
            for s in range(SPLIT_K):  # .cg: read the partials from L2, never from a stale L1 line
                acc += tl.load(part_ptr + s * M * N + p_offs, mask=mask, other=0.0, cache_modifier=".cg")
            _store(acc, cols, rows, bias, y_ptr, stride_ym, mask, HAS_BIAS, ACTIVATION)
            tl.atomic_xchg(lock_ptr + lock_index, 0)  # ready for the next launch
    else:
        _store(acc, cols, rows, bias, y_ptr, stride_ym, mask, HAS_BIAS, ACTIVATION)


@triton.jit
def _store(acc, cols, rows, bias, y_ptr, stride_ym, mask, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    # Bias and activation while the accumulator is still in fp32, then one store of Y^T's tile.
    if HAS_BIAS:
        acc = acc + bias[:, None]
    acc = apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


# Split-K tile counters, one zeroed int32 buffer per device. Every split-K launch leaves its counters
# at zero again. Launches on one device share them, so split-K kernels must not run concurrently
# on two streams of one device (fusedserve runs a device's kernels on one stream at a time).
_LOCK_SLOTS = 4096
_locks: dict[torch.device, torch.Tensor] = {}


def tile_counters(device):
    """The device's counters, or None inside a CUDA-graph capture before any eager launch made them
    (allocating there would zero them only when the graph replays)."""
    if device not in _locks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _locks[device] = torch.zeros(_LOCK_SLOTS, device=device, dtype=torch.int32)
    return _locks[device]


def pairs_ok(weight):
    """Whether the GEMV can read bf16 ``weight`` [N, K] as int32 pairs (config ``PAIRS=True``):
    K and the row stride even, 4-byte aligned; elsewhere a PAIRS config runs without them."""
    return (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and weight.stride(0) % 2 == 0
            and weight.data_ptr() % 4 == 0)


def launch(x, weight, bias, activation, out, config, *, input_precision, upcast_bf16, pdl=False,
           prefetch_weight=False):
    """Run on checked arguments: ``x [M, K]`` and ``weight [N, K]`` with unit column stride,
    ``out [M, N]`` with unit column stride, M >= 1. ``config`` comes from ``candidates`` or
    ``INTERPRET_CONFIG``. ``pdl``: launch as a programmatic dependent launch (sm_90+).
    ``prefetch_weight``: with ``pdl``, read the first W tile before waiting for the previous kernel
    on the stream; only for weights that no earlier kernel still writes."""
    M, K = x.shape
    N = weight.shape[0]
    meta = dict(config)
    gemv = meta.pop("GEMV", False)
    if gemv and M > GEMV_MAX_M:
        raise ValueError(f"config {config}: the GEMV variant takes at most {GEMV_MAX_M} rows, got M={M}")
    bm = triton.next_power_of_2(M) if gemv else block_m(M)
    grid = (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], 1 if gemv else triton.cdiv(M, bm))
    locks = tile_counters(x.device) if meta["SPLIT_K"] > 1 else out
    if locks is None:  # first split-K launch inside a graph capture: unsplit is as right
        meta["SPLIT_K"] = 1
        grid = (grid[0], 1, grid[2])
        locks = out
    if grid[0] * grid[2] > _LOCK_SLOTS and meta["SPLIT_K"] > 1:
        raise ValueError(f"config {config}: split-K over {grid[0] * grid[2]} output tiles, more than "
                         f"the {_LOCK_SLOTS} tile counters")
    part = out if meta["SPLIT_K"] == 1 else torch.empty((meta["SPLIT_K"], M, N), device=x.device,
                                                        dtype=torch.float32)
    common = (x, weight, bias if bias is not None else out, out, part, locks, M, N, K,
              x.stride(0), weight.stride(0), out.stride(0))
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation, USE_PDL=pdl,
                 PREFETCH_W=prefetch_weight, BLOCK_M=bm, K_ALIGN=k_align(K, x, weight))
    if pdl:
        meta["launch_pdl"] = True  # a launch option, not a kernel argument
    if gemv:
        pairs = meta.pop("PAIRS", False) and pairs_ok(weight)
        _gemv_kernel[grid](*common, STAGES=meta["num_stages"], PAIRS=pairs, **flags, **meta)
    else:
        _small_m_kernel[grid](*common, INPUT_PRECISION=input_precision, UPCAST_BF16=upcast_bf16, **flags, **meta)
    return out


def _offered(p):
    """Up to the mid rows; on Hopper's 16-bit TMA problems only up to ``SMALL_M_MAX``: past it the
    Gluon weight-streaming kernel holds those rows, and this one won none of the tuned shapes there
    on the H100 and H200 tables (docs/kernels.md)."""
    return p.M <= (SMALL_M_MAX if p.hopper_tma else MID_M_MAX)


def _provisional_first(p) -> bool:
    """One 16-bit row: the GEMV won every tuned shape with static weights on the H200 and all but the
    short and wide ones on the H100, while the table's nearest shape sometimes named the Gluon
    kernel, 1.35-1.55x slower there. Short and wide rows (``rules.short_and_wide``) are the Gluon
    kernel's where it runs: the GEMV ran them 1.25-1.75x slower (docs/kernels.md, "Provisional
    choices")."""
    return p.M == 1 and p.half and not (p.hopper_tma and short_and_wide(p))


def _provisional_config(p, configs: list[dict], measured: dict) -> dict:
    """One row starts on the GEMV (the config closest to the measured one among its variants):
    that is what ``_provisional_first`` claims it for, whatever the nearest measured shape ran. In
    16 bits on 1024-deep tiles, 8 wide where that still gives every SM a program, else 4 wide: what
    all 10 tuned one-row H100 GEMVs won (N=320-920 4 wide, N=1552-3928 8 wide; a 16-wide start ran
    1.38x slower at N=456, kernels.jsonl:39)."""
    gemv = [c for c in configs if c.get("GEMV")] if p.M == 1 else []
    if gemv and p.half:
        wide = 8 if triton.cdiv(p.N, 8) >= SMS else 4
        gemv = [c for c in gemv if (c["BLOCK_N"], c["BLOCK_K"]) == (wide, 1024)] or gemv
    return closest_config(gemv or configs, measured)


FAMILY = KernelFamily(NAME, unfit=lambda p: None, offered=_offered,
                      candidates=lambda p: candidates(p.M, p.N, p.K, p.dtype), launch=launch,
                      interpret_config=INTERPRET_CONFIG, provisional_first=_provisional_first,
                      provisional_config=_provisional_config)
