"""Shape rules every layer of fusedserve shares: the one bucket rule for batch sizes.

A batch of ``rows`` is computed (and its kernels tuned) at the next power of two, capped: the
model runner pads to ``bucket(rows, max_batch_size)`` and captures a CUDA graph per bucket, the
batcher keeps one compute time per bucket, and the kernels key their tuning on
``bucket(M, M_BUCKET_CAP)``.
"""

import torch

# Tuning keys bucket M up to this; larger batches share the biggest bucket's choice.
M_BUCKET_CAP = 4096


def bucket(rows: int, cap: int) -> int:
    """``rows`` rounded up to a power of two, at most ``cap``: ``bucket(5, 64) == 8``,
    ``bucket(100, 64) == 64``."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return min(cap, 1 << (rows - 1).bit_length())


def batch_buckets(max_batch_size: int) -> list[int]:
    """Every bucket of batches up to ``max_batch_size``: ``10 -> [1, 2, 4, 8, 10]``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(bucket(buckets[-1] + 1, max_batch_size))
    return buckets


def m_bucket(M: int) -> int:
    """The M part of every tuning key: ``bucket(M, M_BUCKET_CAP)``."""
    return bucket(M, M_BUCKET_CAP)


def tuning_rows(M: int) -> int:
    """The M a batch of M rows is tuned at: its bucket's largest, or M itself past the last bucket."""
    return max(M, m_bucket(M))


def bucket_rows(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` ``[M, K]`` grown to ``tuning_rows(M)`` rows (its rows repeated, same row stride): a
    bucket's choice is timed where the model runner runs it (it pads batches to the bucket) and
    does not depend on which M in the bucket happened to come first."""
    M, K = x2d.shape
    rows = tuning_rows(M)
    if rows == M:
        return x2d
    # (A single row's stride can be anything; then rows are packed, 16-byte aligned as TMA wants.)
    stride = x2d.stride(0) if x2d.stride(0) >= K else -(-K * x2d.element_size() // 16) * 16 // x2d.element_size()
    grown = torch.empty_strided((rows, K), (stride, 1), dtype=x2d.dtype, device=x2d.device)
    grown.copy_(x2d.detach().repeat(-(-rows // M), 1)[:rows])
    return grown
