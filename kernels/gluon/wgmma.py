"""Hopper (sm_90) fused linear in Gluon: ``Y = act(X @ W^T + b)``.

X is ``[M, K]`` (rows contiguous), W is ``[N, K]`` (nn.Linear layout), b is ``[N]``, Y is ``[M, N]``;
fp16/bf16 in and out, fp32 accumulation. The kernel is persistent: one CTA per SM walks the output
tiles in grouped order. Per tile, TMA streams X and W k-slices through a ring of shared-memory
stages guarded by mbarriers while async wgmma consumes them; bias and activation are applied while
the accumulator is still in fp32, and the tile leaves through one TMA store that overlaps the next
tile's main loop.

Only the launcher touches CUDA, so importing this module works on a CPU-only machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton

from fusedserve.kernels.activations import ACTIVATIONS, apply_activation_gluon
from fusedserve.kernels.device import cuda_capability, cuda_sm_count
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.gluon.common import (
    TORCH_TO_GL,
    fence_async_shared,
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
from fusedserve.kernels.rules import SMS

NAME = "gluon_wgmma"
# TMA needs every non-inner stride and the base address 16-byte aligned.
_TMA_ALIGN_BYTES = 16


@dataclass(frozen=True)
class GluonConfig:
    block_m: int
    block_n: int
    block_k: int
    stages: int  # depth of the shared-memory ring of X and W k-slices
    num_warps: int
    group_m: int = 8  # tiles along M visited before moving along N: W tiles stay hot in L2

    def __str__(self) -> str:
        return (f"BM{self.block_m}_BN{self.block_n}_BK{self.block_k}_S{self.stages}"
                f"_W{self.num_warps}_G{self.group_m}")


# Small batches are bound by streaming W: narrow N tiles spread W over more SMs, a deep ring with
# long k-slices keeps enough bytes in flight per SM. Every CTA also reads all of X (only its real
# rows: TMA does not fetch the zero-filled ones), so once M passes 16 the tiles widen to 64 columns
# to keep X's share of the L2 traffic below W's.
TINY_M = GluonConfig(block_m=64, block_n=32, block_k=128, stages=6, num_warps=4)
SMALL_M = GluonConfig(block_m=64, block_n=64, block_k=128, stages=5, num_warps=4)
# Mid-size M: 128x128 tiles give twice the CTAs of 128x256 when the large tiles would leave SMs idle.
MEDIUM_M = GluonConfig(block_m=128, block_n=128, block_k=64, stages=4, num_warps=4)
# Large M: the widest wgmma (n=256); two warpgroups so the 128x256 fp32 accumulator fits in registers.
# Three stages: 3 x 48 KB of operands + a 64 KB output tile fill most of the 227 KB of shared memory.
LARGE_M = GluonConfig(block_m=128, block_n=256, block_k=64, stages=3, num_warps=8)
GLUON_CONFIGS = (TINY_M, SMALL_M, MEDIUM_M, LARGE_M)


@gluon.constexpr_function
def _acc_layout(BLOCK_M, BLOCK_N, num_warps):
    # Warps stack along M (16 rows each, 4 per warpgroup); one wgmma instruction covers all of N.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, min(BLOCK_N, 256), 16])


@gluon.jit
def _issue_load(x_desc, w_desc, x_bufs, w_bufs, ready, g, off_m, off_n, k, STAGES: gl.constexpr, pred):
    # k-slice number g (counted across tiles) goes to stage g % STAGES.
    slot = g % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_bufs.index(slot), pred)


@gluon.jit
def _issue_prologue(x_desc, w_desc, x_bufs, w_bufs, ready, base, tile, num_tiles, num_pid_m, num_pid_n,
                    k_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    # Fill the first STAGES - 1 stages for `tile` (predicated off past the last tile or past K).
    # Past the last tile the loads are predicated off; clamping keeps the tile arithmetic in range.
    pid_m, pid_n = tile_coords(gl.minimum(tile, num_tiles - 1), num_pid_m, num_pid_n, GROUP_M)
    for s in gl.static_range(STAGES - 1):
        pred = (tile < num_tiles) & (s < k_tiles)
        _issue_load(x_desc, w_desc, x_bufs, w_bufs, ready, base + s, pid_m * BLOCK_M, pid_n * BLOCK_N,
                    s * BLOCK_K, STAGES, pred)


@gluon.jit
def gluon_linear_kernel(
    # TMA descriptors: X [M, K], W [N, K], Y [M, N]
    x_desc, w_desc, y_desc,
    # bias [N] (fp32 or the input dtype); not read when HAS_BIAS is False
    bias_ptr,
    # meta-parameters
    HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_N, num_warps)
    bias_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)

    M = x_desc.shape[0]
    K = x_desc.shape[1]
    N = y_desc.shape[1]
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BLOCK_K)  # the K tail is zero-filled by TMA, so it adds nothing

    # Shared memory: the operand ring, one ready-barrier per stage, one output tile.
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    y_smem = gl.allocate_shared_memory(dtype, y_desc.block_type.shape, y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()  # barrier initialisation must be visible to the TMA unit

    # `base` counts k-slices consumed by earlier tiles; it gives every slice its stage and phase.
    base = 0
    first_tile = gl.program_id(0)
    step = gl.num_programs(0)
    _issue_prologue(x_desc, w_desc, x_bufs, w_bufs, ready, base, first_tile, num_tiles, num_pid_m,
                    num_pid_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M)

    for tile in range(first_tile, num_tiles, step):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        # Main loop: wgmma on slice ki overlaps the TMA loads of slices ki+1 .. ki+STAGES-1.
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for ki in range(k_tiles):
            g = base + ki
            slot = g % STAGES
            mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
            w_t = w_bufs.index(slot).permute((1, 0))  # W tile [BN, BK] read as B = [BK, BN]
            acc = warpgroup_mma(x_bufs.index(slot), w_t, acc, is_async=True)
            # At most one wgmma in flight: slice ki-1 is done, so its stage can be refilled.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            nxt = ki + STAGES - 1
            _issue_load(x_desc, w_desc, x_bufs, w_bufs, ready, base + nxt, off_m, off_n, nxt * BLOCK_K,
                        STAGES, nxt < k_tiles)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        base += k_tiles

        # Every stage is free again: start the next tile's loads so they fly during this epilogue.
        _issue_prologue(x_desc, w_desc, x_bufs, w_bufs, ready, base, tile + step, num_tiles, num_pid_m,
                        num_pid_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M)

        # Epilogue, while the accumulator is still in fp32: bias, activation, one downcast.
        if HAS_BIAS:
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=bias_layout)
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
            acc = acc + gl.expand_dims(bias, 0)
        acc = apply_activation_gluon(acc, ACTIVATION)
        # The previous tile's TMA store must have finished reading y_smem before it is overwritten.
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        y_smem.store(acc.to(dtype))
        fence_async_shared()  # make the generic-proxy writes visible to the TMA store
        tma.async_copy_shared_to_global(y_desc, [off_m, off_n], y_smem)  # clipped at M and N

    tma.store_wait(pendings=0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


def pick_config(M: int, N: int, num_sms: int) -> GluonConfig:
    """The tile config for an ``[M, N]`` output on a GPU with ``num_sms`` SMs."""
    if M <= 16:
        return TINY_M
    if M <= SMALL_M.block_m:
        return SMALL_M
    # Cost in waves of CTAs, in units of a 128x128 tile. A 128x128 tile is taken to run ~10% less
    # efficiently than half a 128x256 one (estimate, not yet measured): medium tiles win only when
    # large ones would leave many SMs idle.
    large_waves = triton.cdiv(triton.cdiv(M, LARGE_M.block_m) * triton.cdiv(N, LARGE_M.block_n), num_sms)
    medium_waves = triton.cdiv(triton.cdiv(M, MEDIUM_M.block_m) * triton.cdiv(N, MEDIUM_M.block_n), num_sms)
    return LARGE_M if 2 * large_waves <= 1.1 * medium_waves else MEDIUM_M


def gluon_config(M: int, N: int, K: int, device: torch.device | str) -> GluonConfig:
    """The config ``gluon_fused_linear`` launches for this shape on ``device`` (a CUDA device)."""
    return pick_config(M, N, cuda_sm_count(device))


def gluon_supported(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``gluon_fused_linear`` can run this problem: Hopper, fp16/bf16, TMA-aligned rows."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if cuda_capability(device)[0] != 9:
        return False
    if dtype not in TORCH_TO_GL:
        return False
    elem = dtype.itemsize
    # K * elem is X's and W's row pitch, N * elem is Y's: TMA wants both 16-byte aligned.
    return M >= 1 and N >= 1 and K >= 1 and (K * elem) % _TMA_ALIGN_BYTES == 0 \
        and (N * elem) % _TMA_ALIGN_BYTES == 0


def _check_tma_operand(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous for TMA, got strides {t.stride()}")
    if (t.stride(0) * t.element_size()) % _TMA_ALIGN_BYTES or t.data_ptr() % _TMA_ALIGN_BYTES:
        raise ValueError(f"{name}: row pitch and base address must be 16-byte aligned for TMA "
                         f"(strides {t.stride()}, dtype {t.dtype}); pass a contiguous copy")


def make_launch_args(x2d, weight, bias, y, cfg: GluonConfig, activation: str):
    """Descriptors and meta-parameters for one launch (``x2d``/``weight``/``y`` may be MockTensors)."""
    x_desc = tma_descriptor(x2d, (cfg.block_m, cfg.block_k))
    w_desc = tma_descriptor(weight, (cfg.block_n, cfg.block_k))
    y_desc = tma_descriptor(y, (cfg.block_m, cfg.block_n))
    args = (x_desc, w_desc, y_desc, y if bias is None else bias)
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=activation, STAGES=cfg.stages, GROUP_M=cfg.group_m,
                num_warps=cfg.num_warps)
    return args, meta


def gluon_fused_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str = "relu", *, out: torch.Tensor | None = None,
                       config: GluonConfig | None = None) -> torch.Tensor:
    """``act(x2d @ weight^T + bias)`` on a Hopper GPU; x2d ``[M, K]``, weight ``[N, K]``, bias ``[N]``.

    ``out``, if given, is a contiguous ``[M, N]`` tensor of x2d's dtype and device that receives the
    result (preallocated buffers keep CUDA-graph replays free of allocations). ``config`` overrides
    the tile config that ``gluon_config`` would pick (for benchmarks sweeping ``GLUON_CONFIGS``).
    """
    _check_arguments(x2d, weight, bias, activation, config)
    M, N = x2d.shape[0], weight.shape[0]
    y = _output(out, M, N, x2d)
    if M == 0:
        return y
    for t, name in ((x2d, "x2d"), (weight, "weight"), (y, "out")):
        _check_tma_operand(t, name)
    cfg = config if config is not None else gluon_config(M, N, x2d.shape[1], x2d.device)
    args, meta = make_launch_args(x2d, weight, None if bias is None else bias.contiguous(), y, cfg, activation)
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    with torch.cuda.device(x2d.device):
        gluon_linear_kernel[(min(num_tiles, cuda_sm_count(x2d.device)), )](*args, **meta)
    return y


def _check_arguments(x2d, weight, bias, activation, config) -> None:
    """TypeError or ValueError naming the first argument ``gluon_fused_linear`` cannot take."""
    for name, t in (("x2d", x2d), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if config is not None and not isinstance(config, GluonConfig):
        raise TypeError(f"config: expected a GluonConfig or None, got {type(config).__name__}")
    if x2d.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x2d, weight: expected 2-D tensors, got shapes {tuple(x2d.shape)} and "
                         f"{tuple(weight.shape)}")
    (M, K), N = x2d.shape, weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight: expected [N, {K}] to match x2d [M, {K}], got {tuple(weight.shape)}")
    if weight.dtype != x2d.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from x2d's {x2d.dtype}")
    if weight.device != x2d.device:
        raise ValueError(f"weight: on {weight.device}, x2d on {x2d.device}")
    if bias is not None:
        _check_bias(bias, N, x2d)
    if not gluon_supported(max(M, 1), N, K, x2d.dtype, x2d.device):
        raise ValueError(f"x2d: the Gluon kernel needs a compute-capability 9.x CUDA device, fp16/bf16 and "
                         f"K, N whose rows are multiples of 16 bytes; got device {x2d.device}, dtype "
                         f"{x2d.dtype}, N={N}, K={K}")


def _check_bias(bias, N, x2d) -> None:
    if bias.shape != (N,):
        raise ValueError(f"bias: expected shape ({N},), got {tuple(bias.shape)}")
    if bias.dtype not in (torch.float32, x2d.dtype):
        raise TypeError(f"bias: expected float32 or {x2d.dtype}, got {bias.dtype}")
    if bias.device != x2d.device:
        raise ValueError(f"bias: on {bias.device}, x2d on {x2d.device}")


def _output(out, M, N, x2d) -> torch.Tensor:
    """``out`` checked, or a new ``[M, N]`` output."""
    if out is None:
        return torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != (M, N) or out.dtype != x2d.dtype or out.device != x2d.device or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous ({M}, {N}) {x2d.dtype} tensor on {x2d.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def launch(x, weight, bias, activation, out, config, *, input_precision=None, upcast_bf16=False, pdl=False,
           prefetch_weight=False):
    """The family's launch (``fusedserve.kernels.family``): ``config`` is a ``GluonConfig`` as a
    dict (None: ``gluon_config`` picks). The keywords every family takes are unused here."""
    return gluon_fused_linear(x, weight, bias, activation, out=out,
                              config=None if config is None else GluonConfig(**config))


FAMILY = KernelFamily(NAME, unfit=hopper_unfit, offered=lambda p: True,
                      candidates=lambda p: [asdict(pick_config(p.M, p.N, SMS))], launch=launch,
                      describe=lambda config: str(GluonConfig(**config)) if config else "")
