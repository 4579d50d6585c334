"""Helpers shared by the kernel tests."""

from itertools import pairwise

import torch
import torch.nn.functional as F

from fusedserve.kernels import ACTIVATIONS


def make(M, N, K, dtype, seed=0, device="cuda"):
    """Seeded ``x [M, K]``, ``w [N, K]`` (scaled by 1/sqrt(K), so outputs stay near unit size) and
    ``b [N]`` of ``dtype``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=g).to(dtype)
    w = (torch.randn(N, K, device=device, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device=device, generator=g).to(dtype)
    return x, w, b


def check_against_float64(out, x, w, b, activation, where):
    """``out`` (a kernel's ``act(x @ w^T + b)``, NaN-poisoned before the launch) against float64:
    every element written, and the largest error within twice torch's own for the same dtype (the
    two sum K in different orders) plus one output ulp of the largest value, for shapes where torch
    happens to round every element exactly. A failure names the worst element."""
    act = ACTIVATIONS[activation]
    ref = act(x.double() @ w.double().T + (b.double() if b is not None else 0))
    nan_at = torch.isnan(out).nonzero()
    assert nan_at.numel() == 0, f"{where}: {nan_at.shape[0]} outputs never written, first at {nan_at[0].tolist()}"
    err = (out.double() - ref).abs()
    theirs = (act(F.linear(x, w, b)).double() - ref).abs().max().item()
    tol = 2 * theirs + torch.finfo(x.dtype).eps * max(ref.abs().max().item(), 1.0)
    worst = err.max().item()
    if worst > tol:
        i, j = divmod(int(err.argmax()), out.shape[1])
        raise AssertionError(f"{where}: max error {worst:.3g} > tol {tol:.3g} (torch's {theirs:.3g}) at "
                             f"[{i}, {j}]: got {out[i, j].item()}, want {ref[i, j].item()}")


# (dtype, bias, activation) each Gluon family's candidates are checked with.
LAUNCH_CASES = ((torch.bfloat16, True, "relu"), (torch.float16, False, "none"))


def check_launch_against_float64(launch, M, N, K, config, cases=LAUNCH_CASES):
    """A family's ``launch(x, w, b, activation, out, config)`` at ``M, N, K`` against float64
    (``check_against_float64``) for each ``(dtype, bias, activation)`` of ``cases``, its output
    NaN-poisoned first."""
    for dtype, bias, activation in cases:
        x, w, b = make(M, N, K, dtype)
        b = b if bias else None
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        launch(x, w, b, activation, out, config)
        check_against_float64(out, x, w, b, activation, f"{config} {dtype} bias={bias} {activation}")


# Three layers of awkward widths: the input, then each layer's output size.
CHAIN_WIDTHS = (1536, 1000, 2048, 520)


def check_layers_in_cuda_graph(M, layer, tol):
    """Run a chain of three bf16 layers (``CHAIN_WIDTHS``, ReLU between them) captured back to
    back in one CUDA graph, and replay it three times on new inputs with every layer's output
    NaN-poisoned first. ``layer(i, h, w, b, activation)`` runs layer ``i`` and returns its output.
    On sm_90 the layers are programmatic dependent launches that may start before the previous one
    ends, so a layer that read its input before waiting sees the poison or the previous replay's
    values. Each replay's last output must be within ``tol(largest reference value)`` of torch's
    own bf16 layers (which round each layer too)."""
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [(torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
          for k, n in pairwise(CHAIN_WIDTHS)]
    bs = [torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) for n in CHAIN_WIDTHS[1:]]
    x = torch.randn(M, CHAIN_WIDTHS[0], device="cuda", generator=g).to(torch.bfloat16)

    def chain(layer_fn):
        outs, h = [], x
        for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
            h = layer_fn(i, h, w, b, "relu" if i < len(ws) - 1 else "none")
            outs.append(h)
        return outs

    def reference(i, h, w, b, activation):
        y = torch.nn.functional.linear(h, w, b)
        return torch.relu(y) if activation == "relu" else y

    chain(layer)  # compile and tune every layer outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(layer)
    for replay in range(3):
        x.copy_(torch.randn(M, CHAIN_WIDTHS[0], device="cuda", generator=g).to(torch.bfloat16))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        ref = chain(reference)[-1].float()
        err = (outs[-1].float() - ref).abs().max().item()
        assert err <= tol(ref.abs().max().item()), f"M={M} replay {replay}: max error {err}"
