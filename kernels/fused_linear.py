"""``fused_linear``: the one entry point for ``Y = act(X @ W^T + b)`` on our kernels.

It checks arguments, flattens ``[..., K]`` inputs to ``[M, K]``, picks a kernel by shape and device
(``kernels.dispatch``), looks up that kernel's tuned config for the shape's batch bucket (timing the
candidates the first time, see ``kernels.autotune_cache``), and launches it.
"""

import functools
import importlib
import math
import os

import torch

from kernels import autotune_cache, dispatch, small_m, tiled, tma_persistent
from kernels.activations import ACTIVATIONS

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAUNCHERS = {m.NAME: m for m in (tiled, small_m, tma_persistent)}


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_args(x, weight, bias, activation):
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension ([..., K]), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must equal weight's K ({weight.shape[1]})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x dtype {x.dtype} not supported; use one of {_DTYPES}")
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
    if x.device.type == "cpu" and _interpreting():
        return
    if x.device.type == "cpu":
        raise ValueError("x is a CPU tensor: fused_linear needs CUDA tensors, or TRITON_INTERPRET=1 "
                         "set before kernels is imported to run the kernels on CPU (slowly)")
    raise ValueError(f"x is on {x.device}; fused_linear runs on CUDA (or CPU under TRITON_INTERPRET=1)")


def _unit_column_stride(t):
    """The kernels index rows by stride and columns by +1; anything else is copied once."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _capability(device):
    if device.type != "cuda" or _interpreting():
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def _gluon_module():
    """The Gluon kernel module, or None when it cannot be imported here (it is optional)."""
    try:
        return importlib.import_module("kernels.gluon_linear")
    except ImportError:
        return None


def _gluon_ok(M, N, K, dtype, device):
    gluon = _gluon_module()
    return gluon is not None and device.type == "cuda" and bool(gluon.gluon_supported(M, N, K, dtype, device))


def _select(M, N, K, dtype, device, tma_aligned):
    capability = _capability(device)
    # Gluon is only consulted where the rules could pick it (Hopper, large M).
    gluon_ok = (capability is not None and capability[0] == 9 and M >= dispatch.GLUON_MIN_M
                and _gluon_ok(M, N, K, dtype, device))
    return dispatch.choose_kernel(M, N, K, dtype, capability=capability, tma_aligned=tma_aligned,
                                  gluon_ok=gluon_ok)


def _input_precision(dtype):
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@functools.cache
def _tune_cache(device_name):
    return autotune_cache.TuneCache(device_name)


def _tune_key(name, M, N, K, dtype):
    return f"{name}|M{dispatch.m_bucket(M)}|N{N}|K{K}|{str(dtype).removeprefix('torch.')}|{_input_precision(dtype)}"


def _config_for(name, x2d, weight, bias, activation, out, launch_kw):
    """The config to launch ``name`` with: the interpreter's fixed one, the cached tuned one, or
    (first time for this bucket) the fastest candidate, timed now and stored."""
    module = _LAUNCHERS[name]
    if _interpreting() or x2d.device.type != "cuda":
        return module.INTERPRET_CONFIG
    M, K = x2d.shape
    N = weight.shape[0]
    cache = _tune_cache(torch.cuda.get_device_name(x2d.device))
    key = _tune_key(name, M, N, K, x2d.dtype)
    config = cache.get(key)
    if config is not None:
        return config
    candidates = module.candidates(M, N, K)
    if torch.cuda.is_current_stream_capturing():
        # Timing inside a CUDA-graph capture would break it: take the first candidate, uncached.
        # Callers that care (the model runner) warm every bucket before capturing.
        return candidates[0]
    _, best = autotune_cache.time_configs(
        candidates, lambda cfg: module.launch(x2d, weight, bias, activation, out, cfg, **launch_kw))
    cache.put(key, best)
    return best


def fused_linear(x, weight, bias=None, activation="relu"):
    """``Y = act(X @ W^T + b)`` with bias and activation fused into the GEMM epilogue.

    x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout); bias: ``[N]`` or None; activation:
    one of ``ACTIVATIONS`` ("gelu" is the tanh approximation). float32/float16/bfloat16, all the
    same dtype; returns ``[..., N]`` in x's dtype. float32 uses TF32 only when
    ``torch.backends.cuda.matmul.allow_tf32`` is True. CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    _check_args(x, weight, bias, activation)
    N, K = weight.shape
    lead = x.shape[:-1]
    x2d = _unit_column_stride(x.reshape(math.prod(lead), K))
    weight = _unit_column_stride(weight)
    bias = bias.contiguous() if bias is not None else None
    M = x2d.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.reshape(*lead, N)
    if K == 0:
        # An empty sum: every output is act(b) (or act(0)); computed in fp32 like the kernels' epilogue.
        acc = torch.zeros((M, N), device=x.device, dtype=torch.float32)
        if bias is not None:
            acc += bias.float()
        return _torch_activation(acc, activation).to(x.dtype).reshape(*lead, N)

    tma_aligned = tma_persistent.tma_compatible(x2d, weight, out)
    name = _select(M, N, K, x.dtype, x.device, tma_aligned)
    if name == dispatch.GLUON:
        return _gluon_module().gluon_fused_linear(x2d, weight, bias, activation).reshape(*lead, N)
    launch_kw = dict(input_precision=_input_precision(x.dtype),
                     upcast_bf16=_interpreting() and x.dtype == torch.bfloat16)
    config = _config_for(name, x2d, weight, bias, activation, out, launch_kw)
    _LAUNCHERS[name].launch(x2d, weight, bias, activation, out, config, **launch_kw)
    return out.reshape(*lead, N)


def _torch_activation(t, activation):
    if activation == "relu":
        return torch.relu(t)
    if activation == "gelu":
        return torch.nn.functional.gelu(t, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(t)
    return t


def kernel_choice(M, N, K, dtype, device):
    """``(kernel name, config string)`` that ``fused_linear`` uses for contiguous ``[M, K]`` inputs
    of this dtype on ``device``; the config string is "" until that shape's bucket has been tuned
    (the Gluon kernel picks its config by rule, so it is always known)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Contiguous tensors from the caching allocator are 16-byte aligned; only the row lengths matter.
    tma_aligned = (K * itemsize) % 16 == 0 and (N * itemsize) % 16 == 0
    name = _select(max(M, 1), N, K, dtype, device, tma_aligned)
    if name == dispatch.GLUON:
        # gluon_config is an optional extra of that module; without it the config is unknown here.
        config_of = getattr(_gluon_module(), "gluon_config", None)
        return name, str(config_of(M, N, K, device)) if config_of is not None else ""
    module = _LAUNCHERS[name]
    if _interpreting() or device.type != "cuda":
        return name, autotune_cache.config_str(module.INTERPRET_CONFIG)
    config = _tune_cache(torch.cuda.get_device_name(device)).get(_tune_key(name, max(M, 1), N, K, dtype))
    return name, autotune_cache.config_str(config) if config is not None else ""
