"""Every kernel family, in order of preference: for a problem, the first family that offers
itself is the default before (or without) tuning, and the tuner times all that do. The vendor
library comes last: our kernels stay the default, and the library is timed against them."""

import functools
import importlib
import logging

from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.rules import Problem

log = logging.getLogger(__name__)

FAMILY_MODULES = (
    "fusedserve.kernels.triton.tiled",
    "fusedserve.kernels.triton.tma_persistent",
    "fusedserve.kernels.triton.small_m",
    "fusedserve.kernels.gluon.small_m",
    "fusedserve.kernels.gluon.stream_k",
    "fusedserve.kernels.gluon.wgmma",
    "fusedserve.kernels.gluon.ws",
    "fusedserve.kernels.triton.split_k",
    "fusedserve.kernels.triton.stream_k",
    "fusedserve.kernels.vendor.cublas",
)


@functools.cache
def families() -> tuple[KernelFamily, ...]:
    """The registered families that import here (Gluon is an optional API of Triton)."""
    found = []
    for module in FAMILY_MODULES:
        try:
            found.append(importlib.import_module(module).FAMILY)
        except ImportError:
            if ".gluon." not in module:
                raise
            log.info("kernel family %s is not available: Gluon does not import here", module, exc_info=True)
    return tuple(found)


def names() -> tuple[str, ...]:
    return tuple(f.name for f in families())


def family(name: str) -> KernelFamily:
    for f in families():
        if f.name == name:
            return f
    raise ValueError(f"kernel family must be one of {names()}, got {name!r}")


def offered(problem: Problem) -> tuple[KernelFamily, ...]:
    """The families the tuner times for ``problem``, the default first."""
    return tuple(f for f in families() if f.unfit(problem) is None and f.offered(problem))
