"""Split-K's TMA partial sums (Hopper's 16-bit rows) as they compile for sm_90, without a GPU: every
tuning candidate lowers to TMA loads and wgmma and does not spill registers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedserve.kernels.triton import split_k

# One line per candidate of a few-tile, long-K layer. Run in a child process: under TRITON_INTERPRET=1
# kernels are interpreted objects that cannot compile.
COMPILE_SM90 = """
import torch
from triton.runtime.jit import MockTensor
from triton.tools.tensor_descriptor import TensorDescriptor
from tools.sm90 import compile_sm90, ptxas_usage
from fusedserve.kernels.triton import split_k

M, N, K = 683, 1024, 4520
for config in split_k.candidates(M, N, K, torch.bfloat16, tma=True):
    meta = {k: v for k, v in config.items() if k not in ("SPLIT_K", "TMA")}
    x, w = MockTensor(torch.bfloat16, [M, K]), MockTensor(torch.bfloat16, [N, K])
    x_desc = TensorDescriptor.from_tensor(x, [meta["BLOCK_M"], meta["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(w, [meta["BLOCK_N"], meta["BLOCK_K"]])
    part = MockTensor(torch.float32, [config["SPLIT_K"], M, N])
    compiled = compile_sm90(split_k._split_k_tma_partial_kernel, (x_desc, w_desc, part, M, N, 1536),
                            dict(UPCAST_BF16=False, USE_PDL=True, **meta))
    ptx = compiled.asm["ptx"]
    print("wgmma", "wgmma.mma_async" in ptx, "tma", "cp.async.bulk.tensor" in ptx,
          "spills", ptxas_usage(compiled)[1])
"""


@pytest.mark.timeout(600)
def test_every_tma_candidate_compiles_to_tma_loads_and_wgmma_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_SM90], env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, f"compile failed:\n{result.stderr[-3000:]}"
    reports = result.stdout.splitlines()
    assert len(reports) == len(split_k.candidates(683, 1024, 4520, torch.bfloat16, tma=True)) > 0
    assert all(r == "wgmma True tma True spills 0" for r in reports), reports
