"""Pieces every Triton kernel family here shares: programmatic dependent launch (PDL), the
tensor-core step and its float32 precision."""

import contextlib
import functools
import gc
import os

import torch
import triton
import triton.language as tl

from fusedserve.kernels.arguments import interpreting


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (as it was before, after it). Wrap every
    CUDA-graph capture in it: a collection that runs mid-capture and frees a dead CUDA graph (or
    anything else whose teardown is a CUDA call not allowed while a stream captures) breaks the
    capture, and recent torch no longer collects on entering ``torch.cuda.graph`` (only with
    ``torch.compiler.config.force_cudagraph_gc``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cuda_capability(device) -> tuple[int, int]:
    """Compute capability of CUDA ``device``. This and the two below read torch's device facts once
    per device index: torch's lookups cost 10-15 us of host time each, and an eager
    ``fused_linear`` call used to make five of them."""
    return _capability(_index(device))


def cuda_name(device) -> str:
    """Name of CUDA ``device`` (the tune cache is kept per GPU model)."""
    return _name(_index(device))


def cuda_sm_count(device) -> int:
    """Streaming multiprocessors of CUDA ``device``."""
    return _sm_count(_index(device))


def _index(device):
    # A bare "cuda" means the current device, as it does to torch.
    device = torch.device(device)
    return torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index


@functools.cache
def _capability(index):
    return tuple(torch.cuda.get_device_capability(index))


@functools.cache
def _name(index):
    return torch.cuda.get_device_name(index)


@functools.cache
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def forget_devices():
    """Drop the device facts read so far (for tests that pretend a GPU is present)."""
    for cached in (_capability, _name, _sm_count):
        cached.cache_clear()


def pdl_supported(device) -> bool:
    """Whether kernels on ``device`` can be programmatic dependent launches (``griddepcontrol``):
    CUDA compute capability 9.0 or later, outside the interpreter. The Triton kernels are launched
    that way wherever it is supported, so back-to-back layers do not pay a launch gap."""
    device = torch.device(device)
    return device.type == "cuda" and not interpreting() and cuda_capability(device)[0] >= 9


FP32_PRECISION_ENV = "FUSEDSERVE_FP32_PRECISION"
FP32_PRECISIONS = ("tf32x3", "ieee")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype`` (16-bit dots ignore it).

    float32 follows torch's accuracy: "tf32" (10-bit mantissas) only where
    ``torch.backends.cuda.matmul.allow_tf32`` allows it. Otherwise results must be as accurate as
    torch's exact-fp32 SGEMM, and ``FUSEDSERVE_FP32_PRECISION`` says how: "tf32x3" (the default:
    each operand split into a TF32 high part and a TF32 remainder, three tensor-core products
    summed in fp32; on the H200 its error against float64 was 0.2-1.9x SGEMM's at every shape of
    ``bench/fp32_precision.py``, while 1.1-6.5x faster than CUDA-core products) or "ieee" (exact fp32
    products on the CUDA cores, as SGEMM computes them). The interpreter computes exact fp32
    products whatever is asked; "ieee" keys its tuning."""
    if dtype != torch.float32:
        return "tf32"
    if interpreting():
        return "ieee"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    choice = os.environ.get(FP32_PRECISION_ENV, "tf32x3")
    if choice not in FP32_PRECISIONS:
        raise ValueError(f"{FP32_PRECISION_ENV} must be one of {FP32_PRECISIONS}, got {choice!r}")
    return choice


@triton.jit
def launch_dependents_then_wait():
    """In a programmatic dependent launch: let the next kernel on the stream start launching now,
    then wait until the previous one has finished (its writes visible) before reading anything it
    may have written. Every kernel before it waited the same way, so all earlier work is done."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


@triton.jit
def dot_acc(acc, a, b, INPUT_PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr):
    """``acc + a @ b`` on the tensor cores (fp32 tiles under the interpreter, whose bf16 tl.dot is
    wrong while its fp32 one is right)."""
    if UPCAST_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
