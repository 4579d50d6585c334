"""Which kernels may run a given linear layer: a pure function of the shape and the device's traits,
so the rules can be tested without a GPU. Where several kernels qualify, the autotuner times them
all (with their configs) and keeps the fastest for that batch bucket (see ``kernels.fused_linear``).
"""

import torch

from fusedserve.kernels.rules import M_BUCKET_CAP, bucket_rows, m_bucket, tuning_rows  # noqa: F401

TILED = "triton_tiled"
SMALL_M = "triton_small_m"
TMA_PERSISTENT = "triton_tma_persistent"
GLUON = "gluon_wgmma"
GLUON_SMALL_M = "gluon_small_m"
GLUON_WS = "gluon_ws"

# Up to this many rows the layer is bound by reading W, and the weight-streaming kernel (X^T tile
# 16..64 wide) covers the whole batch in one program column: it is the only candidate.
SMALL_M_MAX = 64
# Up to here (an H200 is memory-bound below M ~ 200 at N=K=4096) tiled GEMMs may leave SMs idle or
# re-read W; the weight-streaming kernel with split-K competes with them in the tuner.
MID_M_MAX = 512
# Up to here the Gluon swap-AB weight-streaming kernel (Hopper) competes: its X tile (wgmma's n
# side) is at most 128 rows, so past 128 the batch is split over programs. Past 256 the layer is
# compute-bound and the persistent tiled kernels, with 128-row tiles on both sides, are left to it.
GLUON_SMALL_M_MAX = 256
# Past this many rows the warp-specialized Gluon kernel competes too; up to SMALL_M_MAX only with
# 64-row tiles, for wide layers where the weight-streaming kernels' 64-row W tiles leave the last
# wave of SMs part-empty (N=11008: 172 tiles on 132 SMs; 115 of 64 x 96).
GLUON_WS_MIN_M = 32
# The SM count the candidate rules are written for (an H200's): which splits of the work fill one wave.
SMS = 132
def candidate_kernels(M, N, K, dtype, *, capability, tma_aligned, gluon_ok=False):
    """Kernel names that may run ``act(X[M, K] @ W[N, K]^T + b)``; the first is the default used
    before (or without) tuning.

    ``capability`` is the CUDA compute capability ``(major, minor)``, or None under the interpreter.
    ``tma_aligned`` says whether x, W and the output meet TMA's 16-byte alignment rules.
    ``gluon_ok`` says whether the Gluon kernel imported and accepts this shape/dtype/device.

    Rules:
      1. The base kernel: ``triton_small_m`` (swap-AB weight streaming, split-K) when
         ``M <= SMALL_M_MAX``; else ``triton_tma_persistent`` on Hopper (major 9) for fp16/bf16
         with ``tma_aligned``; else ``triton_tiled`` (fp32, other GPUs, the interpreter, views
         TMA cannot read).
      2. ``SMALL_M_MAX < M <= MID_M_MAX``: ``triton_small_m`` is added as a second candidate.
      3. Hopper, fp16/bf16, ``tma_aligned`` and ``gluon_ok``: ``gluon_wgmma`` is added (any M), and
         ``gluon_small_m`` (swap-AB weight streaming through TMA) when ``M <= GLUON_SMALL_M_MAX``,
         and ``gluon_ws`` (warp-specialized: a loader warp and one or two MMA warpgroups) when
         ``M > GLUON_WS_MIN_M``.
    """
    hopper_16bit = capability is not None and capability[0] == 9 and dtype in (torch.float16, torch.bfloat16)
    if M <= SMALL_M_MAX:
        kernels = [SMALL_M]
    elif hopper_16bit and tma_aligned:
        kernels = [TMA_PERSISTENT]
    else:
        kernels = [TILED]
    if SMALL_M_MAX < M <= MID_M_MAX:
        kernels.append(SMALL_M)
    if hopper_16bit and tma_aligned and gluon_ok:
        if M <= GLUON_SMALL_M_MAX:
            kernels.append(GLUON_SMALL_M)
        kernels.append(GLUON)
        if M > GLUON_WS_MIN_M:
            kernels.append(GLUON_WS)
    return tuple(kernels)
