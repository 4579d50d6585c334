"""Argument checks shared by ``fused_linear`` and ``run_kernel``: wrong input raises ValueError or
TypeError naming the argument and saying what to pass instead."""

import os

import torch

from fusedserve.kernels.activations import ACTIVATIONS

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting():
    """Whether Triton runs kernels in its CPU interpreter (read at call time, as Triton does at
    decoration time; set it before importing ``kernels``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_args(x, weight, bias, activation):
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension ([..., K]), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must equal weight's K ({weight.shape[1]})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x dtype {x.dtype} not supported; use one of {DTYPES}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"bias dtype {bias.dtype} must match x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if bias is not None and bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    if x.device.type == "cuda":
        return
    if x.device.type == "cpu" and interpreting():
        return
    if x.device.type == "cpu":
        raise ValueError("x is a CPU tensor: fused_linear needs CUDA tensors, or TRITON_INTERPRET=1 "
                         "set before kernels is imported to run the kernels on CPU (slowly)")
    raise ValueError(f"x is on {x.device}; fused_linear runs on CUDA (or CPU under TRITON_INTERPRET=1)")


def check_normalization(shift, scale, K, device):
    """The input normalization's ``shift`` and ``scale``: contiguous float32 ``[K]`` on ``device``
    (ValueError naming the first that is not)."""
    for name, t in (("shift", shift), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (K,) \
                or not t.is_contiguous() or t.device != device:
            raise ValueError(f"{name} must be a contiguous float32 [{K}] tensor on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
