"""``fused_linear``: the one entry point for ``Y = act(X @ W^T + b)`` on our kernels.

It checks arguments, flattens ``[..., K]`` inputs to ``[M, K]``, asks ``choosing`` which kernel
family and config runs the problem (tuned once per batch bucket, then read from the tune cache)
and launches it.
"""

import math
import sys
import time
from dataclasses import replace

import torch

from fusedserve.kernels import choosing, provisional, registry
from fusedserve.kernels.activations import ACTIVATIONS
from fusedserve.kernels.arguments import check_args
from fusedserve.kernels.choosing import Choice
from fusedserve.kernels.rules import problem_of, problem_of_shape, tuning_rows


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
        return ACTIVATIONS[activation](acc).to(x2d.dtype)
    return None


def fused_linear(x, weight, bias=None, activation="relu", *, static_weight=False):
    """``Y = act(X @ W^T + b)`` with bias and activation fused into the GEMM epilogue.

    x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout); bias: ``[N]`` or None; activation:
    a name in ``ACTIVATIONS`` ("gelu" is the tanh approximation). float32/float16/bfloat16, all the
    same dtype; returns ``[..., N]`` in x's dtype. float32 is as accurate as torch's (see
    ``fusedserve.kernels.precision``). CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
    The first call in a new batch bucket on a GPU times a short list at the bucket's largest batch
    (the provisional choice and the vendor's GEMM: well under a second); ``tune`` times every
    candidate kernel and config, ahead of time.

    ``static_weight=True`` promises that no kernel still in flight on the stream writes ``weight``
    (true of a served model's layers): on sm_90+, where every kernel is a programmatic dependent
    launch, the weight-streaming kernels then start reading W before waiting on the previous one.
    """
    return fused_linear_with_choice(x, weight, bias, activation, static_weight=static_weight)[0]


def fused_linear_with_choice(x, weight, bias=None, activation="relu", *, static_weight=False
                             ) -> tuple[torch.Tensor, Choice | None]:
    """``fused_linear``'s result and the ``Choice`` that computed it (None when no kernel ran:
    M, N or K is 0)."""
    check_args(x, weight, bias, activation)
    x2d, weight, bias, lead = _flatten(x, weight, bias)
    y = _degenerate(x2d, weight, bias, activation)
    choice = None
    if y is None:
        choice = choosing.choose(problem_of(x2d, weight), x2d, weight, bias, activation, static_weight)
        y = choosing.launch(choice, x2d, weight, bias, activation, static_weight)
    return y.reshape(*lead, weight.shape[0]), choice


def run_kernel(name, x, weight, bias=None, activation="relu"):
    """``fused_linear`` forced onto the kernel family ``name`` (benchmarks and tests), its config
    tuned the same way. Raises ValueError when that family cannot run these arguments."""
    if name not in registry.names():
        raise ValueError(f"name must be one of {registry.names()}, got {name!r}")
    check_args(x, weight, bias, activation)
    x2d, weight, bias, lead = _flatten(x, weight, bias)
    y = _degenerate(x2d, weight, bias, activation)
    if y is not None:
        return y.reshape(*lead, weight.shape[0])
    family = registry.family(name)
    problem = problem_of(x2d, weight)
    why = family.unfit(problem)
    if why is not None:
        raise ValueError(f"name {name!r} cannot run M={problem.M} N={problem.N} K={problem.K} {problem.dtype} "
                         f"on {x2d.device}: {why}")
    if not family.candidates(replace(problem, M=tuning_rows(problem.M))):
        raise ValueError(f"name {name!r} has no config for M={problem.M} N={problem.N} K={problem.K} "
                         f"{problem.dtype} (see its candidates())")
    with provisional.choosing_mode(provisional.mode() or "tune"):  # the family's full search, not a short list
        choice = choosing.choose(problem, x2d, weight, bias, activation, families=(family,))
    return choosing.launch(choice, x2d, weight, bias, activation).reshape(*lead, weight.shape[0])


def kernel_choice(M, N, K, dtype, device, *, static_weight=False) -> tuple[str, str]:
    """``(kernel family, config string)`` that ``fused_linear`` uses for contiguous ``[M, K]``
    inputs of ``dtype`` on ``device``: the tuned choice, the provisional one before this batch
    bucket has been tuned here (where one was made), or the default (config ""); under the
    interpreter, its fixed config."""
    problem = problem_of_shape(M, N, K, dtype, device)
    choice = choosing.current(problem, torch.device(device), static_weight)
    return choice.kernel, choice.describe()


def tune(shapes, dtype=torch.bfloat16, device="cuda", activation="relu", progress=True):
    """Run ``fused_linear`` once on every ``(M, N, K)`` in ``shapes`` with the tuning search's
    candidates timed (``choosing.SEARCH_ENV``; not the first call's short list), so each batch
    bucket's choice is in the tune cache before serving;
    returns ``{(M, N, K): (kernel, config)}``.
    With ``progress``, prints a line per shape to stderr as it finishes."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise ValueError(f"shapes must be (M, N, K) triples of positive ints, got {s}")
    device = torch.device(device)
    chosen = {}
    for i, (M, N, K) in enumerate(shapes, 1):
        x = torch.randn(M, K, device=device).to(dtype)
        w = (torch.randn(N, K, device=device) * K ** -0.5).to(dtype)
        b = torch.randn(N, device=device).to(dtype)
        start = time.perf_counter()
        with provisional.choosing_mode("tune"):
            fused_linear(x, w, b, activation)
        chosen[(M, N, K)] = kernel_choice(M, N, K, dtype, device)
        if progress:
            name, config = chosen[(M, N, K)]
            print(f"[tune {i}/{len(shapes)}] M={M} N={N} K={K} {str(dtype).removeprefix('torch.')}: "
                  f"{name} {config} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return chosen
