"""The vendor's GEMM as a kernel family (``kernels/vendor/cublas.py``): torch's cuBLAS/cuBLASLt path,
timed against our kernels. Without a GPU its torch ops run for real on CPU tensors; the tuner's
choice (a fake timer), the tune cache and the provisional rule are checked on problems that name a
GPU. On a GPU (marked): numerics, CUDA-graph capture, and the tuner's choice where ours lose."""

import json

import pytest
import torch
import torch.nn.functional as F

from fusedserve.kernels import ACTIVATIONS, choosing, provisional, registry, run_kernel, timers, tune_cache
from fusedserve.kernels.choosing import Choice
from fusedserve.kernels.precision import dot_precision
from fusedserve.kernels.rules import Problem, problem_of
from fusedserve.kernels.vendor import cublas

from .conftest import check_against_float64, check_layers_in_cuda_graph, make

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
VENDOR = cublas.NAME
OPS = [dict(c) for c in cublas.CANDIDATES]
AMPERE, HOPPER = (8, 0), (9, 0)


def reference(x, w, b, activation):
    """``(act(x @ w^T + b), x @ w^T + b)`` in float64."""
    pre = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    return ACTIVATIONS[activation](pre), pre


# One unit in the last place of each dtype, relative.
_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_close(out, x, w, b, activation, where):
    """Elementwise ``|out - ref| <= 1.2 (ulp |pre| + 2 K 2^-23 (|x| @ |w|^T + |b|)) + ulp |ref|``.

    torch's GEMMs accumulate in fp32 (16-bit inputs on the CPU too: seen within 0.1 2^-23 of
    sum |x||w| past rounding), bounded by fp32's K-term; the pre-activation is rounded to the dtype
    (half an ulp; a whole one for margin), the activation (slope at most 1.13, gelu's) is applied to
    that, and its result is rounded once more."""
    ref, pre = reference(x, w, b, activation)
    assert out.shape == ref.shape and out.dtype == x.dtype, (out.shape, out.dtype)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0.0)
    ulp, K = _ULP[x.dtype], x.shape[-1]
    tol = 1.2 * (ulp * pre.abs() + 2 * K * 2.0**-23 * magnitude) + ulp * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    bad = ~(err <= tol)  # NaN counts as bad
    if bad.any():
        i, j = (int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{where}: {int(bad.sum())} outputs off, first at [{i}, {j}]: got {out[i, j].item()}, "
                             f"want {ref[i, j].item()} (tol {tol[i, j].item():.3g})")


def launch(x, w, b, activation, config, precision="ieee"):
    """The family's launch into a NaN-poisoned ``out`` (every element must be written)."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    got = cublas.launch(x, w, b, activation, out, config, input_precision=precision, upcast_bf16=False, pdl=False,
                        prefetch_weight=False)
    assert got is out, "the result is written into the launcher's out"
    return out


SHAPES = [(1, 3, 17), (3, 70, 100), (17, 130, 70), (100, 17, 130), (130, 100, 3)]


@pytest.mark.skipif(ON_GPU, reason="torch's CPU ops; the GPU checks its own below")
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_every_activation_and_op_matches_float64_on_the_cpu(M, N, K, dtype, activation):
    x, w, b = make(M, N, K, dtype, seed=M + N, device="cpu")
    for config in OPS:
        assert_close(launch(x, w, b, activation, config), x, w, b, activation, f"{config} {activation} {dtype}")


@pytest.mark.skipif(ON_GPU, reason="torch's CPU ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_no_bias(dtype, activation):
    x, w, _ = make(17, 70, 130, dtype, device="cpu")
    for config in OPS:
        assert_close(launch(x, w, None, activation, config), x, w, None, activation, f"{config} {activation}")


@pytest.mark.skipif(ON_GPU, reason="torch's CPU ops")
def test_run_kernel_forces_it_with_3d_and_1d_inputs():
    x, w, b = make(6, 17, 70, torch.float16, device="cpu")
    out = run_kernel(VENDOR, x.reshape(2, 3, 70), w, b, "silu")
    assert out.shape == (2, 3, 17)
    assert_close(out.reshape(6, 17), x, w, b, "silu", "3-D x")
    assert_close(run_kernel(VENDOR, x[0], w, None, "relu")[None], x[:1], w, None, "relu", "1-D x")


@pytest.mark.skipif(ON_GPU, reason="the CPU's own GELU")
def test_gelu_is_the_tanh_form_on_the_cpu_too():
    # torch's CPU _addmm_activation computes the exact erf GELU (0.47e-3 from ours at most, near
    # -2.7), so there the family runs the table's tanh form after the GEMM instead.
    x, w, b = make(48, 256, 128, torch.float32, device="cpu")
    w = w * 3  # pre-activations over +-10: where the two forms differ most
    ref, pre = reference(x, w, b, "gelu")
    assert (F.gelu(pre) - ref).abs().max() > 1e-4, "inputs where erf and tanh forms can be told apart"
    for config in OPS:
        assert (launch(x, w, b, "gelu", config).double() - ref).abs().max() < 1e-5, config


def test_describe_reads_as_kernel_stats_show_it():
    assert Choice(VENDOR, {"op": "addmm_act"}, True).describe() == \
        "op=addmm_act (cuBLASLt, bias and relu/gelu in its epilogue)"
    assert Choice(VENDOR, {"op": "linear"}, True).describe() == "op=linear (cuBLASLt addmm, then the activation)"
    assert Choice(VENDOR, None, False).describe() == ""


def test_an_unknown_op_is_refused():
    x, w, b = make(3, 5, 17, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="config op must be one of"):
        launch(x, w, b, "relu", {"op": "cutlass"})


@pytest.fixture
def tf32():
    """Sets ``torch.backends.cuda.matmul.allow_tf32`` for one test and puts it back after (torch's
    flag object has no attributes monkeypatch could restore)."""
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_tf32

    def set_to(allowed):
        matmul.allow_tf32 = allowed
    try:
        yield set_to
    finally:
        matmul.allow_tf32 = old


@pytest.mark.parametrize("env", ["tf32x3", "ieee"])
def test_our_fp32_precision_setting_leaves_torchs_flag_alone(tf32, monkeypatch, env):
    # The vendor path follows torch's allow_tf32 by itself; FUSEDSERVE_FP32_PRECISION only picks how
    # our own kernels reach fp32 accuracy, and reading it must not change what torch does.
    monkeypatch.setenv("FUSEDSERVE_FP32_PRECISION", env)
    tf32(False)
    before = torch.get_float32_matmul_precision()
    x, w, b = make(3, 5, 17, torch.float32, device=DEVICE)
    for precision in ("ieee", "tf32x3", dot_precision(torch.float32)):
        launch(x, w, b, "relu", OPS[0], precision)
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize("M", [9, 32, 449, 2503, 8192])
@pytest.mark.parametrize("K", [1001, 1002, 6375])
@pytest.mark.parametrize("allow_tf32", [False, True])
@pytest.mark.parametrize("capability", [AMPERE, HOPPER])
def test_float32_rows_off_sixteen_bytes_start_on_the_library(tf32, M, K, allow_tf32, capability):
    # Rule: our fp32 kernels read such rows 4 bytes at a time; where they did (then for K off a
    # multiple of 16) they ran at 0.05-0.48x the library's speed at every measured shape past 8
    # rows (H100), so before tuning such layers run the library, whatever the shipped table says.
    tf32(allow_tf32)
    problem = Problem(M, 2048, K, torch.float32, capability, K % 4 == 0)
    choice = provisional.provisional_choice(problem, registry.offered(problem), provisional.table("NVIDIA H200"))
    assert choice == (VENDOR, OPS[0], "rules")


@pytest.mark.parametrize("M", [65, 449, 2503])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_sixteen_bit_past_64_rows_starts_on_the_library(M, dtype, gpu):
    # Rule: tuned, the library kept most such shapes and trailed the winner by little elsewhere,
    # while the table's nearest shape named a family up to 2.4x slower there (H100).
    problem = Problem(M, 2048, 6376, dtype, HOPPER, True)
    kernel, config, source = provisional.provisional_choice(problem, registry.offered(problem), provisional.table(gpu))
    assert (kernel, source) == (VENDOR, "rules") and config in OPS


@pytest.mark.parametrize("M, N, K", [(122, 1000, 1184), (173, 1512, 384), (256, 880, 304)])
def test_small_layers_at_65_to_256_rows_start_on_the_tables_family(M, N, K):
    # Rule: held out of the table, small layers at up to 256 rows ran the library at up to 1.63x the
    # tuned time, where the Gluon weight-streaming kernel won most (tools/provisional_check.py).
    problem = Problem(M, N, K, torch.float16, HOPPER, True)
    kernel, _, source = provisional.provisional_choice(problem, registry.offered(problem),
                                                       provisional.table("NVIDIA H100 80GB HBM3"))
    assert (kernel != VENDOR, source) == (True, "table")


@pytest.mark.parametrize("M, N, K", [(257, 1000, 1184), (483, 1752, 824), (1410, 560, 1600), (2316, 2368, 848)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_layers_past_256_rows_start_on_the_library(M, N, K, dtype):
    # Rule: past the Gluon kernel's rows the table's nearest family (a TMA tiled kernel) ran 1.13-2.38x
    # the tuned time on 10 H100 shapes the library won; the library's worst start was 1.16x
    # (tools/provisional_check.py over kernels.jsonl:30-49).
    problem = Problem(M, N, K, dtype, HOPPER, True)
    kernel, _, source = provisional.provisional_choice(problem, registry.offered(problem),
                                                       provisional.table("NVIDIA H100 80GB HBM3"))
    assert (kernel, source) == (VENDOR, "rules")


@pytest.mark.parametrize("M, N, K", [(2, 288, 12320), (45, 352, 15520), (64, 512, 8192)])
@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_a_few_w_tiles_over_a_long_k_start_on_the_library(M, N, K, gpu):
    # Rule: tuned, the library won all 3 such H100 shapes, up to 1.65x faster than the Gluon kernel
    # the table's nearest shape named (kernels.jsonl:37, M=45 N=352 K=15520).
    problem = Problem(M, N, K, torch.float16, HOPPER, True)
    kernel, _, source = provisional.provisional_choice(problem, registry.offered(problem), provisional.table(gpu))
    assert (kernel, source) == (VENDOR, "rules")


@pytest.mark.parametrize("M, N, K", [(1, 352, 15520), (45, 576, 15520), (45, 352, 8184)])
def test_one_row_more_tiles_or_a_shorter_k_are_not_claimed(M, N, K):
    assert not registry.family(VENDOR).provisional_first(Problem(M, N, K, torch.float16, HOPPER, True))


@pytest.mark.parametrize("M, K, dtype, capability", [
    (1024, 4096, torch.float32, HOPPER),  # K a multiple of 16: our 3xTF32 beat SGEMM 1.5-1.9x
    (1164, 10344, torch.float32, HOPPER),  # K a multiple of 8: split-K beat SGEMM 2.27x (kernels.jsonl:35)
    (235, 1004, torch.float32, AMPERE),  # 16-byte rows: read 16 bytes at a time
    (700, 2944, torch.float32, AMPERE),
    (8, 6376, torch.float32, HOPPER),  # a few rows: our GEMV kept up
    (1, 1001, torch.float32, AMPERE),
    (64, 6376, torch.bfloat16, HOPPER),  # 16-bit up to 64 rows: left to the table and to tuning
    (1024, 1004, torch.float32, None),  # the interpreter: nothing to time against
])
def test_other_problems_keep_our_provisional_choice(tf32, M, K, dtype, capability):
    tf32(False)
    problem = Problem(M, 2048, K, dtype, capability, K % 8 == 0)
    kernel, _, _ = provisional.provisional_choice(problem, registry.offered(problem), provisional.table("NVIDIA H200"))
    assert kernel != VENDOR


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """``choose`` and ``fused_linear`` as on an sm_80 GPU with an empty tune cache, on CPU tensors."""
    from fusedserve.kernels import rules

    monkeypatch.setattr(choosing, "interpreting", lambda: False)
    monkeypatch.setattr(choosing, "cuda_name", lambda device: "Fake GPU")
    monkeypatch.setattr(rules, "capability", lambda device: AMPERE)
    cache = tune_cache.TuneCache("Fake GPU", directory=tmp_path)
    monkeypatch.setattr(choosing, "device_cache", lambda name: cache)
    monkeypatch.setattr(choosing, "_provisional", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return cache


def rows_timed(monkeypatch) -> list[int]:
    """The rows of each timing pass the tuner makes (one per set of rotating arguments), in order."""
    timed_rows, real_sets = [], choosing.rotating_sets
    monkeypatch.setattr(choosing, "rotating_sets", lambda x, w, b: timed_rows.append(x.shape[0]) or real_sets(x, w, b))
    return timed_rows


def timer_by_family(monkeypatch, ms, launched):
    """Replace the tuner's timer: a candidate's samples are ``ms[(family, op)]`` or ``ms[family]``.
    Only the library's launches run (torch on the CPU; ours would be slow in the interpreter), and
    their results go to ``launched``."""
    def timer(run):
        name, config = timers.timing_candidate.get()
        if name == VENDOR:
            launched.append(run())
        value = ms.get((name, config.get("op")), ms.get(name))
        return lambda repeats: [value] * repeats
    monkeypatch.setattr(choosing, "default_timer", lambda calls_hint=1: timer)


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_the_tuner_picks_the_library_where_it_is_faster_and_the_cache_keeps_it(fake_gpu, monkeypatch, tmp_path):
    launched = []
    timer_by_family(monkeypatch, {"triton_tiled": 2.0, "triton_small_m": 1.5, (VENDOR, "addmm_act"): 1.2,
                                  (VENDOR, "linear"): 1.0}, launched)
    x, w, b = make(70, 40, 136, torch.float16, device="cpu")
    problem = problem_of(x, w)
    assert [f.name for f in registry.offered(problem)] == ["triton_tiled", "triton_small_m", VENDOR]
    with provisional.choosing_mode("tune"):
        choice = choosing.choose(problem, x, w, b, "relu")
    assert (choice.kernel, choice.config, choice.tuned) == (VENDOR, {"op": "linear"}, True)
    assert len(launched) == 2 * 2 * 2, "each op in the first round and as a finalist, at 128 rows then at 70"
    for y in launched[:4]:  # at the bucket's 128 rows: x's 70, then its first 58 again
        assert_close(y, torch.cat([x, x[:58]]), w, b, "relu", "timed launch")
    for y in launched[4:]:  # again at the call's own rows
        assert_close(y, x, w, b, "relu", "timed launch")
    # Round trip: the file holds it, a new process's cache reads it, and launches run it.
    assert list(json.loads(fake_gpu.path.read_text()).values()) == [{"kernel": VENDOR, "config": {"op": "linear"}}]
    monkeypatch.setattr(choosing, "device_cache", lambda name: tune_cache.TuneCache("Fake GPU", directory=tmp_path))
    assert choosing.cached(problem, "cuda") == choice
    assert_close(choosing.launch(choice, x, w, b, "relu"), x, w, b, "relu", "cached choice")


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_the_tuner_keeps_ours_where_ours_is_faster(fake_gpu, monkeypatch):
    launched = []
    timer_by_family(monkeypatch, {"triton_tiled": 2.0, "triton_small_m": 0.9, VENDOR: 1.0}, launched)
    x, w, b = make(70, 40, 136, torch.float16, device="cpu")
    with provisional.choosing_mode("tune"):
        choice = choosing.choose(problem_of(x, w), x, w, b, "relu")
    assert choice.kernel == "triton_small_m" and choice.tuned and launched


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
@pytest.mark.parametrize("rows, at_own_rows, kept", [
    (70, {"triton_small_m": 1.1, VENDOR: 1.0}, VENDOR),  # ours won at the bucket's 128 rows only
    (70, {"triton_small_m": 0.95, VENDOR: 1.0}, "triton_small_m"),
    (128, None, "triton_small_m"),  # a runner's padded batch: timed once
])
def test_a_direct_call_keeps_ours_only_where_it_beats_the_library_at_its_own_rows(
        fake_gpu, monkeypatch, rows, at_own_rows, kept):
    timed_rows = rows_timed(monkeypatch)
    ms = {128: {"triton_tiled": 2.0, "triton_small_m": 0.9, VENDOR: 1.0}, 70: at_own_rows}

    def timer(run):
        name, _ = timers.timing_candidate.get()
        return lambda repeats: [ms[timed_rows[-1]][name]] * repeats
    monkeypatch.setattr(choosing, "default_timer", lambda calls_hint=1: timer)
    x, w, b = make(rows, 40, 136, torch.float16, device="cpu")
    with provisional.choosing_mode("tune"):
        choice = choosing.choose(problem_of(x, w), x, w, b, "relu")
    assert choice.kernel == kept and timed_rows == ([128, 70] if rows == 70 else [128])


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_a_first_call_times_its_short_list_once_at_its_own_rows(fake_gpu, monkeypatch):
    # Outside any tuning a first call answers quickly: one timing pass, at the rows it runs.
    timed_rows = rows_timed(monkeypatch)
    ms = {70: {"triton_tiled": 2.0, "triton_small_m": 0.9, VENDOR: 1.0}}

    def timer(run):
        name, _ = timers.timing_candidate.get()
        return lambda repeats: [ms[timed_rows[-1]][name]] * repeats
    monkeypatch.setattr(choosing, "default_timer", lambda calls_hint=1: timer)
    x, w, b = make(70, 40, 136, torch.float16, device="cpu")
    choice = choosing.choose(problem_of(x, w), x, w, b, "relu")
    assert (choice.source, timed_rows) == ("quick", [70])


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_a_direct_call_takes_the_librarys_faster_op_at_its_own_rows(fake_gpu, monkeypatch):
    # cuBLAS picks its algorithm per M: the op that wins at the bucket's rows may lose at the call's.
    timed_rows = rows_timed(monkeypatch)
    ms = {128: {"triton_tiled": 2.0, "triton_small_m": 1.5, "linear": 1.0, "addmm_act": 1.1},
          70: {"triton_small_m": 1.5, "linear": 1.2, "addmm_act": 1.0}}

    def timer(run):
        name, config = timers.timing_candidate.get()
        return lambda repeats: [ms[timed_rows[-1]][config.get("op", name)]] * repeats
    monkeypatch.setattr(choosing, "default_timer", lambda calls_hint=1: timer)
    x, w, b = make(70, 40, 136, torch.float16, device="cpu")
    with provisional.choosing_mode("tune"):
        choice = choosing.choose(problem_of(x, w), x, w, b, "relu")
    assert (choice.kernel, choice.config) == (VENDOR, {"op": "addmm_act"}) and timed_rows == [128, 70]


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_a_direct_call_takes_ours_where_the_library_won_only_at_the_buckets_rows(fake_gpu, monkeypatch):
    # cuBLAS ran 611 rows 1.16x slower than our split-K, after winning at the bucket's 640.
    timed_rows, timed_again = rows_timed(monkeypatch), []
    ms = {128: {"triton_tiled": 2.0, "triton_small_m": 1.1, VENDOR: 1.0},
          70: {"triton_tiled": 0.5, "triton_small_m": 0.9, VENDOR: 1.0}}

    def timer(run):
        name, _ = timers.timing_candidate.get()
        if timed_rows[-1] == 70:
            timed_again.append(name)
        return lambda repeats: [ms[timed_rows[-1]][name]] * repeats
    monkeypatch.setattr(choosing, "default_timer", lambda calls_hint=1: timer)
    x, w, b = make(70, 40, 136, torch.float16, device="cpu")
    with provisional.choosing_mode("tune"):
        choice = choosing.choose(problem_of(x, w), x, w, b, "relu")
    assert choice.kernel == "triton_small_m" and timed_rows == [128, 70]
    assert "triton_tiled" not in timed_again, "only our fastest at the bucket's rows is timed again"


@pytest.mark.timeout(60)
@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_a_first_call_times_a_short_list_and_tuning_replaces_it(fake_gpu, monkeypatch):
    timed = []
    ms = {"triton_tiled": 2.0, "triton_small_m": 0.9, VENDOR: 1.0}

    def timer(run):
        name, config = timers.timing_candidate.get()
        timed.append(name)
        return lambda repeats: [ms[name]] * repeats
    monkeypatch.setattr(choosing, "default_timer", lambda calls_hint=1: timer)
    x, w, b = make(70, 40, 136, torch.float16, device="cpu")
    problem = problem_of(x, w)
    first = choosing.choose(problem, x, w, b, "relu")  # a user's direct call: no mode set
    provisional_kernel = choosing.provisional_choice(problem, "cuda").kernel
    assert set(timed) == {provisional_kernel, VENDOR}, "only the provisional choice and the vendor's ops"
    assert first.source == "quick" and first.kernel in (provisional_kernel, VENDOR)
    assert choosing.cached(problem, "cuda") is None, "a short list is not a tuned bucket (the runner re-tunes it)"
    assert choosing.current(problem, "cuda") == first
    timed.clear()
    assert choosing.choose(problem, x, w, b, "relu") == first and not timed, "later calls reuse it"
    with provisional.choosing_mode("tune"):
        tuned = choosing.choose(problem, x, w, b, "relu")
    assert "triton_tiled" in timed and (tuned.kernel, tuned.source) == ("triton_small_m", "tuned")
    assert choosing.cached(problem, "cuda") == tuned


@pytest.mark.skipif(ON_GPU, reason="a fake GPU on CPU tensors")
def test_warm_up_takes_the_library_for_float32_layers_with_rows_off_sixteen_bytes(fake_gpu):
    # What the runner's start-up does: provisional choices, nothing timed; then a launch runs it.
    x, w, b = make(600, 17, 70, torch.float32, device="cpu")
    with provisional.choosing_mode("provisional"):
        choice = choosing.choose(problem_of(x, w), x, w, b, "tanh")
    assert (choice.kernel, choice.config, choice.source) == (VENDOR, OPS[0], "rules") and not choice.tuned
    assert_close(choosing.launch(choice, x, w, b, "tanh"), x, w, b, "tanh", "provisional")


# GPU checks (the lead's H100 runs them; skipped without CUDA).

GPU_SHAPES = [(48, 1024, 512), (1, 1000, 130), (17, 70, 100), (130, 100, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_every_activation_and_op_matches_float64_on_the_gpu(M, N, K, dtype, activation):
    # M=1: cuBLASLt's epilogue is not taken there (torch runs GEMM, then relu or tanh-GELU).
    x, w, b = make(M, N, K, dtype, seed=M + N)
    for config in OPS:
        for bias in (b, None):
            out = launch(x, w, bias, activation, config, dot_precision(dtype))
            check_against_float64(out, x, w, bias, activation, f"{config} {activation} {dtype} bias={bias is not None}")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 48])
def test_cublaslt_gelu_is_the_tanh_form(tf32, M):
    # Why "gelu" may take the fused path on CUDA in 16-bit: torch's CUDA _addmm_activation computes
    # the tanh form (the CPU's is erf). fp32 without TF32: GEMM errors ~1e-6 and the epilogue's ~5e-6
    # (why fp32 runs GELU after the GEMM), far below the two forms' 0.47e-3.
    tf32(False)
    x, w, b = make(M, 1024, 512, torch.float32)
    w = w * 3
    ref, pre = reference(x, w, b, "gelu")
    assert (F.gelu(pre) - ref).abs().max() > 1e-4, "inputs where erf and tanh forms can be told apart"
    got = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    assert (got.double() - ref).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 48, 300])
@pytest.mark.parametrize("op", [c["op"] for c in OPS])
def test_inside_a_cuda_graph(M, op):
    check_layers_in_cuda_graph(M, lambda i, h, w, b, act: choosing.launch(Choice(VENDOR, {"op": op}, False), h, w, b,
                                                                          act, static_weight=True),
                               tol=lambda largest: 0.05 * largest)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 48])
def test_between_our_pdl_kernels_inside_a_cuda_graph(M):
    # On sm_90 our kernels are programmatic dependent launches that may start before the previous
    # kernel ends and wait before reading their input; torch's kernels between them must not break that.
    from fusedserve.kernels.triton import small_m

    def layer(i, h, w, b, act):
        if i == 1:
            return choosing.launch(Choice(VENDOR, OPS[0], False), h, w, b, act, static_weight=True)
        config = small_m.candidates(M, w.shape[0], w.shape[1], h.dtype)[0]
        return choosing.launch(Choice("triton_small_m", config, False), h, w, b, act, static_weight=True)

    check_layers_in_cuda_graph(M, layer, tol=lambda largest: 0.05 * largest)


@pytest.fixture
def fresh_tuning(monkeypatch, tmp_path):
    """An empty tune cache and no provisional choices, on the real GPU."""
    cache = tune_cache.TuneCache(torch.cuda.get_device_name(), directory=tmp_path)
    monkeypatch.setattr(choosing, "device_cache", lambda name: cache)
    monkeypatch.setattr(choosing, "_provisional", {})
    return cache


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_tuner_takes_the_library_where_ours_lost(fresh_tuning):
    # H100: our best ran 0.51x the library's speed at this shape (bf16, drawn at random).
    x, w, b = make(2503, 840, 6376, torch.bfloat16)
    choice = choosing.choose(problem_of(x, w), x, w, b, "relu")
    assert choice.kernel == VENDOR and choice.tuned, choice
    check_against_float64(choosing.launch(choice, x, w, b, "relu"), x, w, b, "relu", str(choice))


@pytest.mark.gpu
def test_a_float32_layer_with_rows_off_sixteen_bytes_warms_up_and_captures_on_the_library(fresh_tuning, tf32):
    from fusedserve.kernels import fused_linear_with_choice

    tf32(False)
    x, w, b = make(1000, 1024, 518, torch.float32)
    with provisional.choosing_mode("provisional"):
        _, choice = fused_linear_with_choice(x, w, b, "gelu", static_weight=True)
    assert (choice.kernel, choice.source) == (VENDOR, "rules"), choice
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, captured = fused_linear_with_choice(x, w, b, "gelu", static_weight=True)
    assert captured == choice
    out.fill_(float("nan"))
    graph.replay()
    check_against_float64(out, x, w, b, "gelu", "replayed")
