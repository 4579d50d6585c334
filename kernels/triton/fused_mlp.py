"""A whole MLP as one short chain of launches: input normalization fused into the first layer,
bias and activation fused into every layer's epilogue.

``y = act_n(L_n(...act_1(L_1(act_0(L_0((x - shift) * scale))))...))`` with ``L_i(h) = h @ W_i^T + b_i``
and each layer's own activation (the last one's is often "none"; a row-wise one, softmax, runs in torch
after the last launch). Layer-by-layer torch needs two extra launches for the
normalization and one per activation; here each layer is exactly one launch, and layer 0 reads the
raw float32 input and normalizes it while loading (rounded to the model dtype, as
``MLP.normalize`` does). Each launch spreads its layer over a grid of ``BLOCK_M x BLOCK_N`` output
tiles, so even a batch of 1 uses many SMs.

Under a CUDA graph the chain replays as ``len(layers)`` kernel nodes with no Python in between.
On Hopper and later the layers are launched with programmatic dependent launch: each layer lets
the next one start launching at once, reads its first weight tile, and waits
(``griddepcontrol.wait``) only before reading its input, so a layer's launch latency and first
weight reads hide behind the previous layer's work.
Every layer's weights are packed into one buffer (``pack_mlp``) once, when the runner is built.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedserve.kernels import provisional
from fusedserve.kernels.activations import apply_activation, split_activation
from fusedserve.kernels.arguments import check_normalization, interpreting
from fusedserve.kernels.device import cuda_name, cuda_sm_count, pdl_supported
from fusedserve.kernels.precision import dot_precision
from fusedserve.kernels.rules import SMS, m_bucket
from fusedserve.kernels.triton.common import aligned, dot_acc, k_align, launch_dependents_then_wait
from fusedserve.kernels.tune_cache import device_cache
from fusedserve.kernels.tuning import descend_chain

NAME = "triton_fused_mlp"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PackedMLP(NamedTuple):
    """Every layer's weights and biases in two flat buffers, plus where each layer starts."""

    weights: torch.Tensor  # all W_i [N_i, K_i] flattened back to back, model dtype
    biases: torch.Tensor  # all b_i [N_i] back to back, model dtype
    offsets: tuple[tuple[int, int], ...]  # per layer: (offset of W_i, offset of b_i), in elements
    widths: tuple[int, ...]  # (K_0, N_0, N_1, ..., N_last)
    activations: tuple[str, ...]  # per layer, first layer first

    @property
    def num_layers(self) -> int:
        return len(self.widths) - 1


def fused_mlp_supported(widths, dtype, device) -> bool:
    """Whether ``fused_mlp`` takes a model of these feature widths (input first) on this device:
    any widths in float32/float16/bfloat16, on CUDA or on the CPU under ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    return (dtype in _DTYPES and len(widths) >= 2
            and (device.type == "cuda" or (device.type == "cpu" and interpreting())))


def pack_mlp(weights, biases, activations) -> PackedMLP:
    """Pack ``[W_0, W_1, ...]`` (``nn.Linear`` layout) and ``[b_0, b_1, ...]`` for ``fused_mlp``.
    ``activations``: one name per layer, or one name for every layer but the last (which gets "none")."""
    if not weights or len(weights) != len(biases):
        raise ValueError(f"weights and biases must be non-empty lists of equal length, got "
                         f"{len(weights)} and {len(biases)}")
    if isinstance(activations, str):
        activations = (activations,) * (len(weights) - 1) + ("none",)
    if len(activations) != len(weights):
        raise ValueError(f"activations must name one activation per layer ({len(weights)}), got {list(activations)}")
    for name in activations:
        split_activation(name)  # ValueError naming a name no layer computes
    widths = [weights[0].shape[1]]
    offsets, w_offset, b_offset = [], 0, 0
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        if w.dim() != 2 or w.shape[1] != widths[-1]:
            raise ValueError(f"weights[{i}] must be [N, {widths[-1]}], got {tuple(w.shape)}")
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"biases[{i}] must be [{w.shape[0]}], got {tuple(b.shape)}")
        if w.dtype != weights[0].dtype or b.dtype != w.dtype or w.device != weights[0].device:
            raise TypeError(f"weights[{i}]/biases[{i}] must share weights[0]'s dtype and device")
        offsets.append((w_offset, b_offset))
        w_offset += w.numel()
        b_offset += b.numel()
        widths.append(w.shape[0])
    return PackedMLP(
        weights=torch.cat([w.reshape(-1) for w in weights]).contiguous(),
        biases=torch.cat(list(biases)).contiguous(),
        offsets=tuple(offsets),
        widths=tuple(widths),
        activations=tuple(activations),
    )


# FMA tiles keep BLOCK_M x BLOCK_K x BLOCK_N fp32 products in registers: this many elements, 64
# registers a thread at 8 warps.
_FMA_ELEMENTS = 16384
# Up to this many rows, exact fp32 (TF32 off) starts on an FMA tile 8 wide: tuned H100 chains picked
# it for 5 of 7 fp32 layers at 4 and 8 rows (docs/kernels.md), where 3xTF32 pads the rows to 16.
_FMA_FIRST_ROWS = 8


def _fma_tile(M: int, K: int, block_n: int) -> dict:
    """An FMA tile as tall as the batch, ``block_n`` wide, as deep as ``K`` or the register budget."""
    block_m = triton.next_power_of_2(M)
    block_k = max(16, min(512, _FMA_ELEMENTS // (block_m * block_n), triton.next_power_of_2(K)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "num_warps": 8 if block_m * block_n * block_k > 4096 else 4, "num_stages": 3, "FMA": True}


def fused_mlp_config(M: int, N: int, K: int, dtype: torch.dtype, sms: int = SMS) -> dict:
    """The first tile config tried for one ``[M, N]`` layer output over ``K`` inputs, and the one used
    wherever nothing is timed (the interpreter, a batch bucket ``tune_chain`` has not tuned). Small
    batches are latency-bound: narrow tiles, so a layer gets many programs (a 256-wide layer at batch
    1 gets 16), each streaming a slice of W; exact fp32 at up to ``_FMA_FIRST_ROWS`` rows an FMA tile.
    Larger batches start from 64x64 tiles. Then tiles are halved (N first) until the grid covers
    ``sms`` SMs (132 on an H200) or they reach 16x16: a layer that fills few SMs waits on few SMs'
    bandwidth. Every tile these give compiles for sm_90 without register spills
    (tests/kernels/test_fused_mlp.py)."""
    if dtype == torch.float32 and M <= _FMA_FIRST_ROWS and dot_precision(dtype) != "tf32":
        return _fma_tile(M, K, 8)
    num_stages = 3
    if M <= 16:
        # 16x16 tiles 128 deep with 4 warps: the fastest or within 3% of it for every hidden
        # layer timed (a sweep on the H200, docs/kernels.md: digits and mlp4x1024 at batch 8).
        block_m, block_n, block_k = 16, 16, 128
    elif M <= 64:
        block_m, block_n, block_k = 32, 32, 64
    else:  # fp32 dots: FMA loops or three TF32 products a step; 16-bit: tensor-core steps of 16 in k
        block_m, block_n, block_k = 64, 64, 32 if dtype == torch.float32 else 64
    while triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < sms and max(block_m, block_n) > 16:
        if block_n >= block_m:
            block_n //= 2
        else:
            block_m //= 2
    # 8 warps for 64x64x64: with 4, the normalizing layer's fp32 input tile spills on sm_90.
    num_warps = 8 if (block_m, block_n, block_k) == (64, 64, 64) else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps,
            "num_stages": num_stages, "FMA": False}


def fused_mlp_candidates(M: int, N: int, K: int, dtype: torch.dtype, sms: int = SMS) -> list[dict]:
    """Tile configs ``tune_chain`` times for one layer (``fused_mlp_config`` first), at most 7.
    Up to 16 rows: the 16x16 tensor-core tiles that won some layer of the H200 sweep
    (``docs/kernels.md``; 64 deep for a narrow K, 256 deep with 2 warps for the
    normalizing layer of a 1024-wide model) and FMA tiles as narrow as the batch. Past that, the
    tiles around the default and the wider ones that won single layers of the sweep at batch 64 and
    512 (up to 3x faster alone than the SM-filling default): alone they mispredict the chain (the
    digits chain at batch 512 got slower with them, 40 -> 63 us), so only ``tune_chain``, which times
    the whole chain, may pick them."""
    configs = [fused_mlp_config(M, N, K, dtype, sms)]

    def add(block_m, block_n, block_k, num_warps):  # a tensor-core tile (FMA tiles come from _fma_tile)
        config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps,
                  "num_stages": 3, "FMA": False}
        if config not in configs:
            configs.append(config)

    if M <= 16:
        add(16, 16, 128, 4)
        add(16, 16, 64, 4)
        add(16, 16, 256, 2)
        for block_n in (16, 8):
            if (tile := _fma_tile(M, K, block_n)) not in configs:
                configs.append(tile)
    elif M <= 64:
        add(16, 16, 128, 4)
        add(32, 32, 64, 4)
        # The batch-64 winners (mlp4x1024, bf16): 16x64 and 16x32 128 deep, 32x64. fp32 16x64 tiles
        # 64 deep: 128 deep the normalizing layer's fp32 input tile spills on sm_90.
        add(16, 64, 64 if dtype == torch.float32 else 128, 4)
        add(16, 32, 128, 4)
        add(32, 64, 64, 4)
        if M > 32:  # (64-row tiles would be half padding at 32 rows or fewer)
            add(64, 16, 128, 4)
    else:
        deep = 32 if dtype == torch.float32 else 64
        add(64, 64, deep, 8)
        add(32, 64, deep, 4)
        # The batch-512 winners (digits, fp32): 16x64 tiles 32 or 64 deep, 32x32.
        add(16, 64, deep, 4)
        add(16, 64, 64, 4)
        add(32, 32, deep, 4)
    if dot_precision(dtype) == "tf32x3":
        # 3xTF32 holds a high and a low TF32 copy of both operand tiles in registers: the tiles
        # above 1280 elements a warp spilled on sm_90 (tests/kernels/test_fused_mlp.py).
        configs = [c for c in configs
                   if c["FMA"] or (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] <= 1280 * c["num_warps"]]
    return configs


def _tune_key(M: int, packed: PackedMLP, index: int) -> str:
    # What the compiled kernel and its timing depend on: the batch bucket, the layer's shape, dtype
    # and fp32 dot precision, and whether it normalizes its input and applies the activation. Not
    # the layers around it, which its time in the chain also depends on: the first chain that
    # tunes a key keeps it (tune_chain).
    K, N = packed.widths[index], packed.widths[index + 1]
    dtype = packed.weights.dtype
    role = ("normalize+" if index == 0 else "") + split_activation(packed.activations[index])[0]
    return (f"{NAME}|M{m_bucket(M)}|N{N}|K{K}|{str(dtype).removeprefix('torch.')}|{role}"
            f"|{dot_precision(dtype)}")


def _timed_config(M: int, packed: PackedMLP, index: int, device: torch.device) -> dict | None:
    """The config ``tune_chain`` stored for this layer's batch bucket on this GPU model, or None."""
    if device.type != "cuda":
        return None
    tuned = device_cache(cuda_name(device)).get(_tune_key(M, packed, index))
    return None if tuned is None else dict(tuned)


def chain_tuned(M: int, packed: PackedMLP, device) -> bool:
    """Whether ``tune_chain`` has stored every layer's config for the batch bucket of ``M`` on this
    GPU model (on the CPU nothing is timed: True)."""
    device = torch.device(device)
    return device.type != "cuda" or all(_timed_config(M, packed, i, device) is not None
                                        for i in range(packed.num_layers))


def _default_config(M: int, packed: PackedMLP, index: int, device: torch.device) -> dict:
    """``fused_mlp_config`` for layer ``index`` on ``device``."""
    return fused_mlp_config(M, packed.widths[index + 1], packed.widths[index], packed.weights.dtype,
                            sm_count(device))


def layer_config(M: int, packed: PackedMLP, index: int, device) -> dict:
    """The config layer ``index`` launches with at ``M`` rows on ``device`` when given none: the one
    ``tune_chain`` stored once it has tuned this batch bucket here, else ``fused_mlp_config``."""
    device = torch.device(device)
    return _timed_config(M, packed, index, device) or _default_config(M, packed, index, device)


def tune_chain(x: torch.Tensor, packed: PackedMLP, shift: torch.Tensor, scale: torch.Tensor) -> list[dict]:
    """Every layer's config for the whole MLP on ``x`` ``[M, K_0]`` (raw float32, as ``fused_mlp``
    takes it), tuning the batch bucket of ``M`` first where some layer has no tuned config on this
    GPU model yet.

    Tuning: ``descend_chain`` over ``fused_mlp_candidates``, timed as served (CUDA-graph replays of
    back-to-back ``fused_mlp`` calls on ``x``, the weights left in L2, where a narrow model's stay
    between batches); every winner is stored in the tune cache under its layer's key. A layer that
    already has a tuned config (another model with that layer shape and role tuned it) keeps it, as
    the one candidate of its step: launches captured since may use it. Nothing is timed on the CPU
    (``layer_config`` of each layer) or inside a CUDA-graph capture, which timing would break
    (stored configs, ``fused_mlp_config`` for the rest), nor in a thread in provisional mode
    (``kernels.provisional``: the runner's start-up).
    """
    x = _checked_input(x, packed, 0, shift, scale)  # the errors a launch raises, before any timing
    M, device = x.shape[0], x.device
    tuned = [_timed_config(M, packed, index, device) for index in range(packed.num_layers)]
    if (device.type != "cuda" or None not in tuned or torch.cuda.is_current_stream_capturing()
            or provisional.mode() == "provisional"):
        return [config or _default_config(M, packed, index, device) for index, config in enumerate(tuned)]
    dtype, sms = packed.weights.dtype, sm_count(device)
    candidates = [[config] if config is not None else fused_mlp_candidates(M, N, K, dtype, sms)
                  for config, (K, N) in zip(tuned, pairwise(packed.widths), strict=True)]
    configs = descend_chain(candidates, lambda configs: fused_mlp(x, packed, shift, scale, configs))
    cache = device_cache(cuda_name(device))
    for index, config in enumerate(configs):
        if tuned[index] is None:
            cache.put(_tune_key(M, packed, index), config)
    return [dict(config) for config in configs]


def sm_count(device) -> int:
    """SMs of a CUDA device; 1 on the CPU, where the interpreter runs programs one after another
    and fewer, larger tiles are faster."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return cuda_sm_count(device)


@triton.jit
def _input_tile(src_ptr, shift_ptr, scale_ptr, rows, k0, K, stride_src, row_ok, NORMALIZE: tl.constexpr,
                BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input tile at k0, in the model dtype (normalized first for layer 0)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    a = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_src + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if NORMALIZE:
        # Raw fp32 inputs, normalized in fp32 then rounded to the model dtype (as MLP.normalize).
        # Masked columns load scale 0, so they contribute exact zeros.
        shift = tl.load(shift_ptr + ks, mask=k_ok, other=0.0)
        scale = tl.load(scale_ptr + ks, mask=k_ok, other=0.0)
        a = ((a - shift[None, :]) * scale[None, :]).to(dtype)
    return a


@triton.jit
def _step(acc, wide, a, w, FMA: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr):
    """One k step of input tile ``a`` [BLOCK_M, BLOCK_K] by W^T tile ``w`` [BLOCK_K, BLOCK_N]: into
    ``wide`` as elementwise fp32 products (FMA) or into ``acc`` by ``tl.dot``; returns both."""
    if FMA:
        wide += a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]
    else:
        acc = dot_acc(acc, a, w, INPUT_PRECISION, UPCAST_BF16)
    return acc, wide


@triton.jit
def _fused_mlp_layer_kernel(
    # pointers: this layer's input [M, K] (raw fp32 for layer 0), W [N, K], b [N], output [M, N];
    # the normalization [K] fp32 (read by layer 0 only)
    src_ptr, w_ptr, b_ptr, dst_ptr, shift_ptr, scale_ptr,
    # sizes and row strides (column strides are 1)
    M, N, K, stride_src, stride_dst,
    # meta-parameters
    NORMALIZE: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST_BF16: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMA: tl.constexpr,  # CUDA-core products instead of tl.dot (any BLOCK_M; exact fp32 products)
    STAGES: tl.constexpr,  # loads in flight in the k loop (cp.async pipeline; FMA loads too)
    K_ALIGN: tl.constexpr = 1,  # a power of two dividing K and src's row stride (``common.k_align``)
):
    """dst[m, n] = act(norm(src)[m, :] @ W[n, :] + b[n]) for this program's BLOCK_M x BLOCK_N tile."""
    K, stride_src = aligned(K, K_ALIGN), aligned(stride_src, K_ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    # The [BLOCK_K, BLOCK_N] tiles of W^T, read straight from W [N, K].
    w_ptrs = w_ptr + tl.arange(0, BLOCK_K)[:, None] + cols[None, :].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # FMA: elementwise products summed into [BLOCK_M, BLOCK_K, BLOCK_N], reduced over K once after
    # the loop. For a few rows tl.dot pads M to 16 (fp32: FMA loops that read operands through
    # shared memory every k); this does one multiply-add per weight and row, from registers.
    wide = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    # The bias is loaded first and used after the loop, so its trip to memory overlaps the loop
    # instead of adding to the program's tail (like W, it is never written by a previous layer).
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    k_first = 0
    if USE_PDL:
        # The packed weights are written once, when the runner is built, so the first W tile may be
        # read while the previous layer still runs (the first k step is peeled off the loop for
        # that). Then let the next layer start launching, and wait for the previous layer (and
        # every kernel before it: each waited here) to finish writing src before reading it.
        w = tl.load(w_ptrs, mask=(tl.arange(0, BLOCK_K) < K)[:, None] & col_ok[None, :], other=0.0)
        launch_dependents_then_wait()
        a = _input_tile(src_ptr, shift_ptr, scale_ptr, rows, 0, K, stride_src, row_ok, NORMALIZE, BLOCK_K,
                        w_ptr.dtype.element_ty)
        acc, wide = _step(acc, wide, a, w, FMA, INPUT_PRECISION, UPCAST_BF16)
        k_first = BLOCK_K
    for k0 in tl.range(k_first, K, BLOCK_K, num_stages=STAGES):
        a = _input_tile(src_ptr, shift_ptr, scale_ptr, rows, k0, K, stride_src, row_ok, NORMALIZE, BLOCK_K,
                        w_ptr.dtype.element_ty)
        w = tl.load(w_ptrs + k0, mask=(k0 + tl.arange(0, BLOCK_K) < K)[:, None] & col_ok[None, :], other=0.0)
        acc, wide = _step(acc, wide, a, w, FMA, INPUT_PRECISION, UPCAST_BF16)
    if FMA:
        acc = tl.sum(wide, axis=1)
    # Epilogue: bias and activation while the accumulator is still in fp32, then one store.
    acc = apply_activation(acc + bias[None, :], ACTIVATION)
    tl.store(dst_ptr + rows[:, None].to(tl.int64) * stride_dst + cols[None, :],
             acc.to(dst_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _checked_input(h, packed: PackedMLP, index: int, shift, scale) -> torch.Tensor:
    """``h`` with a unit column stride, once every argument of a launch of layer ``index`` checks out
    (TypeError or ValueError naming the first that does not)."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < packed.num_layers:
        raise ValueError(f"index must be a layer number in [0, {packed.num_layers}), got {index!r}")
    dtype = packed.weights.dtype
    K = packed.widths[index]
    want_dtype = torch.float32 if index == 0 else dtype
    if h.dtype != want_dtype or h.dim() != 2 or h.shape[1] != K or h.shape[0] < 1:
        raise ValueError(f"h must be {want_dtype} [M >= 1, {K}] for layer {index}, got {h.dtype} "
                         f"{list(h.shape)}")
    if h.device != packed.weights.device:
        raise ValueError(f"h must be on {packed.weights.device} (the weights' device), got {h.device}")
    if not fused_mlp_supported(packed.widths, dtype, h.device):
        raise ValueError(f"fused_mlp takes float32/float16/bfloat16 models on CUDA or under "
                         f"TRITON_INTERPRET=1; got {dtype} on {h.device}")
    if h.stride(1) != 1:
        h = h.contiguous()
    if index == 0:
        check_normalization(shift, scale, K, h.device)
    return h


def fused_mlp_layer(h: torch.Tensor, packed: PackedMLP, index: int, shift: torch.Tensor,
                    scale: torch.Tensor, config: dict | None = None, pdl: bool | None = None) -> torch.Tensor:
    """Layer ``index`` of a packed MLP, one launch: ``[M, K_index] -> [M, N_index]`` in the model dtype.

    Layer 0 takes the raw float32 input and applies ``(h - shift) * scale`` (float32 ``[K_0]``)
    while loading it; later layers take the previous layer's output and ignore shift/scale.
    Layer ``index`` applies ``packed.activations[index]`` (a row-wise one in torch, after the launch).
    ``config``: tile sizes (default: ``layer_config``: the config ``tune_chain`` chose for this batch
    bucket in the whole chain, or ``fused_mlp_config`` until it has run; a layer alone is never timed,
    since alone it mispredicts its time in the chain). ``pdl``: launch with programmatic dependent
    launch (None: wherever ``pdl_supported``).
    """
    h = _checked_input(h, packed, index, shift, scale)
    M, N, dtype = h.shape[0], packed.widths[index + 1], packed.weights.dtype
    if pdl is None:
        pdl = pdl_supported(h.device)
    elif pdl and not pdl_supported(h.device):
        raise ValueError(f"pdl=True needs a CUDA device of compute capability >= 9.0, got {h.device}")
    config = dict(layer_config(M, packed, index, h.device) if config is None else config)
    config.setdefault("FMA", False)
    config.setdefault("num_stages", 3)
    on_cpu = h.device.type == "cpu"
    out = torch.empty(M, N, device=h.device, dtype=dtype)
    w_offset, b_offset = packed.offsets[index]
    grid = (triton.cdiv(M, config["BLOCK_M"]), triton.cdiv(N, config["BLOCK_N"]))
    normalize = index == 0
    epilogue, after = split_activation(packed.activations[index])
    if pdl:
        config["launch_pdl"] = True  # a launch option, not a kernel argument
    _fused_mlp_layer_kernel[grid](
        h, packed.weights[w_offset:], packed.biases[b_offset:], out,
        shift if normalize else h, scale if normalize else h,  # unread unless NORMALIZE
        # Sizes are plain ints: Triton turns any that equals 1 (M at batch 1) into a constant.
        M, N, packed.widths[index], h.stride(0), out.stride(0),
        NORMALIZE=normalize,
        ACTIVATION=epilogue,
        INPUT_PRECISION=dot_precision(dtype),
        # The interpreter's bf16 tl.dot is wrong (its fp32 one is right): upcast there only.
        UPCAST_BF16=on_cpu and dtype == torch.bfloat16,
        USE_PDL=pdl,
        STAGES=config["num_stages"],
        K_ALIGN=k_align(packed.widths[index], h),
        **config,
    )
    return out if after is None else after(out)


def fused_mlp(x: torch.Tensor, packed: PackedMLP, shift: torch.Tensor, scale: torch.Tensor,
              configs: list[dict] | None = None) -> torch.Tensor:
    """The whole MLP on raw inputs: ``x [M, K_0]`` float32 -> ``[M, N_last]`` in the model dtype,
    one ``fused_mlp_layer`` launch per layer. ``configs``: one per layer (default: ``tune_chain``'s,
    which tunes the chain at the first call in a new batch bucket on a GPU)."""
    if configs is None:
        configs = tune_chain(x, packed, shift, scale)
    elif len(configs) != packed.num_layers:
        raise ValueError(f"configs must hold one config per layer ({packed.num_layers}), got {len(configs)}")
    h = x
    for index, config in enumerate(configs):
        h = fused_mlp_layer(h, packed, index, shift, scale, config=config)
    return h
