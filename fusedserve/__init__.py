"""fusedserve: MLPs served on fused Triton GEMM + bias + activation kernels (``fusedserve.kernels``,
``fusedserve.models``, ``fusedserve.service``)."""

import pkgutil
from importlib.metadata import PackageNotFoundError, version as _version

# pyproject.toml holds the version; this reads it from the installed metadata. A checkout put on
# PYTHONPATH without installing it (the GPU check links the packages) has none.
try:
    __version__ = _version("fusedserve")
except PackageNotFoundError:
    __version__ = "0+unknown"

# A checkout on sys.path holds only this file and __main__.py here; the installed package (or the
# GPU check's links) holds kernels/, models/ and service/: let either portion serve the package.
__path__ = pkgutil.extend_path(__path__, __name__)
