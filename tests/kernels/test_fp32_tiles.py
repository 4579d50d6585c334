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

# Prints one line per compiled kernel of each candidate: family, config, registers, spill bytes.
COMPILE_SM90 = """
import sys
import torch
from fusedserve.kernels.triton import small_m, split_k, tiled
from tools.sm90 import ptxas_usage
from tools.sm90_triton import compile_launch

M, N, K = (int(v) for v in sys.argv[1:4])
module = {"small_m": small_m, "split_k": split_k, "tiled": tiled}[sys.argv[4]]
for config in module.candidates(M, N, K, torch.float32):
    if config.get("GEMV"):
        continue  # CUDA-core products: no tl.dot, nothing to split
    for compiled in compile_launch(module, M, N, K, torch.float32, config, precision="tf32x3"):
        print(sys.argv[4], config, *ptxas_usage(compiled))
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
