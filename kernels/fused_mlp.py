"""A whole narrow MLP in one launch: input normalization, every fused linear layer, the output.

``y = L_n(...act(L_1(act(L_0((x - shift) * scale))))...)`` with ``L_i(h) = h @ W_i^T + b_i`` and no
activation after the last layer. Each program owns ``BLOCK_M`` rows and carries them through every
layer, so one launch replaces one launch per layer (at small batches the launches, not the math,
set the time). A layer's output is written to a per-row scratch buffer in the model dtype (the
same rounding as the layer-by-layer path) and read back as the next layer's input by the same
program: a few KB per program that stay in L1/L2, never round-tripping through a separate launch.
Layers are walked in ``BLOCK_N`` output columns x ``BLOCK_K`` input columns, so any width works;
``MAX_WIDTH`` only says which models are narrow enough to be worth it. Every layer's weights are
packed into one buffer (``pack_mlp``) once, when the runner is built.
"""

from __future__ import annotations

import os
from itertools import pairwise
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.activations import ACTIVATIONS, apply_activation

NAME = "triton_fused_mlp"
# Which models the runner sends here. A program walks all of every layer's weights by itself (a
# small batch is one program on one SM), so only models whose weights one SM streams in a few
# microseconds qualify; past that the per-layer kernels, which spread a layer over all SMs, win.
MAX_WIDTH = 512
MAX_WEIGHT_BYTES = 512 * 1024
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PackedMLP(NamedTuple):
    """Every layer's weights and biases in two flat buffers, plus where each layer starts."""

    weights: torch.Tensor  # all W_i [N_i, K_i] flattened back to back, model dtype
    biases: torch.Tensor  # all b_i [N_i] back to back, model dtype
    meta: torch.Tensor  # int32 [layers, 4]: N_i, K_i, offset of W_i, offset of b_i
    widths: tuple[int, ...]  # (K_0, N_0, N_1, ..., N_last)
    activation: str


def fused_mlp_supported(widths, dtype, device) -> bool:
    """Whether ``fused_mlp`` takes a model of these feature widths (input first) on this device:
    every width <= ``MAX_WIDTH`` and all weights together <= ``MAX_WEIGHT_BYTES``."""
    device = torch.device(device)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if dtype not in _DTYPES:
        return False
    weight_bytes = sum(k * n for k, n in pairwise(widths)) * dtype.itemsize
    return (len(widths) >= 2 and max(widths) <= MAX_WIDTH and weight_bytes <= MAX_WEIGHT_BYTES
            and (device.type == "cuda" or (device.type == "cpu" and interpreting)))


def pack_mlp(weights, biases, activation: str) -> PackedMLP:
    """Pack ``[W_0, W_1, ...]`` (``nn.Linear`` layout) and ``[b_0, b_1, ...]`` for ``fused_mlp``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not weights or len(weights) != len(biases):
        raise ValueError(f"weights and biases must be non-empty lists of equal length, got "
                         f"{len(weights)} and {len(biases)}")
    widths = [weights[0].shape[1]]
    meta, w_offset, b_offset = [], 0, 0
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != widths[-1]:
            raise ValueError(f"weights[{i}] must be [N, {widths[-1]}], got {tuple(w.shape)}")
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"biases[{i}] must be [{w.shape[0]}], got {tuple(b.shape)}")
        if w.dtype != weights[0].dtype or b.dtype != w.dtype or w.device != weights[0].device:
            raise TypeError(f"weights[{i}]/biases[{i}] must share weights[0]'s dtype and device")
        meta.append((w.shape[0], w.shape[1], w_offset, b_offset))
        w_offset += w.numel()
        b_offset += b.numel()
        widths.append(w.shape[0])
    device = weights[0].device
    return PackedMLP(
        weights=torch.cat([w.reshape(-1) for w in weights]).contiguous(),
        biases=torch.cat(list(biases)).contiguous(),
        meta=torch.tensor(meta, dtype=torch.int32, device=device),
        widths=tuple(widths),
        activation=activation,
    )


def fused_mlp_config(M: int) -> dict:
    """Block sizes by batch. Every program reads all the weights (from L2 after the first), so
    small row blocks are cheap, and they give a mid-size batch enough programs to cover the GPU's
    SMs (132 on an H200): 16 rows up to M=2048, 32 rows up to 132 programs of them, then 64.
    Each of these compiles for sm_90 without register spills (see tests/kernels/test_fused_mlp.py)."""
    if M <= 2048:
        # One program streams every weight at batch 1: 4 stages keep 3 W tiles (48 KB in fp32) in
        # flight, since one SM's share of L2 bandwidth is bounded by bytes in flight / latency.
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    if M <= 32 * 132:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2}


def config_str(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


@triton.jit
def _layer(
    # pointers: this layer's input rows, W [N, K], b [N], output rows; normalization (layer 0)
    src_ptr, w_ptr, b_ptr, dst_ptr, shift_ptr, scale_ptr,
    # sizes and row strides (column strides are 1)
    M, N, K, stride_src, stride_dst, row0,
    # meta-parameters
    NORMALIZE: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dst[rows, :N] = act(src[rows, :K] @ W^T + b) for this program's BLOCK_M rows."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    dtype = w_ptr.dtype.element_ty
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_src + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORMALIZE:
                # Raw fp32 inputs, normalized in fp32 then rounded to the model dtype (as MLP.normalize).
                shift = tl.load(shift_ptr + ks, mask=k_ok, other=0.0)
                scale = tl.load(scale_ptr + ks, mask=k_ok, other=0.0)
                a = ((a - shift[None, :]) * scale[None, :]).to(dtype)
            # The [BLOCK_K, BLOCK_N] tile of W^T, read straight from W [N, K].
            w = tl.load(w_ptr + ks[:, None] + cols[None, :] * K,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST_BF16:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        # Epilogue: bias and activation while the accumulator is still in fp32, then one store.
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = apply_activation(acc + bias[None, :], ACTIVATION)
        tl.store(dst_ptr + rows[:, None].to(tl.int64) * stride_dst + cols[None, :],
                 acc.to(dst_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fused_mlp_kernel(
    # pointers: raw input [M, K_0] fp32, normalization [K_0] fp32, packed layers, scratch
    # [2, M, widest hidden layer] (model dtype), output [M, N_last]
    x_ptr, shift_ptr, scale_ptr, w_ptr, b_ptr, meta_ptr, scratch_ptr, y_ptr,
    # sizes and strides (stride_sb: from one scratch buffer to the other)
    M, stride_xm, stride_sb, stride_sm, stride_ym,
    # meta-parameters
    NUM_LAYERS: tl.constexpr, ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    if NUM_LAYERS == 1:
        _layer(x_ptr, w_ptr, b_ptr, y_ptr, shift_ptr, scale_ptr,
               M, tl.load(meta_ptr), tl.load(meta_ptr + 1), stride_xm, stride_ym, row0,
               True, "none", INPUT_PRECISION, UPCAST_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        # First layer: raw input -> scratch[0].
        _layer(x_ptr, w_ptr, b_ptr, scratch_ptr, shift_ptr, scale_ptr,
               M, tl.load(meta_ptr), tl.load(meta_ptr + 1), stride_xm, stride_sm, row0,
               True, ACTIVATION, INPUT_PRECISION, UPCAST_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        # Every thread's stores must be visible before any thread reads them as the next input.
        tl.debug_barrier()
        # Hidden layers: scratch[(i - 1) % 2] -> scratch[i % 2].
        for i in range(1, NUM_LAYERS - 1):
            _layer(scratch_ptr + ((i - 1) % 2) * stride_sb, w_ptr + tl.load(meta_ptr + 4 * i + 2),
                   b_ptr + tl.load(meta_ptr + 4 * i + 3), scratch_ptr + (i % 2) * stride_sb,
                   shift_ptr, scale_ptr,
                   M, tl.load(meta_ptr + 4 * i), tl.load(meta_ptr + 4 * i + 1), stride_sm, stride_sm,
                   row0, False, ACTIVATION, INPUT_PRECISION, UPCAST_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
            tl.debug_barrier()
        # Last layer, no activation: scratch -> y.
        last = NUM_LAYERS - 1
        _layer(scratch_ptr + ((last - 1) % 2) * stride_sb, w_ptr + tl.load(meta_ptr + 4 * last + 2),
               b_ptr + tl.load(meta_ptr + 4 * last + 3), y_ptr, shift_ptr, scale_ptr,
               M, tl.load(meta_ptr + 4 * last), tl.load(meta_ptr + 4 * last + 1), stride_sm,
               stride_ym, row0, False, "none", INPUT_PRECISION, UPCAST_BF16,
               BLOCK_M, BLOCK_N, BLOCK_K)


def fused_mlp(x: torch.Tensor, packed: PackedMLP, shift: torch.Tensor, scale: torch.Tensor,
              config: dict | None = None) -> torch.Tensor:
    """The whole MLP on raw inputs: ``x [M, K_0]`` float32 -> ``[M, N_last]`` in the model dtype.

    ``shift``/``scale``: float32 ``[K_0]``, applied as ``(x - shift) * scale`` before layer 0.
    ``config``: block sizes (default ``fused_mlp_config(M)``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != packed.widths[0] or x.shape[0] < 1:
        raise ValueError(f"x must be float32 [M >= 1, {packed.widths[0]}], got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    for name, t in (("shift", shift), ("scale", scale)):
        if t.dtype != torch.float32 or tuple(t.shape) != (packed.widths[0],) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{packed.widths[0]}], got "
                             f"{t.dtype} {list(t.shape)}")
    dtype = packed.weights.dtype
    if not fused_mlp_supported(packed.widths, dtype, x.device):
        raise ValueError(f"fused_mlp does not take widths {packed.widths} ({dtype}) on {x.device}: "
                         f"widths must be <= {MAX_WIDTH}, weights <= {MAX_WEIGHT_BYTES} bytes, on CUDA "
                         "or under TRITON_INTERPRET=1")
    M = x.shape[0]
    config = dict(fused_mlp_config(M) if config is None else config)
    interpreting = x.device.type == "cpu"
    out = torch.empty(M, packed.widths[-1], device=x.device, dtype=dtype)
    hidden = max(packed.widths[1:-1], default=1)
    scratch = torch.empty(2, M, hidden, device=x.device, dtype=dtype)
    fp32_ieee = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    grid = (triton.cdiv(M, config["BLOCK_M"]),)
    _fused_mlp_kernel[grid](
        x, shift, scale, packed.weights, packed.biases, packed.meta, scratch, out,
        # Sizes are plain ints: Triton turns any that equals 1 (M at batch 1) into a constant.
        M, x.stride(0), scratch.stride(0), scratch.stride(1), out.stride(0),
        NUM_LAYERS=len(packed.widths) - 1, ACTIVATION=packed.activation,
        INPUT_PRECISION="ieee" if fp32_ieee or interpreting else "tf32",
        # The interpreter's bf16 tl.dot is wrong (its fp32 one is right): upcast there only.
        UPCAST_BF16=interpreting and dtype == torch.bfloat16,
        **config,
    )
    return out
