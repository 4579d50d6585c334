"""``fused_linear``: the one entry point for ``Y = act(X @ W^T + b)`` on our kernels.

It checks arguments, flattens ``[..., K]`` inputs to ``[M, K]``, finds the candidate kernels for
the shape and device (``kernels.dispatch``), takes the tuned (kernel, config) for the shape's
batch bucket (``kernels.selection``: timed on first use, then cached on disk) and launches it.
"""

import math

import torch

from fusedserve.kernels import dispatch, selection, tma_persistent
from fusedserve.kernels.activations import TORCH_ACTIVATIONS
from fusedserve.kernels.arguments import check_args, interpreting

KERNELS = (dispatch.SMALL_M, dispatch.TILED, dispatch.TMA_PERSISTENT, dispatch.GLUON, dispatch.GLUON_SMALL_M,
           dispatch.GLUON_WS)


def _unit_column_stride(t):
    """The kernels index rows by stride and columns by +1; anything else is copied once."""
    return t if t.stride(-1) == 1 else t.contiguous()


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
        return TORCH_ACTIVATIONS[activation](acc).to(x2d.dtype)
    return None


def _tma_aligned(x2d, weight):
    # The output is a fresh contiguous tensor: only its row length can break TMA's alignment.
    return (weight.shape[0] * x2d.element_size()) % 16 == 0 and tma_persistent.tma_compatible(x2d, weight)


def fused_linear(x, weight, bias=None, activation="relu", *, static_weight=False):
    """``Y = act(X @ W^T + b)`` with bias and activation fused into the GEMM epilogue.

    x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout); bias: ``[N]`` or None; activation:
    one of ``ACTIVATIONS`` ("gelu" is the tanh approximation). float32/float16/bfloat16, all the
    same dtype; returns ``[..., N]`` in x's dtype. float32 is as accurate as torch's: plain TF32
    only when ``torch.backends.cuda.matmul.allow_tf32`` is True, else 3xTF32 on the tensor cores
    (or exact CUDA-core products with ``FUSEDSERVE_FP32_PRECISION=ieee``; see
    ``kernels.common.dot_precision``). CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
    The first call for a new batch bucket on a GPU times the candidate kernels and configs, at the
    bucket's largest batch (``kernels.tune`` does that ahead of time).

    On compute capability 9.0+ the kernels are programmatic dependent launches (they wait for the
    previous kernel on the stream before reading anything). ``static_weight=True`` promises that
    no kernel still in flight on the stream writes ``weight`` (true of a served model's layers):
    the weight-streaming kernel then starts reading W before that wait, overlapping the previous
    kernel's end.
    """
    check_args(x, weight, bias, activation)
    x2d, weight, bias, lead = _flatten(x, weight, bias)
    y = _degenerate(x2d, weight, bias, activation)
    if y is None:
        M, K = x2d.shape
        kernels = selection.candidates(M, weight.shape[0], K, x2d.dtype, x2d.device, _tma_aligned(x2d, weight))
        name, config = selection.choose(kernels, x2d, weight, bias, activation, static_weight)
        y = selection.launch(name, config, x2d, weight, bias, activation, static_weight)
    return y.reshape(*lead, weight.shape[0])


def run_kernel(name, x, weight, bias=None, activation="relu"):
    """``fused_linear`` forced onto one kernel of ``KERNELS`` (for benchmarks and tests), its
    config tuned the same way. Raises ValueError when that kernel cannot run these arguments."""
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
    aligned = _tma_aligned(x2d, weight)
    capability = selection.capability(x2d.device)
    if name == dispatch.TMA_PERSISTENT and not (half and aligned and (capability is None or capability[0] == 9)):
        raise ValueError(f"name {name!r} needs fp16/bf16, 16-byte aligned rows (N={N}, K={K}) and a Hopper "
                         "GPU or the interpreter")
    gluon_small = name == dispatch.GLUON_SMALL_M
    if name in (dispatch.GLUON, dispatch.GLUON_SMALL_M, dispatch.GLUON_WS) and not (
            aligned and selection.gluon_ok(M, N, K, x2d.dtype, x2d.device) and (not gluon_small or M <= dispatch.GLUON_SMALL_M_MAX)):
        raise ValueError(f"name {name!r}: the Gluon kernel is unavailable or does not accept "
                         f"M={M} N={N} K={K} {x2d.dtype} on {x2d.device}"
                         + (f" (it takes at most {dispatch.GLUON_SMALL_M_MAX} rows)" if gluon_small else ""))
    if not selection.options((name,), dispatch.tuning_rows(M), N, K, x2d.dtype):
        raise ValueError(f"name {name!r} has no config for M={M} N={N} K={K} {x2d.dtype} (see its candidates())")
    chosen, config = selection.choose((name,), x2d, weight, bias, activation)
    return selection.launch(chosen, config, x2d, weight, bias, activation).reshape(*lead, N)


def kernel_choice(M, N, K, dtype, device, *, static_weight=False):
    """``(kernel name, config string)`` that ``fused_linear`` uses for contiguous ``[M, K]``
    inputs of this dtype on ``device`` (``static_weight`` as passed to it). Before this batch
    bucket has been tuned here it names the default kernel with config ""; under the interpreter
    it names the fixed config used there."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    M = max(M, 1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Contiguous tensors from the caching allocator are 16-byte aligned; only the row lengths matter.
    tma_aligned = (K * itemsize) % 16 == 0 and (N * itemsize) % 16 == 0
    kernels = selection.candidates(M, N, K, dtype, device, tma_aligned)
    if interpreting() or device.type != "cuda":
        name = kernels[0]
        return name, selection.describe(name, selection.LAUNCHERS[name].INTERPRET_CONFIG, M, N, K, device)
    tuned = selection.cached_choice(kernels, M, N, K, dtype, device, static_weight)
    if tuned is None:
        return kernels[0], ""
    return tuned[0], selection.describe(tuned[0], tuned[1], M, N, K, device)
