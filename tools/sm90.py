"""Compile our kernels for sm_90 (Hopper) without a GPU, so CI can check what they lower to.

The interpreter runs a kernel's Python, not the compiler, and Gluon kernels never run under it at
all; triton 3.6 can still compile any kernel for an explicit target from mock tensors. That route
goes through private triton APIs (the argument binder, ``_pack_args``); they change between
releases, which is why every use of them is here. Run without ``TRITON_INTERPRET`` (under it,
``@triton.jit`` kernels are interpreter objects that cannot compile).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.runtime.jit import create_function_from_signature

# Hopper: compute capability 9.0, 32 threads per warp.
SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(kernel, args, meta, source=ASTSource):
    """The CompiledKernel a launch ``kernel[grid](*args, **meta)`` on an H200 would build; ``args``
    may hold ``triton.runtime.jit.MockTensor``s (their addresses count as 16-byte aligned, and ints
    are specialized as a launch would: 1 becomes a constant, multiples of 16 are marked so).
    ``source`` is the AST source class: ``ASTSource``, or Gluon's ``GluonASTSource``.
    The result's ``.asm["ptx"]``, ``.asm["ttgir"]`` and ``.metadata.shared`` can be asserted on."""
    backend = triton.compiler.make_backend(SM90)
    options = {k: meta[k] for k in ("num_warps", "num_stages") if k in meta}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, parsed = binder(*args, **meta)
    parsed, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, parsed)
    return triton.compile(source(kernel, signature, constexprs, attrs), target=SM90, options=parsed.__dict__)


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
