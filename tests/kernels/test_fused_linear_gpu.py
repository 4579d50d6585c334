"""fused_linear on a CUDA GPU: real MMAs (bf16 included), large shapes, every tuning candidate.

Errors are measured against a float64 reference and compared with the error of torch's own
``relu(F.linear)`` in the same dtype: ours may be at most twice torch's, plus one output ulp of the
largest value (the two round and accumulate in different orders, so neither is exact). In fp32 the
accumulation order dominates instead (cuBLAS may sum K as a tree, we sum it in a chain), so fp32
also allows a chain's typical rounding error, sqrt(K) half-ulps of fp32 on the sum of |x||w|, and,
when TF32 is allowed, a bound on the error of rounding the inputs to TF32 (see _tf32_rounding_bound).
"""

import pytest
import torch

from fusedserve.kernels import fused_linear, kernel_choice, timers
from fusedserve.kernels.precision import FP32_PRECISION_ENV, FP32_PRECISIONS
from fusedserve.kernels.triton import small_m, tiled, tma_persistent

from .conftest import check_layers_in_cuda_graph, make

pytestmark = pytest.mark.gpu

# One unit in the last place of each output dtype, relative.
_OUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def reference(x, weight, bias, activation):
    """act(x @ weight^T + bias) in float64."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return torch.relu(y) if activation == "relu" else y


def torch_same_dtype(x, weight, bias, activation):
    y = torch.nn.functional.linear(x, weight, bias)
    return torch.relu(y) if activation == "relu" else y


def poison_allocator(numel, dtype):
    """Leave a NaN-filled block in PyTorch's caching allocator, so the next output of this size is
    most likely carved from it: any element the kernel fails to write then reads as NaN."""
    block = torch.full((numel,), float("nan"), device="cuda", dtype=dtype)
    del block


def check(out, x, w, b, activation, where):
    ref = reference(x, w, b, activation)
    assert out.shape == ref.shape and out.dtype == x.dtype, f"{where}: {out.shape} {out.dtype}"
    finite = torch.isfinite(out)
    if not finite.all():
        idx = tuple(int(i) for i in (~finite).nonzero()[0])
        raise AssertionError(f"{where}: {int((~finite).sum())} non-finite outputs (unwritten?), first at {idx}")
    ours = (out.double() - ref).abs()
    theirs = (torch_same_dtype(x, w, b, activation).double() - ref).abs().max().item()
    # Twice torch's own error, plus one output ulp of the largest value (see the module docstring).
    tol = 2 * theirs + _OUT_ULP[x.dtype] * ref.abs().max().item()
    if x.dtype == torch.float32:
        magnitude = x.double().abs() @ w.double().abs().T
        if b is not None:
            magnitude = magnitude + b.double().abs()
        magnitude = magnitude.max().item()
        tol += x.shape[-1] ** 0.5 * 2.0**-24 * magnitude
        if torch.backends.cuda.matmul.allow_tf32:
            tol += _tf32_rounding_bound(x, w)
    worst = ours.max().item()
    if not worst <= tol:
        idx = tuple(int(i) for i in (ours == ours.max()).nonzero()[0])
        raise AssertionError(f"{where}: max error {worst:.3g} at {idx} (got {out[idx].item()!r}, want "
                             f"{ref[idx].item()!r}) > tol {tol:.3g} (torch's error {theirs:.3g})")


# TF32 keeps 10 of fp32's 23 mantissa bits (unit roundoff 2^-11). Rounding both inputs makes each
# product x_k*w_k off by at most ~2^-10 |x_k w_k|, with random sign; cuBLAS and our kernel round and sum
# differently, so their errors do not track each other (2x torch's error was seen to be too tight).
# Hoeffding's bound for a sum of independent zero-mean terms |e_k| <= 2^-10 |x_k w_k|: the chance that
# any of ~2e5 outputs exceeds t * 2^-10 * sqrt(sum_k (x_k w_k)^2) is below 1e-6 for t = 7.3. Still
# well under what bf16-rounded inputs would give (8x the per-product error).
_TF32_UNIT = 2.0**-10
_HOEFFDING_T = 7.3


def _tf32_rounding_bound(x, w):
    squares = (x.double() ** 2) @ (w.double() ** 2).T
    return _HOEFFDING_T * _TF32_UNIT * squares.max().sqrt().item()


SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (3, 100, 130), (100, 1000, 700), (300, 1000, 700),
          (130, 1024, 1024), (2048, 4096, 4096)]
# fp32 on fewer shapes: each new shape tunes, and FMA kernels compile slowly.
FP32_SHAPES = [(1, 4096, 4096), (3, 100, 130), (300, 1000, 700)]


@pytest.mark.parametrize("M,N,K,dtype",
                         [(*s, dt) for dt in (torch.bfloat16, torch.float16) for s in SHAPES]
                         + [(*s, torch.float32) for s in FP32_SHAPES])
def test_fused_linear_large_shapes(M, N, K, dtype):
    x, w, b = make(M, N, K, dtype)
    poison_allocator(M * N, dtype)
    out = fused_linear(x, w, b, "relu")
    name, config = kernel_choice(M, N, K, dtype, x.device)
    check(out, x, w, b, "relu", f"{(M, N, K)} {dtype} via {name} [{config}]")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_no_bias_no_activation(dtype):
    x, w, _ = make(70, 1024, 512, dtype)
    check(fused_linear(x, w, None, "none"), x, w, None, "none", f"no bias, {dtype}")


def _candidates(module, M, N, K, dtype=torch.bfloat16):
    # fp32 at both precisions its dots may run at (the GEMV has no dot: one run covers it).
    precisions = FP32_PRECISIONS if dtype == torch.float32 else ("tf32",)
    return [pytest.param(module, M, N, K, dtype, cfg, precision,
                         id=f"{module.NAME}-{M}x{N}x{K}-{str(dtype)[6:]}-{precision}-{i}")
            for i, cfg in enumerate(module.candidates(M, N, K, dtype))
            for precision in precisions if precision != "tf32x3" or not cfg.get("GEMV")]


# Every config the tuner may pick must be right, not just the winner on this GPU. bf16 for the
# tensor-core configs (fp16 takes the same code path), fp32 for the FMA and 3xTF32 ones.
@pytest.mark.parametrize("module,M,N,K,dtype,config,precision",
                         _candidates(small_m, 1, 4096, 4096) + _candidates(small_m, 3, 4096, 4096)
                         + _candidates(small_m, 5, 4096, 4096) + _candidates(small_m, 64, 1000, 700)
                         + _candidates(small_m, 300, 1000, 704) + _candidates(tiled, 300, 1000, 700)
                         + _candidates(tma_persistent, 300, 1000, 704)
                         + _candidates(small_m, 1, 1000, 700, torch.float32)
                         + _candidates(small_m, 5, 1000, 700, torch.float32)
                         + _candidates(tiled, 300, 1000, 700, torch.float32))
def test_every_candidate_config(module, M, N, K, dtype, config, precision):
    if module is tma_persistent and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel is dispatched on Hopper only")
    x, w, b = make(M, N, K, dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    try:
        module.launch(x, w, b, "relu", out, config, input_precision=precision, upcast_bf16=False)
    except triton_resource_errors() as e:
        pytest.skip(f"config does not fit this GPU (the tuner skips it too): {e}")
    check(out, x, w, b, "relu", f"{module.NAME} {config} {dtype} {precision}")


def triton_resource_errors():
    from triton.runtime.errors import OutOfResources, PTXASError
    return (OutOfResources, PTXASError)


@pytest.mark.parametrize("allow_tf32, precision", [(False, "tf32x3"), (False, "ieee"), (True, "tf32x3")])
def test_fp32_follows_torch_tf32_flag(allow_tf32, precision, monkeypatch):
    monkeypatch.setenv(FP32_PRECISION_ENV, precision)  # (ignored where TF32 is allowed)
    x, w, b = make(64, 1024, 4096, torch.float32)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        for big in (x, torch.cat([x] * 3)):  # M=64 (small-M kernel) and M=192 (tiled kernel)
            out = fused_linear(big, w, b, "relu")
            check(out, big, w, b, "relu", f"fp32 M={big.shape[0]} allow_tf32={allow_tf32} {precision}")
            if not allow_tf32:
                # Exact fp32 products or 3xTF32: about 1e-6 relative at K=4096; TF32 would be ~1e-3.
                rel = ((out.double() - reference(big, w, b, "relu")).abs().max()
                       / reference(big, w, b, "relu").abs().max()).item()
                assert rel < 1e-5, f"fp32 with allow_tf32=False ({precision}): relative error {rel:.3g} looks like TF32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_three_dim_and_strided_x():
    x, w, b = make(2 * 3 * 5, 256, 128, torch.bfloat16)
    x3 = x.reshape(2, 15, 128)
    check(fused_linear(x3, w, b).reshape(30, 256), x, w, b, "relu", "3-D x")
    wide = torch.randn(70, 200, device="cuda").to(torch.bfloat16)
    xs = wide[:, 7:135]  # row stride 200, not 16-byte aligned at its start: no TMA for this view
    check(fused_linear(xs, w, b), xs, w, b, "relu", "strided x")


def test_dispatch_on_this_gpu():
    major = torch.cuda.get_device_capability()[0]
    # Once tuned (maybe by another test in this process), Gluon or the vendor's GEMM may win any
    # bucket on Hopper, the vendor's anywhere.
    vendor = ("torch_cublas",)
    small = kernel_choice(8, 4096, 4096, torch.bfloat16, "cuda")[0]
    assert small in (("triton_small_m", "gluon_small_m", "gluon_wgmma") if major == 9
                     else ("triton_small_m",)) + vendor, small
    # Past SMALL_M_MAX the tuned winner may be any candidate; before tuning it is the base kernel.
    mid = kernel_choice(512, 4096, 4096, torch.bfloat16, "cuda")[0]
    assert mid in ("triton_tma_persistent" if major == 9 else "triton_tiled", "triton_small_m", "gluon_wgmma",
                   "gluon_ws") + vendor
    big = kernel_choice(8192, 4096, 4096, torch.bfloat16, "cuda")[0]
    assert big in (("triton_tma_persistent", "gluon_wgmma", "gluon_ws") if major == 9 else ("triton_tiled",)) + vendor
    assert kernel_choice(8192, 4096, 4096, torch.float32, "cuda")[0] in ("triton_tiled",) + vendor


def test_config_reported_after_tuning():
    # fp32: the weight-streaming kernel and the vendor's GEMM are the candidates at this M.
    x, w, b = make(33, 512, 256, torch.float32)
    fused_linear(x, w, b)
    name, config = kernel_choice(33, 512, 256, torch.float32, x.device)
    assert (name, config.split("=")[0]) in (("triton_small_m", "BLOCK_N"), ("torch_cublas", "op")), (name, config)


def test_cpu_tensors_need_the_interpreter():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="x is a CPU tensor"):
        fused_linear(x, torch.randn(4, 8))


def test_repeat_calls_are_deterministic():
    # Split-K partial sums are added in a fixed order: bit-identical results call after call.
    x, w, b = make(4, 4096, 4096, torch.bfloat16)
    first = fused_linear(x, w, b)
    for _ in range(3):
        assert torch.equal(fused_linear(x, w, b), first)


def test_graph_timer_times_replays_of_rotating_calls():
    sets = [make(16, 4096, 4096, torch.bfloat16, seed=s) for s in range(3)]
    calls = []

    def run():
        x, w, b = sets[len(calls) % len(sets)]
        calls.append(1)
        return fused_linear(x, w, b)

    fused_linear(*sets[0])  # tune this bucket first: the timer must only see launches
    sample = timers.graph_timer(run, len(sets))
    eager_and_captured = len(calls)
    ms = sample(4)
    assert len(calls) == eager_and_captured, "replays must not call run() again"
    assert len(ms) == 4 and all(0 < t < 5 for t in ms), f"per-call ms {ms}"
    # 16 x 4096 x 4096 bf16 reads 32 MiB of weights: at most ~5 TB/s on any current GPU.
    assert min(ms) > 32 * 2**20 / 5e12 * 1e3, f"per-call ms {ms} faster than HBM allows (warm L2?)"


# The first call tunes three layers, compiling every candidate: past 120 s with 16 workers compiling at once.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("M", [1, 3, 48, 200])
@pytest.mark.parametrize("static_weight", [False, True], ids=["", "static_weight"])
def test_dependent_layers_in_a_cuda_graph(M, static_weight):
    # On sm_90 each layer is a programmatic dependent launch that may start before the previous one
    # ends. M from the GEMV variant to the tiled kernels.
    check_layers_in_cuda_graph(
        M, lambda i, h, w, b, act: fused_linear(h, w, b, act, static_weight=static_weight),
        tol=lambda largest: 0.05 * largest)


def test_split_k_first_launched_inside_a_graph_capture_runs_unsplit(monkeypatch):
    # The split-K tile counters are made by the first eager split-K launch; a capture cannot make
    # them (their zeroing would happen only at replay), so a split config first met inside a
    # capture runs unsplit, with the same answers.
    monkeypatch.setattr(small_m, "_locks", {})
    x, w, b = make(3, 200, 1024, torch.float16)
    config = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3)
    out = torch.full((3, 200), float("nan"), device="cuda", dtype=torch.float16)

    def run(cfg=config):
        small_m.launch(x, w, b, "relu", out, cfg, input_precision="tf32", upcast_bf16=False)

    run(dict(config, SPLIT_K=1))  # compile both variants outside the capture
    run()
    monkeypatch.setattr(small_m, "_locks", {})  # as if no eager split-K launch had happened
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    assert small_m._locks == {}, "a capture must not make the tile counters"
    out.fill_(float("nan"))
    graph.replay()
    check(out, x, w, b, "relu", "split-K config first launched in a capture")
