"""Every kernel family computes every activation of the one table (``kernels.activations``).

A name added to ``ACTIVATIONS`` without a branch in ``apply_activation`` must fail loudly: the
Triton families run under the interpreter here (numerics against float64), the Gluon families
compile for sm_90 here (a missing branch fails the compile), the vendor family (torch's GEMM, then
the table's activation where cuBLASLt has no epilogue for it) runs torch's CPU ops, and on a GPU
every family's numerics are checked against float64.
"""

import pytest
import torch
from triton.compiler.errors import CompilationError

from fusedserve.kernels import ACTIVATIONS, registry, run_kernel
from fusedserve.kernels.rules import problem_of
from fusedserve.kernels.triton import fused_mlp, small_m

from .conftest import check_against_float64, make

ON_GPU = torch.cuda.is_available()
HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if ON_GPU else "cpu"
TRITON_FAMILIES = ("triton_tiled", "triton_small_m", "triton_tma_persistent", "triton_split_k", "triton_stream_k")
GLUON_FAMILIES = ("gluon_wgmma", "gluon_small_m", "gluon_stream_k", "gluon_ws")
VENDOR_FAMILIES = ("torch_cublas",)


def test_the_families_are_the_ones_checked_here():
    assert set(registry.names()) == set(TRITON_FAMILIES) | set(GLUON_FAMILIES) | set(VENDOR_FAMILIES)


def _reference(x, w, b, activation):
    return ACTIVATIONS[activation](x.double() @ w.double().T + b.double())


def _check(out, x, w, b, activation, where):
    # fp16 inputs, fp32 accumulation: the output's rounding (2^-11) and the sum's order dominate.
    ref = _reference(x, w, b, activation)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2e-3 * max(1.0, ref.abs().max().item()), f"{where}: max error {err:.3g}"


@pytest.mark.skipif(ON_GPU, reason="the interpreter's run; the GPU checks numerics below")
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("name", TRITON_FAMILIES + VENDOR_FAMILIES)
def test_triton_and_vendor_families_compute_every_activation(name, activation):
    x, w, b = make(17, 40, 136, torch.float16, device=DEVICE)
    _check(run_kernel(name, x, w, b, activation), x, w, b, activation, f"{name} {activation}")


@pytest.mark.skipif(ON_GPU, reason="the interpreter's run")
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_the_gemv_and_the_mlp_chain_compute_every_activation(activation):
    x, w, b = make(3, 40, 136, torch.float16, device=DEVICE)
    out = torch.empty(3, 40, dtype=torch.float16)
    small_m.launch(x, w, b, activation, out, small_m.INTERPRET_GEMV_CONFIG, input_precision="ieee",
                   upcast_bf16=False)
    _check(out, x, w, b, activation, f"gemv {activation}")
    packed = fused_mlp.pack_mlp([w.float(), w.float()[:, :40]], [b.float(), b.float()], activation)
    shift, scale = torch.zeros(136), torch.ones(136)
    hidden = ACTIVATIONS[activation](x.double() @ w.double().T + b.double())
    want = hidden @ w.double()[:, :40].T + b.double()  # no activation after the last layer
    got = fused_mlp.fused_mlp(x.float(), packed, shift, scale)
    assert (got.double() - want).abs().max().item() <= 1e-3 * max(1.0, want.abs().max().item()), activation


@pytest.mark.skipif(ON_GPU, reason="runs the interpreter")
def test_an_activation_without_a_branch_fails_instead_of_computing_the_identity(monkeypatch):
    from fusedserve.kernels import arguments

    monkeypatch.setitem(arguments.ACTIVATIONS, "softplus", torch.nn.functional.softplus)
    x, w, b = make(3, 40, 136, torch.float16, device=DEVICE)
    with pytest.raises(Exception, match="no branch for this activation"):
        run_kernel("triton_tiled", x, w, b, "softplus")


def _compile_gluon(name, activation):
    """Compile one launch of Gluon family ``name`` for sm_90 with ``activation``."""
    from fusedserve.kernels.gluon import small_m as gluon_small_m, stream_k, wgmma, ws
    from tools import sm90_gluon as sm90

    dtype = torch.bfloat16
    if name == "gluon_wgmma":
        return sm90.compile_wgmma(130, 1000, 136, dtype, wgmma.SMALL_M, activation, True)
    if name == "gluon_small_m":
        config = gluon_small_m.candidates(16, 1024, 512, dtype)[0]
        return sm90.compile_small_m(16, 1024, 512, dtype, config, activation, True)
    if name == "gluon_stream_k":
        config = stream_k.candidates(16, 1024, 512, dtype)[0]
        return sm90.compile_stream_k(16, 1024, 512, dtype, config, activation, True)
    return sm90.compile_ws(256, 1024, 512, dtype, ws.candidates(256, 1024, 512, dtype)[0], activation, True, True)


def _messages(error):
    """The messages of ``error`` and of every error it was raised from."""
    while error is not None:
        yield str(error)
        error = error.__cause__ or error.__context__


@pytest.mark.slow
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("name", GLUON_FAMILIES)
def test_gluon_families_compile_every_activation_for_sm90(name, activation):
    ptx = _compile_gluon(name, activation).asm["ptx"]
    if activation not in ("none", "relu"):
        assert "ex2.approx" in ptx, f"{name} {activation}: no exponential in the epilogue"


@pytest.mark.parametrize("name", GLUON_FAMILIES)
def test_a_gluon_family_refuses_an_activation_without_a_branch(name):
    with pytest.raises(CompilationError) as caught:
        _compile_gluon(name, "softplus")
    assert any("no branch for this activation" in m for m in _messages(caught.value)), name


@pytest.mark.gpu
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("name", TRITON_FAMILIES + GLUON_FAMILIES + VENDOR_FAMILIES)
def test_every_family_computes_every_activation_on_the_gpu(name, activation):
    family = registry.family(name)
    x, w, b = make(48, 1024, 512, torch.bfloat16)
    why = family.unfit(problem_of(x, w))
    if why is not None:
        pytest.skip(f"{name}: {why}")
    for config in family.candidates(problem_of(x, w))[:3]:
        out = torch.full((48, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        family.launch(x, w, b, activation, out, config, input_precision="tf32", upcast_bf16=False, pdl=False,
                      prefetch_weight=False)
        check_against_float64(out, x, w, b, activation, f"{name} {config} {activation}")

