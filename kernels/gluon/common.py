"""What the Gluon families share: the Gluon API they are written in (imported once, here),
TMA descriptors, the grouped tile order, the dependent-launch wait, and their rule of use."""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["TORCH_TO_GL", "TensorDescriptor", "fence_async_shared", "gdc_launch_dependents_then_wait", "gl",
           "gluon", "hopper_unfit", "mbarrier", "tile_coords", "tma", "tma_descriptor", "warpgroup_mma",
           "warpgroup_mma_wait"]

TORCH_TO_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def hopper_unfit(problem) -> str | None:
    """Why a Gluon (TMA + wgmma) kernel cannot run ``problem``, or None if it can."""
    if problem.hopper_tma:
        return None
    return ("the Gluon kernels need a Hopper GPU (compute capability 9.x; unavailable here or under "
            "the interpreter), fp16/bf16, and 16-byte aligned rows")


def tma_descriptor(t, block) -> TensorDescriptor:
    """A TMA descriptor of 2-D ``t`` (a tensor or a MockTensor) in ``block`` tiles, with the
    default swizzled shared-memory layout for its dtype."""
    return TensorDescriptor.from_tensor(t, list(block), _shared_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=None)
def _shared_layout(block, dtype):
    # One per (block, dtype): building it costs ~10 us of host time, on every launch otherwise.
    return gl.NVMMASharedLayout.get_default_for(list(block), TORCH_TO_GL[dtype])


@gluon.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of ``tile`` in grouped order: GROUP_M row-tiles share each W column-tile while
    it is in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@gluon.jit
def gdc_launch_dependents_then_wait():
    """Programmatic dependent launch: let the next kernel start launching, then wait until the
    previous one has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
