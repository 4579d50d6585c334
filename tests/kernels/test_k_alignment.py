"""Rows 8 elements apart (K = 1016) are read 16 bytes at a time by the Triton kernels that load
[rows, K] operands through pointers, the fused MLP's layers included: Triton specializes an int on
divisibility by 16 alone, so without ``common.aligned`` those loads fell to 2 or 4 bytes (fp32 ran
at 0.05-0.48x cuBLAS there). Compiled for sm_90 on the CPU in a process of its own (this one's
kernels are interpreted)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedserve.kernels.triton.common import k_align

COPY_SIZES = """
import math, re, sys
import torch
from triton.runtime.jit import MockTensor
from fusedserve.kernels.triton import fused_mlp, small_m, split_k, tiled
from tools.sm90 import compile_sm90
from tools.sm90_triton import compile_launch

def fused_layer(M, N, K, dtype):
    src, w, b, dst = (MockTensor(dtype, s) for s in ([M, K], [N, K], [N], [M, N]))
    config = fused_mlp.fused_mlp_candidates(M, N, K, dtype)[0]
    meta = dict(NORMALIZE=False, ACTIVATION="relu", UPCAST_BF16=False, USE_PDL=True, STAGES=config["num_stages"],
                INPUT_PRECISION="tf32x3", K_ALIGN=math.gcd(16, K), **config)
    return compile_sm90(fused_mlp._fused_mlp_layer_kernel, (src, w, b, dst, src, src, M, N, K, K, N), meta)

modules = {"small_m": small_m, "split_k": split_k, "tiled": tiled}
for spec in sys.argv[1:]:
    name, M, K, dtype, gemv = spec.split(":")
    M, K, dtype = int(M), int(K), getattr(torch, dtype)
    if name == "fused_mlp":
        ptx = fused_layer(M, 512, K, dtype).asm["ptx"]
    else:
        module = modules[name]
        config = next(c for c in module.candidates(M, 2048, K, dtype) if bool(c.get("GEMV")) == (gemv == "gemv"))
        ptx = compile_launch(module, M, 2048, K, dtype, config, precision="tf32x3")[0].asm["ptx"]
    copies = re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^\\]]*\\], \\[[^\\]]*\\], (0x\\w+)", ptx)
    loads = re.findall(r"ld\\.global(?:\\.\\w+)*?\\.(v[24]\\.)?b(?:16|32)", ptx)
    narrow = [c for c in copies if c != "0x10"] + [v for v in loads if not v]
    print(spec, len(copies) + len(loads), len(narrow))
"""

SPECS = ["tiled:1866:1016:float32:", "split_k:300:1016:float32:", "small_m:16:1016:float32:gemv",
         "small_m:1:1016:bfloat16:gemv", "small_m:16:1016:bfloat16:", "fused_mlp:32:1016:bfloat16:",
         "fused_mlp:32:1016:float32:"]


@pytest.mark.timeout(300)
def test_operands_of_rows_8_elements_apart_are_read_16_bytes_at_a_time():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COPY_SIZES, *SPECS], env=env, capture_output=True, text=True,
                            timeout=280, check=False)
    assert result.returncode == 0, f"compile failed:\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    assert len(lines) == len(SPECS), result.stdout
    for line in lines:
        spec, reads, narrow = line.split()
        # A load or two of a bias or a single row is fine; a K loop of narrow reads is not.
        assert int(reads) > 0 and int(narrow) <= 2, f"{spec}: {narrow} of {reads} global reads narrower than 16 bytes"


def test_k_align_is_the_largest_power_of_two_up_to_16_dividing_k_and_the_row_strides():
    x = torch.empty(4, 1024)[:, :1016]  # rows 1024 apart
    w = torch.empty(8, 1016)
    assert k_align(1016, x, w) == 8
    assert k_align(1024, torch.empty(4, 1024), torch.empty(8, 1024)) == 16
    assert k_align(1016, torch.empty(4, 1020)[:, :1016], w) == 4
    assert k_align(1017, torch.empty(4, 1017), torch.empty(8, 1017)) == 1
