"""Shape rules every layer of fusedserve shares: the problem a kernel family is asked to run, the
row counts where the families compete, and the one bucket rule for batch sizes.

The bucket rule (``bucket``): a batch of up to ``POWER_OF_TWO_ROWS`` rows is computed at the next
power of two, where a layer is bound by reading its weights and padding costs little; past it at
the next eighth of an octave (129..256 rows -> 144, 160, ..., 256), so a layer that has turned
compute-bound does at most 12.5% more work than asked. The model runner pads to ``bucket(rows,
max_batch_size)`` and captures a CUDA graph per bucket, the batcher keeps one compute time per
bucket, and the kernels key their tuning on the same buckets (``m_bucket``), so each runner bucket
is tuned at its own size.
"""

from dataclasses import dataclass

import torch

from fusedserve.kernels.device import capability

# The SM count the candidate rules are written for (an H200's): which splits of the work fill a wave.
SMS = 132
# Up to this many rows a layer is bound by reading W: the weight-streaming kernels are the default.
SMALL_M_MAX = 64
# Up to here tiled GEMMs may leave SMs idle or re-read W: the weight-streaming kernel competes too.
MID_M_MAX = 512
# Up to here the Gluon weight-streaming kernel (X tile of at most 128 rows) competes; past it the
# layer is compute-bound and left to the persistent tiled kernels.
GLUON_SMALL_M_MAX = 256
# Past this many rows the warp-specialized Gluon kernel competes.
GLUON_WS_MIN_M = 32
_TMA_ALIGN = 16  # TMA's alignment of base addresses and row pitches, in bytes
# Rows of W a weight-streaming tile holds (the Gluon kernel's BLOCK_N): what the grid is counted in.
W_TILE_ROWS = 64
# K shorter than this is less than one K block of the GEMV (triton_small_m's one-row variant).
SHORT_K = 1024
# K at least this long over at most ``FEW_W_TILES`` W tiles: too few programs stream too much K.
LONG_K, FEW_W_TILES = 8192, 8


@dataclass(frozen=True)
class Problem:
    """One layer ``act(X[M, K] @ W[N, K]^T + b)`` as the kernel families see it."""

    M: int
    N: int
    K: int
    dtype: torch.dtype
    capability: tuple[int, int] | None  # CUDA compute capability; None under the interpreter
    tma_aligned: bool  # X, W and the output meet TMA's 16-byte alignment rules

    @property
    def half(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)

    @property
    def hopper(self) -> bool:
        return self.capability is not None and self.capability[0] == 9

    @property
    def hopper_tma(self) -> bool:
        """Whether the Hopper TMA kernels can run it: sm_90, fp16/bf16, TMA-aligned rows."""
        return self.hopper and self.half and self.tma_aligned


def w_tiles(p: Problem) -> int:
    """W's tiles of ``W_TILE_ROWS`` rows: the programs a weight-streaming kernel runs per row tile."""
    return -(-p.N // W_TILE_ROWS)


def short_and_wide(p: Problem) -> bool:
    """K under ``SHORT_K`` over enough W tiles to fill half the SMs: many short weight rows, where a
    weight-streaming kernel wants short K tiles and the GEMV's 1024-wide K blocks are mostly empty."""
    return p.K < SHORT_K and w_tiles(p) >= SMS // 2


def few_tiles_long_k(p: Problem) -> bool:
    """At most ``FEW_W_TILES`` W tiles over a K of ``LONG_K`` or more: our kernels split K at most in
    a few parts, so a handful of programs stream all of it while most SMs idle."""
    return p.K >= LONG_K and w_tiles(p) <= FEW_W_TILES


def tma_compatible(*tensors) -> bool:
    """Whether 2-D ``tensors`` have unit column stride and 16-byte aligned base and row pitch."""
    return all(t.stride(-1) == 1 and t.data_ptr() % _TMA_ALIGN == 0
               and (t.stride(0) * t.element_size()) % _TMA_ALIGN == 0 for t in tensors)


def problem_of(x2d: torch.Tensor, weight: torch.Tensor) -> Problem:
    """The problem of these arguments (``x2d [M, K]``, ``weight [N, K]``; the output will be a new
    contiguous ``[M, N]``, so only its row pitch can break TMA's rules)."""
    (M, K), N = x2d.shape, weight.shape[0]
    aligned = (N * x2d.element_size()) % _TMA_ALIGN == 0 and tma_compatible(x2d, weight)
    return Problem(M, N, K, x2d.dtype, capability(x2d.device), aligned)


def problem_of_shape(M: int, N: int, K: int, dtype: torch.dtype, device) -> Problem:
    """The problem of contiguous ``[M, K]`` and ``[N, K]`` tensors of ``dtype`` on ``device``
    (the caching allocator's blocks are 16-byte aligned: only the row pitches can break TMA's rules)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    aligned = (K * itemsize) % _TMA_ALIGN == 0 and (N * itemsize) % _TMA_ALIGN == 0
    return Problem(max(M, 1), N, K, dtype, capability(device), aligned)

# Tuning keys bucket M up to this; larger batches share the biggest bucket's choice.
M_BUCKET_CAP = 4096


# Up to this many rows a batch is padded to a power of two (see the module docstring).
POWER_OF_TWO_ROWS = 128


def bucket(rows: int, cap: int) -> int:
    """The rows a batch of ``rows`` is computed at, at most ``cap``: the next power of two up to
    ``POWER_OF_TWO_ROWS``, then the next eighth of an octave: ``bucket(5, 64) == 8``,
    ``bucket(100, 64) == 64``, ``bucket(129, 1024) == 144``, ``bucket(275, 1024) == 288``."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if rows <= POWER_OF_TWO_ROWS:
        return min(cap, 1 << (rows - 1).bit_length())
    step = (1 << ((rows - 1).bit_length() - 1)) >> 3  # an eighth of the power of two below rows
    return min(cap, -(-rows // step) * step)


def batch_buckets(max_batch_size: int) -> list[int]:
    """Every bucket of batches up to ``max_batch_size``: ``10 -> [1, 2, 4, 8, 10]``,
    ``300 -> [1, 2, ..., 128, 144, 160, ..., 256, 288, 300]``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(bucket(buckets[-1] + 1, max_batch_size))
    return buckets


def m_bucket(M: int) -> int:
    """The M part of every tuning key: ``bucket(M)`` capped at ``M_BUCKET_CAP``, so a runner bucket
    is tuned at its own rows: ``m_bucket(100) == 128``, ``m_bucket(275) == 288``,
    ``m_bucket(5000) == 4096``."""
    return bucket(M, M_BUCKET_CAP)


def tuning_rows(M: int) -> int:
    """The M a batch of M rows is tuned at: its bucket's largest, or M itself past the last bucket."""
    return max(M, m_bucket(M))


def bucket_rows(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` ``[M, K]`` grown to ``tuning_rows(M)`` rows (its rows repeated, same row stride): a
    bucket's choice is timed where the model runner runs it (it pads batches to the bucket), whichever
    M in the bucket came first (``choosing._tune`` checks one of ours against the library at that M too)."""
    M, K = x2d.shape
    rows = tuning_rows(M)
    if rows == M:
        return x2d
    # (A single row's stride can be anything; then rows are packed, 16-byte aligned as TMA wants.)
    stride = x2d.stride(0) if x2d.stride(0) >= K else -(-K * x2d.element_size() // 16) * 16 // x2d.element_size()
    grown = torch.empty_strided((rows, K), (stride, 1), dtype=x2d.dtype, device=x2d.device)
    grown.copy_(x2d.detach().repeat(-(-rows // M), 1)[:rows])
    return grown
