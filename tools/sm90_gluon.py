"""Compile each Gluon family's kernel for sm_90 without a GPU (through ``tools.sm90``):
what a launch on an H200 would build, from mock tensors. ``.asm["ptx"]``, ``.asm["ttgir"]`` and
``.metadata.shared`` of the result can be asserted on."""

from __future__ import annotations

import torch
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import MockTensor

from fusedserve.kernels.gluon import small_m, stream_k, wgmma, ws
from tools import sm90


def _mocks(M, N, K, dtype):
    """x [M, K], W [N, K], Y [M, N] and a bias [N] of ``dtype``, as mock tensors."""
    return (MockTensor(dtype, s) for s in ([M, K], [N, K], [M, N], [N]))


def compile_wgmma(M: int, N: int, K: int, dtype: torch.dtype, cfg: wgmma.GluonConfig, activation: str,
                  has_bias: bool):
    """One launch of the persistent wgmma kernel (``gluon_wgmma``) with tile config ``cfg``."""
    x, w, y, _ = _mocks(M, N, K, dtype)
    bias = MockTensor(torch.float32, [N]) if has_bias else None
    args, meta = wgmma.make_launch_args(x, w, bias, y, cfg, activation)
    return sm90.compile_sm90(wgmma.gluon_linear_kernel, args, meta, source=GluonASTSource)


def compile_small_m(M: int, N: int, K: int, dtype: torch.dtype, config: dict, activation: str,
                    has_bias: bool, pdl: bool = True, prefetch_weight: bool = False):
    """One launch of the weight-streaming kernel (``gluon_small_m``) with ``config``."""
    x, w, y, b = _mocks(M, N, K, dtype)
    part = MockTensor(torch.float32, [config["SPLIT_K"], M, N])
    locks = MockTensor(torch.int32, [N])
    w_desc, x_desc = small_m.descriptors(x, w, config)
    meta = dict(HAS_BIAS=has_bias, ACTIVATION=activation, SPLIT_K=config["SPLIT_K"], STAGES=config["STAGES"],
                USE_PDL=pdl, PREFETCH_W=pdl and prefetch_weight, num_warps=config["num_warps"])
    args = (w_desc, x_desc, b if has_bias else y, y, part, locks, M, N, K, N)
    return sm90.compile_sm90(small_m.gluon_small_m_kernel, args, meta, source=GluonASTSource)


def compile_stream_k(M: int, N: int, K: int, dtype: torch.dtype, config: dict, activation: str,
                     has_bias: bool, pdl: bool = True):
    """One launch of the stream-K weight-streaming kernel (``gluon_stream_k``) with ``config``."""
    x, w, y, b = _mocks(M, N, K, dtype)
    part = MockTensor(torch.float32, [2 * stream_k.programs(N, K, config), config["BLOCK_N"] * config["BLOCK_M"]])
    locks = MockTensor(torch.int32, [N])
    meta = dict(HAS_BIAS=has_bias, ACTIVATION=activation, STAGES=config["STAGES"], USE_PDL=pdl,
                num_warps=config["num_warps"])
    args = (*stream_k.descriptors(x, w, config), b if has_bias else y, y, part, locks, M, N, K, N)
    return sm90.compile_sm90(stream_k.gluon_stream_k_kernel, args, meta, source=GluonASTSource)


def compile_ws(M: int, N: int, K: int, dtype: torch.dtype, config: dict, activation: str, has_bias: bool,
               pdl: bool):
    """One launch of the warp-specialized kernel (``gluon_ws``) with ``config``."""
    x, w, y, b = _mocks(M, N, K, dtype)
    args = (*ws.descriptors(x, w, y, config), b if has_bias else y, M, N, K)
    return sm90.compile_sm90(ws.gluon_ws_kernel, args, ws.kernel_meta(config, has_bias, activation, pdl),
                             source=GluonASTSource)
