"""float32 layers under 3xTF32 (the default fp32 precision) keep two copies of each operand tile in
registers: every tensor-core candidate of the Triton weight-streaming, tiled and split-K families
must still compile for sm_90 spilling a few bytes a thread at most. Compiled on the CPU, in a
process of its own (this one's Triton kernels are interpreted, and the interpreter compiles
nothing)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedserve.kernels.precision import FP32_PRECISION_ENV

# A few bytes a thread (split-K's 128x128 tile: 28) cost little; kilobytes (the tiles left out) do.
FEW_BYTES = 64

# Prints one line per candidate: family, config, registers, spill bytes.
COMPILE_SM90 = """
import sys
import torch
from triton.runtime.jit import MockTensor
from tools.sm90 import compile_sm90, ptxas_usage
from fusedserve.kernels.triton import small_m, split_k, tiled

def mock(*shape, dtype=torch.float32):
    return MockTensor(dtype, list(shape))

M, N, K = (int(v) for v in sys.argv[1:4])
flags = dict(HAS_BIAS=True, ACTIVATION="relu", INPUT_PRECISION="tf32x3", UPCAST_BF16=False, USE_PDL=True)
if sys.argv[4] == "small_m":
    for config in small_m.candidates(M, N, K, torch.float32):
        if config.get("GEMV"):
            continue  # CUDA-core products: no tl.dot, nothing to split
        args = (mock(M, K), mock(N, K), mock(N), mock(M, N), mock(config["SPLIT_K"], M, N),
                mock(1024, dtype=torch.int32), M, N, K, K, K, N)
        meta = dict(flags, PREFETCH_W=False, BLOCK_M=small_m.block_m(M), **config)
        print("small_m", config, *ptxas_usage(compile_sm90(small_m._small_m_kernel, args, meta)))
elif sys.argv[4] == "split_k":
    for config in split_k.candidates(M, N, K, torch.float32):
        meta = dict(flags, **config)
        for name in ("HAS_BIAS", "ACTIVATION", "SPLIT_K"):  # the summing kernel's
            meta.pop(name)
        args = (mock(M, K), mock(N, K), mock(config["SPLIT_K"], M, N), M, N, K, K, K, K // config["SPLIT_K"])
        print("split_k", config, *ptxas_usage(compile_sm90(split_k._split_k_partial_kernel, args, meta)))
else:
    for config in tiled.candidates(M, N, K, torch.float32):
        args = (mock(M, K), mock(N, K), mock(N), mock(M, N), M, N, K, K, K, N)
        print("tiled", config, *ptxas_usage(compile_sm90(tiled._tiled_linear_kernel, args, dict(flags, **config))))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("M, N, K, family", [(12, 1272, 1168, "small_m"), (1024, 1272, 1168, "tiled"),
                                             (256, 1280, 8192, "split_k")])
def test_fp32_tensor_core_candidates_do_not_spill_under_3xtf32(M, N, K, family):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    env[FP32_PRECISION_ENV] = "tf32x3"  # the candidates depend on it
    result = subprocess.run([sys.executable, "-c", COMPILE_SM90, str(M), str(N), str(K), family],
                            env=env, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, f"compile failed:\n{result.stderr[-3000:]}"
    reports = result.stdout.splitlines()
    assert reports, "no tensor-core candidate compiled"
    for report in reports:
        spilled = int(report.rsplit(" ", 1)[1])
        assert spilled <= FEW_BYTES, f"spills under 3xTF32 (family, config, registers, spill bytes): {report}"
