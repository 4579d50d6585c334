"""The fused MLP (one launch per layer, normalization fused into the first) against a layer-by-layer
torch reference (interpreter on the CPU, the real kernel on a GPU), its argument checks, and its
sm_90 compile (no register spills)."""

import os
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.fused_mlp import (
    fused_mlp,
    fused_mlp_candidates,
    fused_mlp_config,
    fused_mlp_layer,
    pack_mlp,
    pdl_supported,
)


def reference_mlp(x, weights, biases, shift, scale, activation="relu"):
    """Normalize in fp32, round to the model dtype, then act(F.linear) per layer, none on the last."""
    h = ((x - shift) * scale).to(weights[0].dtype)
    for i, (w, b) in enumerate(zip(weights, biases)):
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


@pytest.mark.parametrize("widths, rows", [((17, 70, 3, 5), 1), ((3, 70, 5), 3), ((100, 9), 16), ((20, 70, 3), 17), ((20, 70, 3), 65)])
@pytest.mark.parametrize("dtype, tol", [
    (torch.float32, 1e-5),  # exact fp32 products on both sides: summation order only
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
@pytest.mark.parametrize("dtype, tol", [
    (torch.float32, 1e-4),  # TF32 off (torch's default): ieee on both sides, summation order only
    (torch.float16, 1e-2),  # fp16 outputs (2**-11) rounded at each layer, K up to 1030
    (torch.bfloat16, 6e-2),  # bf16 (2**-8) at each layer; both sides accumulate in fp32
])
def test_fused_mlp_matches_layer_by_layer_on_gpu(widths, rows, dtype, tol):
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


@pytest.mark.parametrize("M", [1, 3, 17, 64, 100, 130, 512, 4096])
@pytest.mark.parametrize("N", [1, 10, 70, 256, 4096])
def test_config_fills_the_sms_or_is_as_narrow_as_tl_dot_allows(M, N):
    config = fused_mlp_config(M, N, torch.float32, sms=132)
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    programs = -(-M // bm) * -(-N // bn)
    assert bm in (16, 32, 64) and bn in (16, 32, 64), config  # tl.dot needs >= 16; 64 is the tested largest
    assert programs >= 132 or (bm, bn) == (16, 16), f"M={M} N={N}: {programs} programs with {config}"


# Compiles the layer kernel for sm_90 as a launch would (kernels._sm90) and prints what the tests
# check. Run in a child process: under TRITON_INTERPRET=1 (this session's CPU set-up) kernels are
# interpreted objects that cannot compile.
COMPILE_SM90 = """
import sys, torch
from triton.runtime.jit import MockTensor
from kernels._sm90 import compile_sm90, ptxas_usage
from kernels.fused_mlp import _fused_mlp_layer_kernel, fused_mlp_candidates

rows, N, dtype, normalize = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
K = 256  # a hidden width; a multiple of 16, as the launcher's aligned loads assume
# The default config (the first candidate), or with "fma" the first FMA candidate.
config = next(c for c in fused_mlp_candidates(rows, N, K, torch_dtype) if c["FMA"] == (sys.argv[5] == "fma"))
src = MockTensor(torch.float32 if normalize else torch_dtype, [rows, K])  # layer 0 reads raw fp32
w, b, dst = MockTensor(torch_dtype, [N, K]), MockTensor(torch_dtype, [N]), MockTensor(torch_dtype, [rows, N])
shift, scale = MockTensor(torch.float32, [K]), MockTensor(torch.float32, [K])
meta = dict(NORMALIZE=normalize, ACTIVATION="relu", UPCAST_BF16=False, USE_PDL=True, STAGES=config["num_stages"],
            INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32", **config)
compiled = compile_sm90(_fused_mlp_layer_kernel, (src, w, b, dst, shift, scale, rows, N, K, K, N), meta)
ptx = compiled.asm["ptx"]
registers, spills = ptxas_usage(compiled)
print("has_mma", "mma" in ptx, "fma", config["FMA"], "k_steps", -(-K // config["BLOCK_K"]), "has_gdc", "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx,
      "has_cp_async", "cp.async" in ptx, "registers", registers, "spills", spills)
"""


# (rows, N, tile) giving each fused_mlp_config tile family on an H200: 16x16 (batch 1, a 10-wide
# layer at 4096), 32x32, 32x16 and 64x64; the normalizing first layer at batch 1 and 4096; and the
# FMA candidates with the most registers a thread (1 and 8 rows: their widest K tiles).
@pytest.mark.parametrize("rows, N, normalize, tile", [
    (1, 256, True, "dot"), (64, 4096, False, "dot"), (512, 256, False, "dot"), (4096, 256, True, "dot"),
    (4096, 10, False, "dot"), (1, 256, True, "fma"), (8, 256, False, "fma")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiles_for_sm90_without_register_spills(rows, N, normalize, tile, dtype):
    # A GPU is not needed to compile for one: this keeps the default config spill-free, and FMA ones.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_SM90, str(rows), str(N), dtype,
                             "1" if normalize else "0", tile],
                            env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"compile failed:\n{result.stderr[-3000:]}"
    report = result.stdout
    assert "has_gdc True" in report, "no griddepcontrol: layers would not overlap launches on sm_90"
    if "k_steps 1 " not in report:  # (one K step: the whole layer is the peeled first step)
        assert "has_cp_async True" in report, "no cp.async: the k loop's loads are not pipelined"
    if dtype == "bf16" and tile == "dot":
        assert "has_mma True" in report, "bf16 layers should run on tensor cores"
    spills = re.search(r"spills (\d+)", report)
    assert spills is not None, f"no spill count in:\n{report}"
    assert int(spills.group(1)) == 0, f"rows={rows} N={N} {dtype}: {report}"
