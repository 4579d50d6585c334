"""fusedserve: MLPs served on fused Triton GEMM + bias + activation kernels (``fusedserve.kernels``,
``fusedserve.models``, ``fusedserve.service``)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

# pyproject.toml holds the version; this reads it from the installed metadata. A checkout put on
# PYTHONPATH without installing it (the GPU check links the packages) has none.
try:
    __version__ = _version("fusedserve")
except PackageNotFoundError:
    __version__ = "0+unknown"
