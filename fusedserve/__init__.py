"""fusedserve: MLPs served on fused Triton GEMM + bias + activation kernels (``fusedserve.kernels``,
``fusedserve.models``, ``fusedserve.service``)."""

from importlib.metadata import version as _version

# pyproject.toml holds the version; this reads it from the installed metadata.
__version__ = _version("fusedserve")
