"""``fused_linear``: the one entry point for ``Y = act(X @ W^T + b)`` on our kernels.

It checks arguments, flattens ``[..., K]`` inputs to ``[M, K]``, picks a kernel by shape and device
(``kernels.dispatch``), looks up that kernel's tuned config for the shape's batch bucket (timing the
candidates the first time, see ``kernels.autotune_cache``), and launches it.
"""

import functools
import importlib
import math

import torch

from kernels import autotune_cache, dispatch, small_m, tiled, tma_persistent
from kernels.arguments import check_args, interpreting

_LAUNCHERS = {m.NAME: m for m in (tiled, small_m, tma_persistent)}


def _unit_column_stride(t):
    """The kernels index rows by stride and columns by +1; anything else is copied once."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _capability(device):
    if device.type != "cuda" or interpreting():
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
    if interpreting() or x2d.device.type != "cuda":
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


def _flatten(x, weight, bias):
    """``x [..., K]`` as ``x2d [M, K]`` and the leading shape; x2d and weight with unit column stride."""
    lead = x.shape[:-1]
    x2d = _unit_column_stride(x.reshape(math.prod(lead), weight.shape[1]))
    return x2d, _unit_column_stride(weight), (bias.contiguous() if bias is not None else None), lead


def _degenerate(x2d, weight, bias, activation):
    """The result when M, N or K is 0 (no kernel launch), else None."""
    M, K = x2d.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    if K == 0:
        # An empty sum: every output is act(b) (or act(0)); computed in fp32 like the kernels' epilogue.
        acc = torch.zeros((M, N), device=x2d.device, dtype=torch.float32)
        if bias is not None:
            acc += bias.float()
        return _torch_activation(acc, activation).to(x2d.dtype)
    return None


def _launch(name, x2d, weight, bias, activation):
    if name == dispatch.GLUON:
        return _gluon_module().gluon_fused_linear(x2d, weight, bias, activation)
    out = torch.empty((x2d.shape[0], weight.shape[0]), device=x2d.device, dtype=x2d.dtype)
    launch_kw = dict(input_precision=_input_precision(x2d.dtype),
                     upcast_bf16=interpreting() and x2d.dtype == torch.bfloat16)
    config = _config_for(name, x2d, weight, bias, activation, out, launch_kw)
    return _LAUNCHERS[name].launch(x2d, weight, bias, activation, out, config, **launch_kw)


def fused_linear(x, weight, bias=None, activation="relu"):
    """``Y = act(X @ W^T + b)`` with bias and activation fused into the GEMM epilogue.

    x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout); bias: ``[N]`` or None; activation:
    one of ``ACTIVATIONS`` ("gelu" is the tanh approximation). float32/float16/bfloat16, all the
    same dtype; returns ``[..., N]`` in x's dtype. float32 uses TF32 only when
    ``torch.backends.cuda.matmul.allow_tf32`` is True. CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    check_args(x, weight, bias, activation)
    x2d, weight, bias, lead = _flatten(x, weight, bias)
    y = _degenerate(x2d, weight, bias, activation)
    if y is None:
        M, K = x2d.shape
        N = weight.shape[0]
        out_aligned = (N * x2d.element_size()) % 16 == 0  # the output is a fresh contiguous tensor
        tma_aligned = out_aligned and tma_persistent.tma_compatible(x2d, weight)
        y = _launch(_select(M, N, K, x2d.dtype, x2d.device, tma_aligned), x2d, weight, bias, activation)
    return y.reshape(*lead, weight.shape[0])


KERNELS = (dispatch.SMALL_M, dispatch.TILED, dispatch.TMA_PERSISTENT, dispatch.GLUON)


def run_kernel(name, x, weight, bias=None, activation="relu"):
    """``fused_linear`` forced onto one kernel of ``KERNELS`` (for benchmarks and tests), tuned
    the same way. Raises ValueError when that kernel cannot run these arguments here."""
    if name not in KERNELS:
        raise ValueError(f"name must be one of {KERNELS}, got {name!r}")
    check_args(x, weight, bias, activation)
    x2d, weight, bias, lead = _flatten(x, weight, bias)
    M, K = x2d.shape
    N = weight.shape[0]
    y = _degenerate(x2d, weight, bias, activation)
    if y is not None:
        return y.reshape(*lead, N)
    half = x2d.dtype in (torch.float16, torch.bfloat16)
    aligned = (N * x2d.element_size()) % 16 == 0 and tma_persistent.tma_compatible(x2d, weight)
    capability = _capability(x2d.device)
    hopper_or_interpreter = capability is None or capability[0] == 9
    if name == dispatch.TMA_PERSISTENT and not (half and aligned and hopper_or_interpreter):
        raise ValueError(f"name {name!r} needs fp16/bf16, 16-byte aligned rows (N={N}, K={K}) and a Hopper "
                         "GPU or the interpreter")
    if name == dispatch.GLUON and not (aligned and _gluon_ok(M, N, K, x2d.dtype, x2d.device)):
        raise ValueError(f"name {name!r}: the Gluon kernel is unavailable or does not accept "
                         f"M={M} N={N} K={K} {x2d.dtype} on {x2d.device}")
    return _launch(name, x2d, weight, bias, activation).reshape(*lead, N)


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
    if interpreting() or device.type != "cuda":
        return name, autotune_cache.config_str(module.INTERPRET_CONFIG)
    config = _tune_cache(torch.cuda.get_device_name(device)).get(_tune_key(name, max(M, 1), N, K, dtype))
    return name, autotune_cache.config_str(config) if config is not None else ""
