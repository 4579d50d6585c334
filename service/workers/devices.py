"""Which engine processes ``devices`` (``--devices``) asks for: one per device, each loading every model.

``auto`` keeps ``device``'s one engine unless ``device`` is auto too, in which case every visible GPU
gets one (none or one visible: a single engine that picks its device as before); ``all`` is every
visible GPU; a list names them. Each engine has a label that tells it apart in the stats and metrics:
its device, numbered (``cpu:0``, ``cpu:1``) where one device appears more than once. GPUs are counted
through the CUDA driver itself (never torch: the supervisor and the front ends do not load it), so
``CUDA_VISIBLE_DEVICES`` holds."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

from fusedserve.service.settings import Settings


@dataclass(frozen=True)
class Slot:
    label: str  # the device label of its stats and metrics
    device: str  # the engine's ``device`` setting


@functools.cache
def gpu_count() -> int:
    """GPUs the CUDA driver shows this process (0 without a driver or a GPU)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def engines(settings: Settings, gpus: Callable[[], int] = gpu_count) -> list[Slot]:
    """The engine processes to start, in order. Raises ValueError for ``all`` with no GPU visible."""
    if settings.devices == "auto":
        n = gpus() if settings.device == "auto" else 0
        entries = [f"cuda:{i}" for i in range(n)] if n > 1 else [settings.device]
    elif settings.devices == "all":
        n = gpus()
        if not n:
            raise ValueError("devices is 'all' but no GPU is visible (CUDA_VISIBLE_DEVICES, the driver): "
                             "use --devices cpu, or run where a GPU is")
        entries = [f"cuda:{i}" for i in range(n)]
    else:
        entries = settings.devices.split(",")
    seen: dict[str, int] = {}
    slots = []
    for entry in entries:
        numbered = entries.count(entry) > 1
        label = f"{entry}:{seen.get(entry, 0)}" if numbered else entry
        seen[entry] = seen.get(entry, 0) + 1
        slots.append(Slot(label, entry))
    return slots


def engine_settings(settings: Settings, slot: Slot) -> Settings:
    """One engine's settings: ``device`` (and ``devices``) its slot's."""
    return settings.model_copy(update={"device": slot.device, "devices": "auto" if slot.device == "auto"
                                       else slot.device})
