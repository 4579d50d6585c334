"""Compile the Gluon linear kernel for sm_90 without a GPU, so CI can check what it lowers to.

Gluon kernels never run under TRITON_INTERPRET, but triton 3.6 can compile them for an explicit
target from mock tensors. That route goes through private triton APIs (the binder, ``_pack_args``,
``GluonASTSource``); they change between releases, which is why they are used only here.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import MockTensor, create_function_from_signature

from kernels.gluon_linear import GluonConfig, gluon_linear_kernel, make_launch_args

# Hopper: compute capability 9.0, 32 threads per warp.
SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(M: int, N: int, K: int, dtype: torch.dtype, cfg: GluonConfig, activation: str,
                 has_bias: bool):
    """The CompiledKernel for one launch; ``.asm["ptx"]``, ``.asm["ttgir"]``, ``.metadata.shared``."""
    x2d = MockTensor(dtype, [M, K])
    weight = MockTensor(dtype, [N, K])
    y = MockTensor(dtype, [M, N])
    bias = MockTensor(torch.float32, [N]) if has_bias else None
    args, meta = make_launch_args(x2d, weight, bias, y, cfg, activation)

    backend = triton.compiler.make_backend(SM90)
    binder = create_function_from_signature(gluon_linear_kernel.signature, gluon_linear_kernel.params, backend)
    options = {"num_warps": meta["num_warps"]}
    bound, specialization, parsed = binder(*args, **meta)
    parsed, signature, constexprs, attrs = gluon_linear_kernel._pack_args(backend, options, bound,
                                                                          specialization, parsed)
    source = GluonASTSource(gluon_linear_kernel, signature, constexprs, attrs)
    return triton.compile(source, target=SM90, options=parsed.__dict__)


def ptxas_usage(compiled) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) that ptxas reports for a compiled sm_90 kernel.

    Triton runs ptxas quietly; this reruns the bundled ptxas on the PTX with ``-v`` to read them.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        result = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                                 str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True)
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register/spill line:\n{result.stderr}")
    return int(registers.group(1)), int(spills.group(1))
