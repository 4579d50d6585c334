"""Picking and launching a kernel for one call: the candidate kernels (``kernels.dispatch``), the
tuned (kernel, config) for the shape's batch bucket (timed once, then read from the tune cache,
see ``kernels.autotune_cache``), and the launch itself.
"""

import functools
import importlib
import itertools

import torch

from fusedserve.kernels import autotune_cache, dispatch, small_m, tiled, tma_persistent
from fusedserve.kernels.arguments import interpreting
from fusedserve.kernels.common import cuda_capability, cuda_name, dot_precision, pdl_supported

LAUNCHERS = {m.NAME: m for m in (tiled, small_m, tma_persistent)}


@functools.cache
def gluon_module():
    """The Gluon kernel module, or None when it cannot be imported here (it is optional)."""
    try:
        return importlib.import_module("fusedserve.kernels.gluon_linear")
    except ImportError:
        return None


@functools.cache
def _gluon_module(name):
    return importlib.import_module(f"fusedserve.kernels.{name}")


def launcher(name):
    """The module that times and launches kernel ``name`` (``candidates``, ``launch``); the Gluon
    weight-streaming and warp-specialized ones are imported on first use (their modules need the
    optional Gluon API)."""
    if name in (dispatch.GLUON_SMALL_M, dispatch.GLUON_WS):
        return _gluon_module(name)
    return LAUNCHERS[name]


def capability(device):
    """CUDA compute capability, or None where kernels run in the interpreter."""
    if device.type != "cuda" or interpreting():
        return None
    return cuda_capability(device)


def gluon_ok(M, N, K, dtype, device):
    gluon = gluon_module()
    return (gluon is not None and capability(device) is not None
            and bool(gluon.gluon_supported(M, N, K, dtype, device)))


def candidates(M, N, K, dtype, device, tma_aligned):
    return dispatch.candidate_kernels(M, N, K, dtype, capability=capability(device), tma_aligned=tma_aligned,
                                      gluon_ok=tma_aligned and gluon_ok(M, N, K, dtype, device))


def _tune_key(kernels, M, N, K, dtype, static_weight):
    # The candidate set is part of the key: a different set (Gluon missing, say) is tuned afresh.
    # So is the weight prefetch, which changes the kernels' timing and shared memory.
    return (f"{'+'.join(kernels)}|M{dispatch.m_bucket(M)}|N{N}|K{K}|{str(dtype).removeprefix('torch.')}"
            f"|{dot_precision(dtype)}" + ("|static_weight" if static_weight else ""))


def cached_choice(kernels, M, N, K, dtype, device, static_weight=False):
    """The tuned ``(kernel, config)`` for this bucket, or None if it has not been tuned here."""
    if interpreting():
        return None
    entry = autotune_cache.device_cache(cuda_name(device)).get(_tune_key(kernels, M, N, K, dtype, static_weight))
    return None if entry is None else (entry["kernel"], entry["config"])


def _launch_kw(x2d, static_weight):
    pdl = pdl_supported(x2d.device)
    return dict(input_precision=dot_precision(x2d.dtype),
                upcast_bf16=interpreting() and x2d.dtype == torch.bfloat16,
                pdl=pdl, prefetch_weight=pdl and static_weight)


def launch(name, config, x2d, weight, bias, activation, static_weight=False):
    """Run one kernel with one config (None for Gluon, which picks its own) into a new output."""
    if name == dispatch.GLUON:
        return gluon_module().gluon_fused_linear(x2d, weight, bias, activation)
    out = torch.empty((x2d.shape[0], weight.shape[0]), device=x2d.device, dtype=x2d.dtype)
    return launcher(name).launch(x2d, weight, bias, activation, out, config, **_launch_kw(x2d, static_weight))


def options(kernels, M, N, K, dtype):
    """Every (kernel, config) the tuner times for these candidate kernels at ``M`` rows."""
    pairs = []
    for name in kernels:
        if name == dispatch.GLUON:
            pairs.append((name, None))
        else:
            pairs += [(name, cfg) for cfg in launcher(name).candidates(M, N, K, dtype)]
    return pairs


# Tuning cycles over copies of the arguments that together exceed an H200's 50 MB L2, so each call
# reads its weights from HBM, as a layer does when other layers run in between (small layers get up
# to _MAX_SETS copies; together they may still fit in L2, as they would in serving).
_COLD_BYTES = 128 * 2**20
_MAX_SETS = 32


def _rotating_sets(x2d, weight, bias):
    """The caller's arguments plus copies (same strides, so the same kernel variant is timed)."""
    set_bytes = (x2d.numel() + weight.numel() + (bias.numel() if bias is not None else 0)) * x2d.element_size()
    count = max(2, min(_MAX_SETS, -(-_COLD_BYTES // max(set_bytes, 1))))
    copies = [(x2d, weight, bias)]
    for _ in range(count - 1):
        copies.append(tuple(None if t is None else _same_layout_copy(t) for t in (x2d, weight, bias)))
    return copies


def _same_layout_copy(t):
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t.detach())  # a parameter's copy need not join autograd


def choose(kernels, x2d, weight, bias, activation, static_weight=False):
    """The ``(kernel, config)`` to run: the interpreter's fixed choice, the cached tuned one, or
    (first call for this bucket) the fastest of every candidate kernel and config, timed now on
    these arguments grown to the bucket's largest M (``dispatch.bucket_rows``) and stored. Inside a
    CUDA-graph capture, where timing would break the capture, an untuned bucket runs the first
    candidate's first config and nothing is stored (the model runner warms every bucket before
    capturing)."""
    M, K = x2d.shape
    N = weight.shape[0]
    if interpreting():  # (check_args lets CPU tensors through only then)
        name = kernels[0]
        return name, None if name == dispatch.GLUON else LAUNCHERS[name].INTERPRET_CONFIG
    tuned = cached_choice(kernels, M, N, K, x2d.dtype, x2d.device, static_weight)
    if tuned is not None:
        return tuned
    if torch.cuda.is_current_stream_capturing():
        return options(kernels, M, N, K, x2d.dtype)[0]
    x_timed = dispatch.bucket_rows(x2d)
    pairs = options(kernels, x_timed.shape[0], N, K, x2d.dtype)
    sets = _rotating_sets(x_timed, weight, bias)
    turn = itertools.count()

    def run(option):  # each call takes the next copy of the arguments (cold L2, as in serving)
        xs, ws, bs = sets[next(turn) % len(sets)]
        return launch(option[0], option[1], xs, ws, bs, activation, static_weight)

    _, best = autotune_cache.time_configs(pairs, run, timer=autotune_cache.default_timer(len(sets)))
    autotune_cache.device_cache(cuda_name(x2d.device)).put(
        _tune_key(kernels, M, N, K, x2d.dtype, static_weight), {"kernel": best[0], "config": best[1]})
    return best


def describe(name, config, M, N, K, device):
    """The config string shown in stats: ``k=v,...`` for Triton kernels, Gluon's own name for its."""
    if name != dispatch.GLUON:
        return autotune_cache.config_str(config)
    # gluon_config is an optional extra of that module; without it the config is unknown here.
    config_of = getattr(gluon_module(), "gluon_config", None)
    return str(config_of(M, N, K, device)) if config_of is not None else ""
