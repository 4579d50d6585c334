"""Compile the Gluon kernels for sm_90 without a GPU (see ``kernels._sm90``)."""

from __future__ import annotations

import torch
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import MockTensor

from fusedserve.kernels._sm90 import compile_sm90 as _compile
from fusedserve.kernels.gluon_linear import GluonConfig, gluon_linear_kernel, make_launch_args


def compile_sm90(M: int, N: int, K: int, dtype: torch.dtype, cfg: GluonConfig, activation: str,
                 has_bias: bool):
    """The CompiledKernel for one launch; ``.asm["ptx"]``, ``.asm["ttgir"]``, ``.metadata.shared``."""
    x2d = MockTensor(dtype, [M, K])
    weight = MockTensor(dtype, [N, K])
    y = MockTensor(dtype, [M, N])
    bias = MockTensor(torch.float32, [N]) if has_bias else None
    args, meta = make_launch_args(x2d, weight, bias, y, cfg, activation)
    return _compile(gluon_linear_kernel, args, meta, source=GluonASTSource)


def compile_small_m_sm90(M: int, N: int, K: int, dtype: torch.dtype, config: dict, activation: str,
                         has_bias: bool, pdl: bool = True, prefetch_weight: bool = False):
    """The CompiledKernel of one ``kernels.gluon_small_m`` launch with ``config``."""
    from fusedserve.kernels import gluon_small_m

    x2d = MockTensor(dtype, [M, K])
    weight = MockTensor(dtype, [N, K])
    y = MockTensor(dtype, [M, N])
    bias = MockTensor(dtype, [N]) if has_bias else y
    part = MockTensor(torch.float32, [config["SPLIT_K"], M, N])
    locks = MockTensor(torch.int32, [N])
    w_desc, x_desc = gluon_small_m.descriptors(x2d, weight, config)
    meta = dict(HAS_BIAS=has_bias, ACTIVATION=activation, SPLIT_K=config["SPLIT_K"], STAGES=config["STAGES"],
                USE_PDL=pdl, PREFETCH_W=pdl and prefetch_weight, num_warps=config["num_warps"])
    return _compile(gluon_small_m.gluon_small_m_kernel, (w_desc, x_desc, bias, y, part, locks, M, N, K, N), meta,
                    source=GluonASTSource)
