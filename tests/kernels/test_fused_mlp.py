"""The fused MLP (one launch per layer, normalization fused into the first) against a layer-by-layer
torch reference (interpreter on the CPU, the real kernel on a GPU), its argument checks, its chain
tuner (coordinate descent on a fake timer; the real one on a GPU), and its sm_90 compile (no
register spills)."""

import json
import os
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from fusedserve.kernels import tuning
from fusedserve.kernels.precision import FP32_PRECISION_ENV, FP32_PRECISIONS
from fusedserve.kernels.triton import fused_mlp as fused_mlp_module
from fusedserve.kernels.triton.fused_mlp import (
    _tune_key,
    fused_mlp,
    fused_mlp_candidates,
    fused_mlp_config,
    fused_mlp_layer,
    layer_config,
    pack_mlp,
    pdl_supported,
    sm_count,
    tune_chain,
)
from fusedserve.kernels.tune_cache import TuneCache
from fusedserve.kernels.tuning import descend_chain


def reference_mlp(x, weights, biases, shift, scale, activation="relu"):
    """Normalize in fp32, round to the model dtype, then act(F.linear) per layer, none on the last."""
    h = ((x - shift) * scale).to(weights[0].dtype)
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        h = F.linear(h, w, b)
        if i < len(weights) - 1:
            h = F.relu(h) if activation == "relu" else h
    return h


def random_mlp(widths, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
               for k, n in pairwise(widths)]
    biases = [(0.1 * torch.randn(n, generator=g)).to(device, dtype) for n in widths[1:]]
    shift = torch.randn(widths[0], generator=g).to(device)
    scale = (torch.rand(widths[0], generator=g) + 0.5).to(device)
    return weights, biases, shift, scale


def check(widths, rows, dtype, device, tol):
    weights, biases, shift, scale = random_mlp(widths, dtype, device)
    x = (3 * torch.randn(rows, widths[0], generator=torch.Generator().manual_seed(rows))).to(device)
    got = fused_mlp(x, pack_mlp(weights, biases, "relu"), shift, scale)
    want = reference_mlp(x, weights, biases, shift, scale)
    assert got.dtype == dtype and got.shape == (rows, widths[-1])
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"widths={widths} rows={rows} {dtype}: {m}")


# Interpreter: tiny awkward shapes only (it is slow); bf16 dots are upcast to fp32 there (its bf16
# tl.dot is wrong), so bf16 checks the loads, stores and rounding points, not bf16 tensor cores.
@pytest.mark.parametrize("widths", [(17, 5), (3, 70, 5), (17, 70, 3, 5), (1, 17, 100, 3, 1)])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype, tol", [
    (torch.float32, 1e-5),  # ieee fp32 on both sides: summation order only
    (torch.float16, 2e-3),  # same rounding points; fp32 vs torch CPU accumulation order: ~1 fp16 ulp
    (torch.bfloat16, 3e-2),  # one bf16 ulp is 2**-8 relative; values up to ~4 after a few layers
])
def test_fused_mlp_matches_layer_by_layer_on_cpu(widths, rows, dtype, tol):
    if torch.cuda.is_available():
        pytest.skip("the GPU version is test_fused_mlp_matches_layer_by_layer_on_gpu")
    check(widths, rows, dtype, "cpu", tol)


def run_with_candidate(x, packed, shift, scale, pick):
    """The MLP with each layer on ``pick(its candidates)`` instead of the tuned config."""
    h = x
    for index in range(packed.num_layers):
        K, N = packed.widths[index], packed.widths[index + 1]
        h = fused_mlp_layer(h, packed, index, shift, scale,
                            config=pick(fused_mlp_candidates(x.shape[0], N, K, packed.weights.dtype)))
    return h


@pytest.mark.parametrize("widths, rows", [((17, 70, 3, 5), 1), ((3, 70, 5), 3), ((100, 9), 16), ((20, 70, 3), 17),
                                         ((20, 70, 3), 65)])
@pytest.mark.parametrize("dtype, tol", [
    # exact fp32 products on both sides (on a GPU ours may be 3xTF32, ~2**-22 a product): summation
    # order, mostly
    (torch.float32, 1e-5),
    (torch.bfloat16, 3e-2),  # one bf16 ulp is 2**-8 relative, rounded at each layer
])
def test_every_candidate_tile_matches_the_reference(widths, rows, dtype, tol):
    # Each config the tuner may pick, FMA tiles (1 to 16 rows, no tensor cores) included.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights, biases, shift, scale = random_mlp(widths, dtype, device)
    packed = pack_mlp(weights, biases, "relu")
    x = (3 * torch.randn(rows, widths[0], generator=torch.Generator().manual_seed(rows))).to(device)
    want = reference_mlp(x, weights, biases, shift, scale).float()
    for i in range(len(fused_mlp_candidates(rows, max(widths), max(widths), dtype))):
        got = run_with_candidate(x, packed, shift, scale, lambda configs, i=i: configs[min(i, len(configs) - 1)])
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol,
                                   msg=lambda m, i=i: f"candidate {i} widths={widths} rows={rows} {dtype}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("widths", [(64, 256, 256, 10), (100, 512, 70, 1030, 3), (130, 17)])
@pytest.mark.parametrize("rows", [1, 3, 17, 100, 130, 1000])  # every tile config
@pytest.mark.parametrize("dtype, tol, fp32_precision", [
    # TF32 off (torch's default): torch's products are exact, ours exact or 3xTF32 (2**-22 or so
    # relative a product, fusedserve.kernels.precision.dot_precision); the rest is summation order
    *[(torch.float32, 1e-4, precision) for precision in FP32_PRECISIONS],
    (torch.float16, 1e-2, None),  # fp16 outputs (2**-11) rounded at each layer, K up to 1030
    (torch.bfloat16, 6e-2, None),  # bf16 (2**-8) at each layer; both sides accumulate in fp32
])
def test_fused_mlp_matches_layer_by_layer_on_gpu(widths, rows, dtype, tol, fp32_precision, monkeypatch):
    if fp32_precision is not None:  # (16-bit dots have one precision)
        monkeypatch.setenv(FP32_PRECISION_ENV, fp32_precision)
    check(widths, rows, dtype, "cuda", tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_programmatic_dependent_launch_changes_no_bits(dtype):
    if not pdl_supported("cuda"):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    weights, biases, shift, scale = random_mlp((64, 256, 256, 10), dtype, "cuda")
    packed = pack_mlp(weights, biases, "relu")

    def chain(x, pdl):
        for index in range(packed.num_layers):
            x = fused_mlp_layer(x, packed, index, shift, scale, pdl=pdl)
        return x

    static_x = torch.zeros(17, 64, device="cuda")
    chain(static_x, True)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x, True)
    inputs = [3 * torch.randn(17, 64, device="cuda") for _ in range(20)]
    for x in inputs:  # back to back, no host sync: a layer reading early would show in the last one
        static_x.copy_(x)
        graph.replay()
    # Same kernels, tiles and inputs with and without the launch attribute: bitwise equal.
    torch.testing.assert_close(static_out, chain(inputs[-1], False), rtol=0, atol=0,
                               msg=lambda m: f"{dtype} graph replay with PDL: {m}")
    torch.testing.assert_close(chain(inputs[0], True), chain(inputs[0], False), rtol=0, atol=0,
                               msg=lambda m: f"{dtype} eager with PDL: {m}")


def test_bad_arguments_are_rejected():
    weights, biases, shift, scale = random_mlp((3, 5, 2), torch.float32, "cpu")
    packed = pack_mlp(weights, biases, "relu")
    with pytest.raises(ValueError, match=r"h must be torch.float32 \[M >= 1, 3\] for layer 0"):
        fused_mlp(torch.randn(2, 4), packed, shift, scale)
    with pytest.raises(ValueError, match="h must be torch.float32"):
        fused_mlp(torch.randn(2, 3, dtype=torch.float64), packed, shift, scale)
    with pytest.raises(ValueError, match="scale"):
        fused_mlp(torch.randn(2, 3), packed, shift, scale[:2])
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        pack_mlp([weights[0], weights[0]], biases, "relu")
    with pytest.raises(ValueError, match="activation"):
        pack_mlp(weights, biases, "swish")
    with pytest.raises(ValueError, match="index"):
        fused_mlp_layer(torch.randn(2, 3), packed, 2, shift, scale)
    with pytest.raises(ValueError, match=r"h must be torch.float32 \[M >= 1, 5\] for layer 1"):
        fused_mlp_layer(torch.randn(2, 3), packed, 1, shift, scale)
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        fused_mlp_layer([[0.0] * 3], packed, 0, shift, scale)


def cost_timer(call):
    """A ``time_configs`` timer for a ``run`` that returns its own cost in ms: every sample is it."""
    return lambda repeats: [call() for _ in range(repeats)]


def tiles(*names):
    return [{"tile": name} for name in names]


def test_descent_keeps_what_is_fastest_in_the_chain_not_alone():
    (a0, a1, a2), (b0, b1) = tiles("a0", "a1", "a2"), tiles("b0", "b1")
    # Layer 0's a1 is its fastest alone, but costs 5 more next to layer 1's b0 (an interaction
    # that timing a layer alone cannot see): per-layer picks [a1, b0] take 10, slower than the
    # defaults' 7, as the wide tiles picked alone made the digits chain at batch 512.
    alone = {"a0": 4, "a1": 2, "a2": 3, "b0": 3, "b1": 3.5}
    timed = []

    def run(configs):
        names = tuple(c["tile"] for c in configs)
        timed.append(names)
        return sum(alone[n] for n in names) + (5 if names == ("a1", "b0") else 0)

    assert descend_chain([[a0, a1, a2], [b0, b1]], run, cost_timer) == [a2, b0]
    # Layer 0 timed against layer 1's default, then layer 1 against layer 0's pick (a2), never a1
    # or a0: one pass, so the best chain of all, [a1, b1] (5.5), is not on its path.
    assert list(dict.fromkeys(timed)) == [("a0", "b0"), ("a1", "b0"), ("a2", "b0"), ("a2", "b1")]


def test_descent_is_deterministic_on_ties_and_skips_configs_that_do_not_fit():
    (c0,), (d, x, y, big) = tiles("c0"), tiles("d", "x", "y", "big")
    cost = {"d": 2.0, "x": 1.0, "y": 1.0}
    timed = []

    def run(configs):
        timed.append(tuple(c["tile"] for c in configs))
        if configs[1] is big:  # too much shared memory, as a launch on the GPU raises it
            raise OutOfResources(300_000, 232_448, "shared memory")
        return cost[configs[1]["tile"]]

    picks = [descend_chain([[c0], [d, x, y, big]], run, cost_timer) for _ in range(3)]
    assert picks == [[c0, x]] * 3, "equal times: the earlier candidate, every time"
    assert {names[0] for names in timed} == {"c0"}, "a layer with one candidate stays put"
    assert descend_chain([[d, x, y]], lambda configs: 1.0, cost_timer) == [d], "all equal: the default"
    assert descend_chain([[c0], [d]], lambda configs: pytest.fail("timed a chain with no choice"),
                         cost_timer) == [c0, d]


def test_tune_chain_on_the_cpu_returns_the_defaults_untimed(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the GPU version is test_tune_chain_stores_one_config_per_layer_on_gpu")
    monkeypatch.setattr(fused_mlp_module, "descend_chain", lambda *args: pytest.fail("timed on the CPU"))
    widths = (17, 70, 3, 5)
    weights, biases, shift, scale = random_mlp(widths, torch.float32, "cpu")
    packed = pack_mlp(weights, biases, "relu")
    x = torch.randn(20, 17)
    configs = tune_chain(x, packed, shift, scale)
    assert configs == [fused_mlp_config(20, n, k, torch.float32, sms=1) for k, n in pairwise(widths)]
    assert configs == [layer_config(20, packed, i, "cpu") for i in range(3)]
    torch.testing.assert_close(fused_mlp(x, packed, shift, scale), fused_mlp(x, packed, shift, scale, configs),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"h must be torch.float32 \[M >= 1, 17\] for layer 0"):
        tune_chain(torch.randn(2, 4), packed, shift, scale)
    with pytest.raises(ValueError, match="one config per layer"):
        fused_mlp(x, packed, shift, scale, configs[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("rows, dtype, tol", [
    (100, torch.float32, 1e-4),  # past 64 rows; TF32 off: 3xTF32 or exact products, summation order
    (17, torch.bfloat16, 6e-2),  # 17 to 64 rows; bf16 (2**-8) rounded at each layer
])
def test_tune_chain_stores_one_config_per_layer_on_gpu(rows, dtype, tol, tmp_path, monkeypatch):
    cache = TuneCache(torch.cuda.get_device_name(), tmp_path)  # nothing tuned yet
    monkeypatch.setattr(fused_mlp_module, "device_cache", lambda name: cache)
    widths = (64, 256, 256, 10)
    weights, biases, shift, scale = random_mlp(widths, dtype, "cuda")
    packed = pack_mlp(weights, biases, "relu")
    x = 3 * torch.randn(rows, widths[0], device="cuda")
    configs = tune_chain(x, packed, shift, scale)
    stored = json.loads(cache.path.read_text())
    assert stored == {_tune_key(rows, packed, i): configs[i] for i in range(3)}, stored
    for i, config in enumerate(configs):
        assert config in fused_mlp_candidates(rows, widths[i + 1], widths[i], dtype, sm_count("cuda")), config
    monkeypatch.setattr(tuning, "time_configs", lambda *args: pytest.fail("timed a tuned bucket"))
    assert tune_chain(x, packed, shift, scale) == configs
    got = fused_mlp(x, packed, shift, scale)  # launches the stored configs
    torch.testing.assert_close(got, fused_mlp(x, packed, shift, scale, configs), rtol=0, atol=0)
    torch.testing.assert_close(got.float(), reference_mlp(x, weights, biases, shift, scale).float(),
                               rtol=tol, atol=tol)


@pytest.mark.gpu
def test_tune_chain_keeps_a_layer_another_chain_tuned(tmp_path, monkeypatch):
    cache = TuneCache(torch.cuda.get_device_name(), tmp_path)
    monkeypatch.setattr(fused_mlp_module, "device_cache", lambda name: cache)
    descents = []

    def recorded_descent(candidates, run, timer=None):
        descents.append(candidates)
        return descend_chain(candidates, run, timer)

    monkeypatch.setattr(fused_mlp_module, "descend_chain", recorded_descent)
    weights, biases, shift, scale = random_mlp((64, 256, 256, 10), torch.float32, "cuda")
    packed = pack_mlp(weights, biases, "relu")
    # Layer 1 as another model with the same layer shape and role left it: a non-default candidate.
    pinned = fused_mlp_candidates(100, 256, 256, torch.float32, sm_count("cuda"))[-1]
    cache.put(_tune_key(100, packed, 1), pinned)
    configs = tune_chain(torch.randn(100, 64, device="cuda"), packed, shift, scale)
    assert configs[1] == pinned and cache.get(_tune_key(100, packed, 1)) == pinned
    assert len(descents) == 1 and descents[0][1] == [pinned] and len(descents[0][0]) > 1, descents
    assert all(cache.get(_tune_key(100, packed, i)) == configs[i] for i in (0, 2))


@pytest.mark.parametrize("M", [1, 3, 8, 16, 17, 32, 33, 64, 65, 512, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates_start_at_the_default_and_stay_few(M, dtype):
    configs = fused_mlp_candidates(M, 256, 256, dtype)
    assert configs[0] == fused_mlp_config(M, 256, 256, dtype)
    assert 3 <= len(configs) <= 7, configs  # each is timed in the whole chain at warm-up
    assert all(configs.count(c) == 1 for c in configs), configs
    assert all(c["BLOCK_M"] == 16 or c["BLOCK_M"] < 2 * M for c in configs), f"tiles mostly padding: {configs}"


@pytest.mark.parametrize("M", [1, 3, 17, 64, 100, 130, 512, 4096])
@pytest.mark.parametrize("N", [1, 10, 70, 256, 4096])
def test_config_fills_the_sms_or_is_as_narrow_as_tl_dot_allows(M, N):
    config = fused_mlp_config(M, N, 256, torch.bfloat16, sms=132)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    programs = -(-M // bm) * -(-N // bn)
    assert bm in (16, 32, 64) and bn in (16, 32, 64), config  # tl.dot needs >= 16; 64 is the tested largest
    assert programs >= 132 or (bm, bn) == (16, 16), f"M={M} N={N}: {programs} programs with {config}"


@pytest.mark.parametrize("M, K, tile", [
    (1, 4096, (1, 8, 512, 4)),  # as deep as the register budget allows
    (3, 224, (4, 8, 256, 8)),
    (4, 72, (4, 8, 128, 4)),  # as deep as K, rounded up
    (8, 3104, (8, 8, 256, 8)),
])
def test_exact_fp32_starts_few_rows_on_an_fma_tile(M, K, tile, monkeypatch):
    monkeypatch.setattr(fused_mlp_module, "dot_precision", lambda dtype: "tf32x3")
    config = fused_mlp_config(M, 832, K, torch.float32)
    got = (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_warps"], config["FMA"])
    assert got == (*tile, True), config
    assert fused_mlp_candidates(M, 832, K, torch.float32)[0] == config
    # Past 8 rows, with TF32 allowed, and in 16-bit: tensor-core tiles first.
    assert not fused_mlp_config(9, 832, K, torch.float32)["FMA"]
    assert not fused_mlp_config(M, 832, K, torch.bfloat16)["FMA"]
    monkeypatch.setattr(fused_mlp_module, "dot_precision", lambda dtype: "tf32")
    assert not fused_mlp_config(M, 832, K, torch.float32)["FMA"]


# Compiles the layer kernel for sm_90 as a launch would (tools.sm90) with every tuning candidate
# of one layer, and prints one line per config with what the tests check. Run in a child process:
# under TRITON_INTERPRET=1 (this session's CPU set-up) kernels are interpreted objects that cannot
# compile.
COMPILE_SM90 = """
import sys, torch
from triton.runtime.jit import MockTensor
from tools.sm90 import compile_sm90, ptxas_usage
from fusedserve.kernels.family import config_str
from fusedserve.kernels.triton.fused_mlp import _fused_mlp_layer_kernel, fused_mlp_candidates

rows, N, dtype, normalize = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
# fp32: exact CUDA-core dots; fp32x3: the 3xTF32 tensor-core dots (fusedserve.kernels.precision.dot_precision)
torch_dtype = {"fp32": torch.float32, "fp32x3": torch.float32, "bf16": torch.bfloat16}[dtype]
precision = {"fp32": "ieee", "fp32x3": "tf32x3", "bf16": "tf32"}[dtype]
K = 256  # a hidden width; a multiple of 16, as the launcher's aligned loads assume
src = MockTensor(torch.float32 if normalize else torch_dtype, [rows, K])  # layer 0 reads raw fp32
w, b, dst = MockTensor(torch_dtype, [N, K]), MockTensor(torch_dtype, [N]), MockTensor(torch_dtype, [rows, N])
shift, scale = MockTensor(torch.float32, [K]), MockTensor(torch.float32, [K])
for config in fused_mlp_candidates(rows, N, K, torch_dtype):
    meta = dict(NORMALIZE=normalize, ACTIVATION="relu", UPCAST_BF16=False, USE_PDL=True, STAGES=config["num_stages"],
                INPUT_PRECISION=precision, **config)
    compiled = compile_sm90(_fused_mlp_layer_kernel, (src, w, b, dst, shift, scale, rows, N, K, K, N), meta)
    ptx = compiled.asm["ptx"]
    registers, spills = ptxas_usage(compiled)
    print(config_str(config), "has_mma", "mma" in ptx, "k_steps", -(-K // config["BLOCK_K"]),
          "has_gdc", "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx,
          "has_cp_async", "cp.async" in ptx, "registers", registers, "spills", spills)
"""


# (rows, N) giving each range of fused_mlp_candidates and each fused_mlp_config tile family on an
# H200: up to 16 rows (16x16 tiles, FMA tiles as narrow as 1 and 8 rows, with their widest K tiles),
# 17 to 64 (32x32 defaults at 64 rows of a 4096-wide layer, 16x16 at 256 wide; 64-row tiles from 33
# rows), past 64 (32x16 and 64x64 defaults, 16x16 for a 10-wide layer); the normalizing first layer
# (its fp32 input tile takes the most registers) in each range.
@pytest.mark.parametrize("rows, N, normalize", [
    (1, 256, True), (8, 256, False), (17, 256, True), (64, 256, True), (64, 4096, False),
    (512, 256, False), (4096, 256, True), (4096, 10, False)])
@pytest.mark.parametrize("dtype", ["fp32", "fp32x3", "bf16"])
def test_every_candidate_compiles_for_sm90_without_register_spills(rows, N, normalize, dtype, monkeypatch):
    # A GPU is not needed to compile for one: this keeps every config the tuner may pick spill-free.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    env[FP32_PRECISION_ENV] = "ieee" if dtype == "fp32" else "tf32x3"  # the candidates depend on it
    result = subprocess.run([sys.executable, "-c", COMPILE_SM90, str(rows), str(N), dtype, "1" if normalize else "0"],
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"compile failed:\n{result.stderr[-3000:]}"
    reports = result.stdout.splitlines()
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    monkeypatch.setenv(FP32_PRECISION_ENV, env[FP32_PRECISION_ENV])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the interpreter keys fp32 as ieee)
    assert len(reports) == len(fused_mlp_candidates(rows, N, 256, torch_dtype))
    for report in reports:
        assert "has_gdc True" in report, f"no griddepcontrol: layers would not overlap launches on sm_90: {report}"
        if "k_steps 1 " not in report:  # (one K step: the whole layer is the peeled first step)
            assert "has_cp_async True" in report, f"no cp.async: the k loop's loads are not pipelined: {report}"
        if dtype != "fp32" and "FMA=False" in report:
            assert "has_mma True" in report, f"{dtype} layers should run on tensor cores: {report}"
        spills = re.search(r"spills (\d+)", report)
        assert spills is not None, f"no spill count in:\n{report}"
        assert int(spills.group(1)) == 0, f"rows={rows} N={N} normalize={normalize} {dtype}: {report}"
