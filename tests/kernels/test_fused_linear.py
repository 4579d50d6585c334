"""fused_linear on CPU tensors under Triton's interpreter (conftest sets TRITON_INTERPRET=1 when there
is no GPU; on a GPU machine the same tests run on CUDA tensors).

bfloat16: the interpreter's ``tl.dot`` on bf16 is wrong, so under the interpreter the kernels upcast
bf16 tiles to fp32 before the dot (a constexpr switch); the bf16 results checked here come from that
path. The real bf16 MMA is checked on the GPU (test_fused_linear_gpu.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedserve import kernels
from fusedserve.kernels import ACTIVATIONS, KERNELS, fused_linear, kernel_choice, provisional, run_kernel
from fusedserve.kernels.rules import tma_compatible
from fusedserve.kernels.triton import small_m, split_k, tiled, tma_persistent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, weight, bias, activation):
    """act(x @ weight^T + bias) in float64."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return ACTIVATIONS[activation](y)


# One unit in the last place of each output dtype, relative. Rounding the fp32 accumulator to the
# output costs half of that; a whole one is allowed because the interpreter converts fp32 to bf16
# by truncation (seen: errors of exactly 2^-8 relative).
_OUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# fp32 accumulation (and TF32 inputs, when torch allows it on the GPU) loses at most about K units of
# the accumulator's precision of sum(|x| |w|) (the standard dot-product error bound).
_ACC_EPS = 2.0**-23


def assert_matches(out, x, weight, bias, activation):
    """|out - ref| <= ulp(out dtype) * |ref| + 2 * K * eps_acc * (|x| @ |w|^T + |b|) elementwise.

    The factor 2 covers the activation: gelu/silu have slopes up to ~1.13, so they scale the
    pre-activation error by at most that, and they are evaluated in fp32 (a few fp32 ulps more).
    """
    ref = reference(x, weight, bias, activation)
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    assert out.dtype == x.dtype, f"dtype {out.dtype} != x's {x.dtype}"
    K = x.shape[-1]
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    tol = _OUT_ULP[x.dtype] * ref.abs() + 2 * max(K, 1) * _ACC_EPS * magnitude + 1e-30
    err = (out.double() - ref).abs()
    bad = ~(err <= tol)  # NaN counts as bad
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} of {out.numel()} elements mismatch; first at {idx}: got "
            f"{out[idx].item()!r}, want {ref[idx].item()!r} (tol {tol[idx].item():.3g}), "
            f"max err {err.max().item():.3g}")


def make(M, N, K, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) / max(K, 1) ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


# Every dtype meets every activation, with and without bias, over awkward shapes (M from 1 to 130,
# N and K not multiples of any tile): a covering set rather than the full product, to keep the
# interpreter run short.
CASES = [
    # (M, N, K, dtype, activation, bias)
    (1, 5, 33, torch.float32, "relu", True),
    (3, 100, 130, torch.float32, "tanh", False),
    (17, 33, 100, torch.float32, "gelu", True),
    (70, 130, 5, torch.float32, "silu", False),
    (130, 33, 70, torch.float32, "relu", False),
    (1, 130, 100, torch.float16, "none", True),
    (3, 33, 5, torch.float16, "sigmoid", False),
    (17, 100, 130, torch.float16, "silu", True),
    (70, 5, 33, torch.float16, "gelu", False),
    (130, 100, 33, torch.float16, "relu", True),
    (1, 33, 130, torch.bfloat16, "gelu", False),
    (3, 5, 100, torch.bfloat16, "silu", True),
    (17, 130, 33, torch.bfloat16, "relu", True),
    (70, 100, 17, torch.bfloat16, "tanh", True),
    (100, 1, 1, torch.bfloat16, "relu", False),
    (1, 1, 1, torch.float32, "none", True),
    (17, 40, 70, torch.float32, "gelu_erf", True),
    (70, 33, 100, torch.bfloat16, "gelu_erf", False),
]


@pytest.mark.parametrize("M,N,K,dtype,activation,bias", CASES)
def test_matches_float64_reference(M, N, K, dtype, activation, bias):
    x, w, b = make(M, N, K, dtype, bias)
    assert_matches(fused_linear(x, w, b, activation), x, w, b, activation)


def test_every_activation_is_covered():
    assert {c[4] for c in CASES} == set(ACTIVATIONS)
    assert set(ACTIVATIONS) >= {"none", "relu"}


def test_default_activation_is_relu():
    x, w, b = make(3, 17, 5, torch.float32)
    assert_matches(fused_linear(x, w, b), x, w, b, "relu")


# Each kernel through its launcher, whatever dispatch would pick for the shape. The TMA kernel needs
# 16-byte aligned rows (N, K multiples of 8 for 16-bit types); the interpreter runs descriptors too.
LAUNCH_CASES = [
    (tiled, 3, 100, 130, torch.float16),
    (tiled, 70, 33, 17, torch.bfloat16),
    (small_m, 1, 130, 100, torch.float16),
    (small_m, 70, 33, 130, torch.float32),  # M past one 64-row program column: two along M
    (tma_persistent, 70, 40, 136, torch.float16),
    (tma_persistent, 130, 104, 24, torch.bfloat16),
    (tma_persistent, 1, 8, 8, torch.float16),
    (split_k, 70, 40, 136, torch.float16),  # three splits of 64, 64 and 8 K
    (split_k, 33, 100, 130, torch.bfloat16),
    (split_k, 5, 17, 200, torch.float32),
]


@pytest.mark.parametrize("module,M,N,K,dtype", LAUNCH_CASES, ids=lambda v: getattr(v, "NAME", None))
def test_each_kernel_matches_reference(module, M, N, K, dtype):
    x, w, b = make(M, N, K, dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)  # unwritten elements stay NaN
    if module is tma_persistent:
        assert tma_compatible(x, w, out), "test shape must meet TMA alignment"
    config = module.INTERPRET_CONFIG if DEVICE == "cpu" else module.candidates(M, N, K, dtype)[0]
    module.launch(x, w, b, "relu", out, config, input_precision="ieee",
                  upcast_bf16=DEVICE == "cpu" and dtype == torch.bfloat16)
    assert_matches(out, x, w, b, "relu")


@pytest.mark.parametrize("M, N, K, dtype", [(70, 40, 136, torch.float16), (33, 104, 200, torch.bfloat16)])
def test_split_k_through_tma_matches_reference(M, N, K, dtype):
    # 136 = three splits of 64, 64 and 8 K: TMA zero-fills the last split past K.
    x, w, b = make(M, N, K, dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    assert tma_compatible(x, w, out), "test shape must meet TMA alignment"
    if DEVICE == "cpu":
        config = dict(split_k.INTERPRET_CONFIG, TMA=True)
    else:
        config = split_k.candidates(M, N, K, dtype, tma=True)[0]
    split_k.launch(x, w, b, "relu", out, config, input_precision="ieee",
                   upcast_bf16=DEVICE == "cpu" and dtype == torch.bfloat16)
    assert_matches(out, x, w, b, "relu")


@pytest.mark.parametrize("split_store", [False, True])
def test_tma_kernel_stores_whole_or_half_tiles(split_store):
    x, w, b = make(17, 72, 40, torch.float16)  # 72 columns: the last 32-wide tile is cut by TMA
    out = torch.full((17, 72), float("nan"), dtype=torch.float16, device=DEVICE)
    config = dict(tma_persistent.INTERPRET_CONFIG, SPLIT_STORE=split_store)
    if DEVICE != "cpu":
        config = dict(tma_persistent.CONFIGS[0], SPLIT_STORE=split_store)
    tma_persistent.launch(x, w, b, "relu", out, config, input_precision="ieee", upcast_bf16=False)
    assert_matches(out, x, w, b, "relu")


def _pdl():
    """The launch options fused_linear would use here: programmatic dependent launch on sm_90+."""
    return dict(pdl=DEVICE != "cpu" and torch.cuda.get_device_capability()[0] >= 9)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_small_m_split_k_with_empty_splits(split_k, prefetch):
    # K=40 in 32-wide steps is 2 steps: with SPLIT_K 3 or 8 some programs get no K at all (the
    # prefetched first step of such a program is masked off too).
    x, w, b = make(5, 33, 40, torch.float32)
    config = dict(small_m.INTERPRET_CONFIG, SPLIT_K=split_k)
    for _ in range(2):  # the second launch finds the tile counters the first one left
        out = torch.full((5, 33), float("nan"), dtype=torch.float32, device=DEVICE)
        small_m.launch(x, w, b, "silu", out, config, input_precision="ieee", upcast_bf16=False,
                       prefetch_weight=prefetch, **_pdl())
        assert_matches(out, x, w, b, "silu")
    if split_k > 1:  # the last split of each tile resets its counter for the next launch
        assert int(small_m.tile_counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("M,N,K,dtype,split_k,activation", [
    (1, 33, 130, torch.bfloat16, 1, "relu"),  # one row: the elementwise accumulator
    (1, 17, 100, torch.float32, 3, "none"),  # ... with split-K, some splits empty
    (3, 70, 130, torch.float16, 2, "gelu"),  # a few rows: one reduction per row
    (16, 17, 70, torch.float32, 1, "silu"),  # the most rows the GEMV variant takes
])
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_small_m_gemv_variant(M, N, K, dtype, split_k, activation, prefetch):
    x, w, b = make(M, N, K, dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    config = dict(small_m.INTERPRET_GEMV_CONFIG, SPLIT_K=split_k)
    if DEVICE != "cpu":
        config = next(c for c in small_m.candidates(1, 4096, 4096, dtype) if c.get("GEMV")) | dict(SPLIT_K=split_k)
    small_m.launch(x, w, b, activation, out, config, input_precision="ieee", upcast_bf16=False,
                   prefetch_weight=prefetch, **_pdl())
    assert_matches(out, x, w, b, activation)


@pytest.mark.parametrize("K, split_k", [(130, 1), (1000, 2), (129, 1)])  # 129: odd K, no pairs
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_gemv_reads_bf16_weights_as_pairs(K, split_k, prefetch):
    x, w, b = make(1, 33, K, torch.bfloat16)
    assert small_m.pairs_ok(w) == (K % 2 == 0)
    config = dict(small_m.INTERPRET_GEMV_CONFIG, SPLIT_K=split_k, PAIRS=True)
    if DEVICE != "cpu":
        config = next(c for c in small_m.candidates(1, 4096, 4096, torch.bfloat16) if c.get("PAIRS"))
        config = dict(config, SPLIT_K=split_k)
    out = torch.full((1, 33), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    small_m.launch(x, w, b, "relu", out, config, input_precision="ieee", upcast_bf16=False,
                   prefetch_weight=prefetch, **_pdl())
    assert_matches(out, x, w, b, "relu")


def test_small_m_gemv_refuses_too_many_rows():
    x, w, b = make(small_m.GEMV_MAX_M + 1, 8, 8, torch.float32)
    out = torch.empty((x.shape[0], 8), device=DEVICE)
    with pytest.raises(ValueError, match="GEMV variant takes at most"):
        small_m.launch(x, w, b, "relu", out, small_m.INTERPRET_GEMV_CONFIG, input_precision="ieee",
                       upcast_bf16=False)


@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 9, 16, 17, 64, 100, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_m_tunes_at_most_twelve_configs_with_gemv_for_few_rows(M, dtype):
    # Start-up tunes every batch bucket of every layer: the candidate count bounds that time.
    for N, K in ((4096, 4096), (100, 130), (11008, 4096)):
        configs = small_m.candidates(M, N, K, dtype)
        assert 1 <= len(configs) <= 12, f"M={M} N={N} K={K} {dtype}: {len(configs)} configs"
        gemv = [c for c in configs if c.get("GEMV")]
        assert bool(gemv) == (M <= (16 if dtype == torch.float32 else 8)), f"M={M} {dtype}: {configs}"


def _programs(M, N, cfg):
    columns = 1 if cfg.get("GEMV") else -(-M // small_m.block_m(M))  # GEMV covers all rows at once
    return -(-N // cfg["BLOCK_N"]) * columns * cfg["SPLIT_K"]


def test_small_m_candidates_fill_the_gpu():
    for M, N, K in ((1, 4096, 4096), (16, 1024, 1024), (3, 11008, 4096), (1, 8, 8), (512, 4096, 4096)):
        for cfg in small_m.candidates(M, N, K, torch.bfloat16) + small_m.candidates(M, N, K, torch.float32):
            assert cfg["SPLIT_K"] >= 1
            programs = _programs(M, N, cfg)
            # Split-K is only there to fill the GPU: never past ~4 programs per SM of an H200.
            assert cfg["SPLIT_K"] == 1 or programs <= 4 * 132, f"{(M, N, K)} {cfg}: {programs} programs"
        if N * K >= 4096 * 4096:  # big layers: some config gives at least ~2 programs per SM
            most = max(_programs(M, N, c) for c in small_m.candidates(M, N, K, torch.bfloat16))
            assert most >= 2 * 132, f"{(M, N, K)}: at most {most} programs"


@pytest.mark.parametrize("name,M,N,K,dtype", [
    ("triton_small_m", 70, 40, 17, torch.float32),  # a "small-M" kernel past its usual range
    ("triton_tiled", 3, 100, 130, torch.float16),
    ("triton_tma_persistent", 17, 40, 136, torch.float16),
])
def test_run_kernel_forces_a_kernel(name, M, N, K, dtype):
    x, w, b = make(M, N, K, dtype)
    assert_matches(run_kernel(name, x, w, b, "gelu"), x, w, b, "gelu")


@pytest.mark.parametrize("name,M,N,K,dtype,match", [
    ("triton_tma_persistent", 17, 40, 136, torch.float32, "name 'triton_tma_persistent' cannot run .* fp16/bf16"),
    ("triton_tma_persistent", 17, 40, 130, torch.float16, "16-byte aligned"),
    ("no_such_kernel", 3, 5, 8, torch.float32, "name must be one of"),
] + ([("gluon_wgmma", 3, 8, 8, torch.float16, "Gluon kernels need a Hopper GPU")] if DEVICE == "cpu" else []))
def test_run_kernel_refuses_what_the_kernel_cannot_run(name, M, N, K, dtype, match):
    x, w, b = make(M, N, K, dtype)
    with pytest.raises(ValueError, match=match):
        run_kernel(name, x, w, b)


def test_kernels_lists_every_dispatch_target():
    assert set(KERNELS) == {"triton_small_m", "triton_tiled", "triton_tma_persistent", "triton_split_k",
                            "triton_stream_k", "gluon_wgmma", "gluon_small_m", "gluon_stream_k", "gluon_ws",
                            "torch_cublas"}


@pytest.mark.skipif(DEVICE != "cpu", reason="drives the GPU tuning path on the interpreter")
def test_tuning_times_every_candidate_once_and_caches_the_winner(monkeypatch, tmp_path):
    # The GPU path of kernels.choosing, run on the interpreter: the timer is replaced (it needs
    # CUDA) by one that launches every option, checks its result, and crowns the last option.
    from fusedserve.kernels import choosing, tune_cache

    monkeypatch.setattr(choosing, "interpreting", lambda: False)
    monkeypatch.setattr(choosing, "cuda_name", lambda device: f"fake-gpu-{tmp_path.name}")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(tune_cache.ENV_VAR, str(tmp_path))
    timed = []

    def fake_time_configs(options, run, timer=None):
        for option in options:
            y = run(option)  # at the bucket's largest batch: x's 70 rows, then its first 58 again
            assert y.shape[0] == 128, y.shape
            assert_matches(y[:70], x, w, b, "relu")
            assert_matches(y[70:], x[:58], w, b, "relu")
            timed.append(option)
        return [], options[-1]

    monkeypatch.setattr(choosing, "time_configs", fake_time_configs)
    x, w, b = make(70, 40, 136, torch.float16)  # mid-size M: tiled and weight-streaming compete
    with provisional.choosing_mode("tune"):  # every candidate (a direct first call times a short list)
        assert_matches(fused_linear(x, w, b), x, w, b, "relu")
    kernels_timed = {name for name, _ in timed}
    assert kernels_timed == {"triton_tiled", "triton_small_m"}, kernels_timed
    assert len(timed) == len(tiled.CONFIGS) + len(small_m.candidates(128, 40, 136, torch.float16))
    # Same bucket (M=100 rounds to 128 like 70): the stored winner is reused, nothing is timed.
    timed.clear()
    x, w, b = make(100, 40, 136, torch.float16, seed=1)
    assert_matches(fused_linear(x, w, b), x, w, b, "relu")
    assert timed == []
    stored = list(json.loads(next(tmp_path.glob("fake-gpu-*.json")).read_text()).values())
    assert stored == [{"kernel": "triton_small_m", "config": small_m.candidates(128, 40, 136, torch.float16)[-1]}]


def test_row_strided_view_of_x():
    # Columns 3..3+K of a wider tensor: stride(0) = 150, stride(1) = 1, used in place.
    base = torch.randn(17, 150).to(DEVICE)
    x = base[:, 3:103]
    _, w, b = make(17, 33, 100, torch.float32)
    assert_matches(fused_linear(x, w, b, "relu"), x, w, b, "relu")


def test_transposed_x_and_weight():
    # Column strides != 1: copied to a unit column stride first.
    x = torch.randn(100, 17).to(DEVICE).T
    w = torch.randn(100, 33).to(DEVICE).T / 10
    assert x.stride(1) != 1 and w.stride(1) != 1
    assert_matches(fused_linear(x, w, None, "none"), x, w, None, "none")


def test_three_dim_x():
    x = torch.randn(2, 3, 33).to(torch.float16).to(DEVICE)
    _, w, b = make(1, 17, 33, torch.float16)
    out = fused_linear(x, w, b, "relu")
    assert out.shape == (2, 3, 17)
    assert_matches(out.reshape(6, 17), x.reshape(6, 33), w, b, "relu")


def test_one_dim_x_is_one_row():
    x, w, b = make(1, 5, 33, torch.float32)
    out = fused_linear(x[0], w, b, "none")
    assert out.shape == (5,)
    assert_matches(out[None], x, w, b, "none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_dtype_is_x_dtype(dtype):
    x, w, b = make(3, 5, 17, dtype)
    assert fused_linear(x, w, b, "relu").dtype == dtype


def test_zero_rows_give_empty_output():
    x = torch.empty(0, 33).to(DEVICE)
    _, w, b = make(1, 17, 33, torch.float32)
    out = fused_linear(x, w, b)
    assert out.shape == (0, 17) and out.dtype == torch.float32


def test_zero_k_is_act_of_bias():
    x = torch.empty(3, 0).to(DEVICE)
    w = torch.empty(5, 0).to(DEVICE)
    b = torch.tensor([-1.0, 0.0, 1.0, 2.0, -3.0]).to(DEVICE)
    assert fused_linear(x, w, b).cpu().tolist() == [[0.0, 0.0, 1.0, 2.0, 0.0]] * 3


def _good(dtype=torch.float32):
    return make(3, 5, 17, dtype)


@pytest.mark.parametrize("call,exc,match", [
    (lambda x, w, b: fused_linear(x.tolist(), w, b), TypeError, "x"),
    (lambda x, w, b: fused_linear(x, w.numpy(force=True), b), TypeError, "weight"),
    (lambda x, w, b: fused_linear(x, w, [0.0] * 5), TypeError, "bias"),
    (lambda x, w, b: fused_linear(x[0, 0], w, b), ValueError, "x"),
    (lambda x, w, b: fused_linear(x, w[0], b), ValueError, "weight"),
    (lambda x, w, b: fused_linear(x[:, :16], w, b), ValueError, "x's last dim"),
    (lambda x, w, b: fused_linear(x, w, b[:4]), ValueError, "bias"),
    (lambda x, w, b: fused_linear(x, w, b[None]), ValueError, "bias"),
    (lambda x, w, b: fused_linear(x.double(), w.double(), b.double()), TypeError, "x dtype"),
    (lambda x, w, b: fused_linear(x.int(), w.int(), b.int()), TypeError, "x dtype"),
    (lambda x, w, b: fused_linear(x, w.half(), b), TypeError, "weight dtype"),
    (lambda x, w, b: fused_linear(x, w, b.half()), TypeError, "bias dtype"),
    (lambda x, w, b: fused_linear(x, w, b, "softplus"), ValueError, "activation.*relu"),
    (lambda x, w, b: fused_linear(x, w, b, None), ValueError, "activation"),
    (lambda x, w, b: fused_linear(x, w.to("meta"), b), ValueError, "weight is on"),
    (lambda x, w, b: fused_linear(x, w, b.to("meta")), ValueError, "bias is on"),
])
def test_bad_arguments(call, exc, match):
    x, w, b = _good()
    with pytest.raises(exc, match=match):
        call(x, w, b)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter switch only matters for CPU tensors")
def test_cpu_tensor_without_interpreter_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b = _good()
    with pytest.raises(ValueError, match="x is a CPU tensor.*TRITON_INTERPRET=1"):
        fused_linear(x, w, b)


def test_kernel_choice_names_the_kernel_that_runs():
    # On a GPU a bucket tuned by another test may have gone to any candidate, the vendor's GEMM too.
    name, config = kernel_choice(3, 100, 130, torch.float16, DEVICE)
    assert name == "triton_small_m" if DEVICE == "cpu" else name in ("triton_small_m", "torch_cublas")
    assert isinstance(config, str)
    name, _ = kernel_choice(130, 100, 130, torch.float32, DEVICE)
    assert name == "triton_tiled" if DEVICE == "cpu" else name in ("triton_tiled", "triton_small_m", "torch_cublas")
    if DEVICE == "cpu":
        # The interpreter always runs one fixed config, so it is known before any call.
        assert kernel_choice(3, 5, 17, torch.float32, "cpu")[1].startswith("BLOCK_N=")


def test_tune_runs_each_shape_and_reports(capsys):
    chosen = kernels.tune([(3, 17, 33), (70, 5, 17)], dtype=torch.float32, device=DEVICE)
    # On a GPU the vendor's GEMM competes for both (and may win such tiny layers).
    vendor = () if DEVICE == "cpu" else ("torch_cublas",)
    assert chosen[(3, 17, 33)][0] in ("triton_small_m", *vendor)
    tiled = ("triton_tiled",) if DEVICE == "cpu" else ("triton_tiled", "triton_small_m")
    assert chosen[(70, 5, 17)][0] in tiled + vendor
    err = capsys.readouterr().err
    assert f"[tune 1/2] M=3 N=17 K=33 float32: {chosen[(3, 17, 33)][0]}" in err and "[tune 2/2]" in err


@pytest.mark.slow
@pytest.mark.timeout(660)  # the compile run's own limit is 600 s; ~30 s on an idle machine
def test_every_config_compiles_for_hopper():
    # The interpreter never runs Triton's compiler; this compiles every tuning candidate for sm_90
    # from mock tensors (no GPU needed), in a fresh process without TRITON_INTERPRET. ~30 s here.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(kernels.__file__).parents[1]), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tools.sm90_triton"], env=env, capture_output=True,
                            text=True, timeout=600)
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.returncode == 0 and not failed, "\n".join(failed) or result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("0 failed")


def test_tune_rejects_bad_shapes():
    with pytest.raises(ValueError, match="shapes"):
        kernels.tune([(3, 17)], device=DEVICE)
    with pytest.raises(ValueError, match="shapes"):
        kernels.tune([(0, 17, 5)], device=DEVICE)


@pytest.mark.parametrize("static_weight", [False, True])
def test_static_weight_reaches_the_launch_as_a_weight_prefetch(monkeypatch, static_weight):
    # Where programmatic dependent launch is supported (sm_90+), every Triton kernel is launched
    # with it, and static_weight=True lets the weight-streaming kernel read W before its wait.
    # Faked here so the wiring is checked on any machine; the launch itself runs as usual.
    import dataclasses

    from fusedserve.kernels import choosing, registry

    seen = []
    real = registry.family("triton_small_m")

    def spy(*args, pdl, prefetch_weight, **kw):
        seen.append((pdl, prefetch_weight))
        return real.launch(*args, pdl=False, prefetch_weight=prefetch_weight, **kw)

    spied = tuple(dataclasses.replace(f, launch=spy) if f is real else f for f in registry.families())
    monkeypatch.setattr(registry, "families", lambda: spied)
    monkeypatch.setattr(choosing, "pdl_supported", lambda device: True)
    x, w, b = make(3, 17, 33, torch.float32)
    assert_matches(fused_linear(x, w, b, "relu", static_weight=static_weight), x, w, b, "relu")
    assert seen and all(s == (True, static_weight) for s in seen), seen


def test_fp32_dot_precision_follows_torch_and_the_environment(monkeypatch):
    from fusedserve.kernels.precision import FP32_PRECISION_ENV, dot_precision
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the interpreter always says "ieee")
    monkeypatch.delenv(FP32_PRECISION_ENV, raising=False)
    matmul, old = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert dot_precision(torch.float32) == "tf32x3"  # the default: as accurate as SGEMM, tensor cores
        monkeypatch.setenv(FP32_PRECISION_ENV, "ieee")
        assert dot_precision(torch.float32) == "ieee"
        assert dot_precision(torch.bfloat16) == "tf32"  # (16-bit dots ignore it)
        matmul.allow_tf32 = True
        assert dot_precision(torch.float32) == "tf32"  # torch allows TF32: so do we, whatever is set
        matmul.allow_tf32 = False
        monkeypatch.setenv(FP32_PRECISION_ENV, "tf32")  # plain TF32 only through torch's own flag
        with pytest.raises(ValueError, match=f"{FP32_PRECISION_ENV} must be one of"):
            dot_precision(torch.float32)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv(FP32_PRECISION_ENV, "tf32x3")
        assert dot_precision(torch.float32) == "ieee"
    finally:
        matmul.allow_tf32 = old


def test_run_kernel_on_a_shape_its_family_has_no_config_for_says_so(monkeypatch):
    import dataclasses

    from fusedserve.kernels import registry

    empty = tuple(dataclasses.replace(f, candidates=lambda p: []) if f.name == "triton_tiled" else f
                  for f in registry.families())
    monkeypatch.setattr(registry, "families", lambda: empty)
    x, w, b = make(3, 100, 130, torch.float16)
    with pytest.raises(ValueError, match="name 'triton_tiled' has no config for M=3"):
        run_kernel("triton_tiled", x, w, b)
