"""What the kernels need to know about a CUDA device, read once per device, and the CUDA-graph
capture guard every capture in fusedserve uses."""

import contextlib
import functools
import gc

import torch

from fusedserve.kernels.arguments import interpreting


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block. Wrap every CUDA-graph capture in it: a
    collection mid-capture that frees a dead graph (a CUDA call not allowed while a stream
    captures) breaks the capture, and recent torch no longer collects before capturing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cuda_capability(device) -> tuple[int, int]:
    """Compute capability of CUDA ``device``. This and the two below cache torch's answers per
    device index: each torch lookup costs 10-15 us of host time, and launches ask often."""
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


def capability(device) -> tuple[int, int] | None:
    """CUDA compute capability, or None where kernels run in the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    return cuda_capability(device)


def pdl_supported(device) -> bool:
    """Whether kernels on ``device`` can be programmatic dependent launches (``griddepcontrol``):
    compute capability 9.0 or later, outside the interpreter. Our kernels launch that way wherever
    they can, so back-to-back layers do not pay a launch gap."""
    cap = capability(device)
    return cap is not None and cap[0] >= 9
