"""The Hopper Gluon fused linear: sm_90 compile checks (CPU, CI) and numerics (GPU, capability 9.x).

Gluon never runs under TRITON_INTERPRET, so on the CPU the kernel is compiled for sm_90 and its
PTX, shared memory and registers are checked; the numbers are checked only on a Hopper GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from fusedserve.kernels import ACTIVATIONS, device
from fusedserve.kernels.gluon.wgmma import (
    GLUON_CONFIGS,
    LARGE_M,
    MEDIUM_M,
    SMALL_M,
    TINY_M,
    gluon_fused_linear,
    gluon_supported,
    pick_config,
)


def reference(x, weight, bias, activation):
    """act(x @ weight^T + bias) in float64: the answer both the kernel and torch are measured against."""
    y = x.double() @ weight.double().T
    return ACTIVATIONS[activation](y if bias is None else y + bias.double())


def torch_same_dtype(x, weight, bias, activation):
    """What torch itself computes in the input dtype, to measure torch's own rounding error."""
    return ACTIVATIONS[activation](F.linear(x, weight, None if bias is None else bias.to(x.dtype)))


IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

# Shared memory per block on sm_90 with the opt-in carve-out: 227 KB.
SM90_SMEM_BYTES = 227 * 1024


# ---------------------------------------------------------------- compile checks (CPU, CI)

COMPILE_CASES = [("none", False), ("relu", True), ("relu", False), ("gelu", True), ("silu", True)]


@pytest.mark.parametrize("cfg", GLUON_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation, has_bias", COMPILE_CASES)
def test_compiles_for_sm90(cfg, dtype, activation, has_bias):
    from tools.sm90_gluon import compile_wgmma as compile_sm90

    # Awkward sizes: M and K tails are handled by TMA clipping and zero fill, not by masks.
    compiled = compile_sm90(130, 1000, 136, dtype, cfg, activation, has_bias)
    ptx = compiled.asm["ptx"]
    where = f"{cfg} {dtype} {activation} bias={has_bias}"
    assert "wgmma.mma_async" in ptx, f"{where}: no async wgmma in the PTX"
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, f"{where}: no TMA load in the PTX"
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx, f"{where}: no TMA store in the PTX"
    assert "mbarrier.try_wait" in ptx, f"{where}: the operand ring waits on no mbarrier"
    # The main loop keeps one wgmma in flight while it waits for the next k-slice.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, f"{where}: wgmma is not pipelined"
    assert compiled.metadata.shared <= SM90_SMEM_BYTES, (
        f"{where}: {compiled.metadata.shared} bytes of shared memory, sm_90 allows {SM90_SMEM_BYTES}")
    # The bias is the only global load that is not TMA.
    assert ("ld.global" in ptx) == has_bias, f"{where}: bias loads present={'ld.global' in ptx}"
    if activation in ("gelu", "silu"):
        assert "ex2.approx" in ptx, f"{where}: no exponential in the {activation} epilogue"
    if activation == "relu":
        assert "max.f32" in ptx or "max.NaN.f32" in ptx, f"{where}: no max in the relu epilogue"


@pytest.mark.parametrize("cfg", GLUON_CONFIGS, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_no_register_spills(cfg, activation):
    from tools.sm90 import ptxas_usage
    from tools.sm90_gluon import compile_wgmma as compile_sm90

    # A spilled accumulator goes through local memory on every k-step: the kernel would crawl.
    compiled = compile_sm90(4096, 4096, 4096, torch.bfloat16, cfg, activation, True)
    registers, spill_bytes = ptxas_usage(compiled)
    assert spill_bytes == 0, f"{cfg} {activation}: {spill_bytes} bytes spilled ({registers} registers)"
    # 64K registers per SM must hold all cfg.num_warps warps of the single resident CTA.
    assert registers * 32 * cfg.num_warps <= 65536, f"{cfg} {activation}: {registers} registers per thread"


# ---------------------------------------------------------------- host-side logic (CPU, CI)

@pytest.mark.parametrize("M, N, num_sms, expected", [
    (1, 4096, 132, TINY_M),
    (16, 4096, 132, TINY_M),
    (17, 4096, 132, SMALL_M),
    (64, 1000, 132, SMALL_M),
    (65, 4096, 132, MEDIUM_M),  # 16 large tiles would leave 116 of 132 SMs idle
    (300, 4096, 132, MEDIUM_M),  # 96 medium tiles in one wave beat 48 large ones
    (1000, 4096, 132, LARGE_M),  # 128 large tiles: one wave, as long as two waves of medium ones
    (1030, 4096, 132, MEDIUM_M),  # 144 large tiles need a second, nearly empty wave
    (4096, 4096, 132, LARGE_M),
    (4096, 4096, 66, LARGE_M),
])
def test_pick_config(M, N, num_sms, expected):
    got = pick_config(M, N, num_sms)
    assert got == expected, f"M={M} N={N}: picked {got}, expected {expected}"


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device of a chosen capability is present, to test the host-side checks."""
    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        device.forget_devices()  # the kernels read a device's capability once, then keep it
    yield install
    device.forget_devices()


@pytest.mark.parametrize("capability, M, N, K, dtype, expected", [
    ((9, 0), 17, 1000, 136, torch.float16, True),
    ((9, 0), 1, 136, 4096, torch.bfloat16, True),
    ((9, 0), 3, 1001, 136, torch.float16, False),  # Y rows of 2002 bytes break TMA's 16-byte pitch
    ((9, 0), 3, 136, 100, torch.bfloat16, False),  # X and W rows of 200 bytes likewise
    ((9, 0), 3, 136, 136, torch.float32, False),  # wgmma path is for 16-bit inputs only
    ((9, 0), 0, 136, 136, torch.float16, False),
    ((8, 0), 17, 1000, 136, torch.float16, False),  # Ampere has no wgmma or TMA
    ((10, 0), 17, 1000, 136, torch.float16, False),  # Blackwell dropped wgmma
])
def test_gluon_supported(fake_gpu, capability, M, N, K, dtype, expected):
    fake_gpu(capability)
    got = gluon_supported(M, N, K, dtype, "cuda")
    assert got == expected, f"capability {capability}, M={M} N={N} K={K} {dtype}: got {got}"


def test_not_supported_on_cpu():
    assert not gluon_supported(17, 1000, 136, torch.float16, "cpu")


def test_rejects_bad_arguments_on_cpu():
    x = torch.zeros(3, 136, dtype=torch.float16)
    w = torch.zeros(1000, 136, dtype=torch.float16)
    with pytest.raises(TypeError, match="x2d"):
        gluon_fused_linear(x.numpy(), w)
    with pytest.raises(ValueError, match="activation"):
        gluon_fused_linear(x, w, None, "softplus")
    with pytest.raises(ValueError, match="weight"):
        gluon_fused_linear(x, w[:, :100])
    with pytest.raises(ValueError, match="bias"):
        gluon_fused_linear(x, w, torch.zeros(999))
    with pytest.raises(TypeError, match="weight"):
        gluon_fused_linear(x, w.float())
    with pytest.raises(TypeError, match="config"):
        gluon_fused_linear(x, w, config="BM128_BN256")
    # Well-formed, but a CPU tensor: the kernel needs a Hopper GPU.
    with pytest.raises(ValueError, match="x2d"):
        gluon_fused_linear(x, w)


# ---------------------------------------------------------------- numerics (Hopper GPU)

GPU_MS = [1, 17, 64, 130, 1000, 4096]
GPU_NKS = [(136, 1000), (1000, 136), (4096, 4096)]


def check_against_reference(M, N, K, dtype, bias_kind, activation, seed=0, config=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    # Scaled like nn.Linear's init so outputs stay O(1) at every K.
    weight = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype)
    bias = None
    if bias_kind is not None:
        bias = torch.randn(N, device="cuda", generator=gen).to(torch.float32 if bias_kind == "fp32" else dtype)

    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    got = gluon_fused_linear(x, weight, bias, activation, out=out, config=config)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "the result was not written into `out`"

    ref = reference(x, weight, bias, activation)
    nan_at = torch.isnan(got).nonzero()
    assert nan_at.numel() == 0, (f"{nan_at.shape[0]} outputs never written (NaN poison left), "
                                 f"first at {nan_at[0].tolist()}")

    err = (got.double() - ref).abs()
    torch_err = (torch_same_dtype(x, weight, bias, activation).double() - ref).abs().max().item()
    # Both round the same fp32 accumulator to a 16-bit output, but summation order differs: allow
    # twice torch's own worst error, plus one output ulp at the output's scale for the shapes where
    # torch happens to round every element exactly.
    ulp = torch.finfo(dtype).eps * max(ref.abs().max().item(), 1.0)
    tol = 2 * torch_err + ulp
    worst = err.max().item()
    if worst > tol:
        i, j = divmod(int(err.argmax()), N)
        raise AssertionError(f"M={M} N={N} K={K} {dtype} bias={bias_kind} {activation} config={config}: "
                             f"max error {worst:.3g} "
                             f"> tol {tol:.3g} (torch's own {torch_err:.3g}) at [{i}, {j}]: got "
                             f"{got[i, j].item()}, expected {ref[i, j].item()}")


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias_kind", [None, "same", "fp32"])
@pytest.mark.parametrize("N, K", GPU_NKS)
@pytest.mark.parametrize("M", GPU_MS)
def test_matches_float64_reference(M, N, K, bias_kind, activation, dtype):
    check_against_reference(M, N, K, dtype, bias_kind, activation)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("M", [17, 1000])
def test_smooth_activations(M, activation):
    check_against_reference(M, 1000, 136, torch.bfloat16, "same", activation)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M, N, K", [
    (3, 4264, 136),  # 134 tiny-config tiles: more than the H200's 132 SMs, so some CTAs run two
    (17, 8456, 136),  # 133 small-config tiles, likewise
    (1000, 4104, 1000),  # large config, 136 tiles: some CTAs run two; K tail of 40
    (4096, 4104, 4096),  # large config, ~4 tiles per CTA, an N tail of 8 columns
])
def test_persistent_tiles_beyond_one_wave(M, N, K):
    check_against_reference(M, N, K, torch.bfloat16, "same", "relu")


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("cfg", GLUON_CONFIGS, ids=str)
@pytest.mark.parametrize("M, N, K", [(3, 136, 4096), (130, 1000, 1000), (1000, 4104, 136)])
def test_every_config_when_forced(cfg, M, N, K):
    # The shape heuristic sends each shape to one config; forcing them covers every config on
    # tails in M, N and K, and several tiles per CTA.
    check_against_reference(M, N, K, torch.float16, "same", "relu", config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
def test_cuda_graph_replay():
    x = torch.randn(130, 1000, device="cuda", dtype=torch.float16)
    weight = (torch.randn(136, 1000, device="cuda") / 1000 ** 0.5).half()
    bias = torch.randn(136, device="cuda").half()
    out = torch.empty(130, 136, device="cuda", dtype=torch.float16)
    gluon_fused_linear(x, weight, bias, "relu", out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gluon_fused_linear(x, weight, bias, "relu", out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    err = (out.double() - reference(x, weight, bias, "relu")).abs().max().item()
    # fp16 output of O(1) values at K=1000: a few fp16 ulps (1e-3 each) of rounding, and a graph
    # that replayed stale inputs or skipped the kernel would be off by O(1) or leave NaN.
    assert err < 2e-2, f"graph replay: max error {err:.3g}"
