"""Triton's launcher stubs, built ahead on a machine without a GPU driver (``models.aot``): the C
module each kernel signature needs at its first launch, put into Triton's cache for the node's driver."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)


class Launchers:
    """Builds the launcher stub of each compiled kernel into Triton's cache, as its first launch on a
    GPU would (``CudaLauncher``: C source per signature, compiled by the C compiler and linked against
    the driver's ``libcuda.so.1``). Without a driver here, it links against an empty library of that
    name, kept as a dependency (``--no-as-needed``), so the node's driver serves the stub at run time.
    Nothing built is loaded here. A context manager: the compiler settings last for the block."""

    def __init__(self, workdir: Path, enabled: bool = True):
        from triton.backends.nvidia import driver as nvidia

        self._nvidia, self._workdir, self._seen, self.built = nvidia, workdir, set(), 0
        self._cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
        self.available, self._saved_env = enabled and self._cc is not None, {}

    def __enter__(self):
        if self.available:
            try:
                self._nvidia.libcuda_dirs()
            except AssertionError:  # no driver library here: link against a stand-in
                self._set_env(TRITON_LIBCUDA_PATH=str(self._stand_in()), CC=str(self._workdir / "cc"))
        return self

    def __exit__(self, *exc) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._nvidia.library_dirs.cache_clear()

    def _set_env(self, **values) -> None:
        for key, value in values.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        self._nvidia.library_dirs.cache_clear()

    def _stand_in(self) -> Path:
        """The workdir, holding an empty ``libcuda.so.1`` and a ``cc`` that keeps it as a dependency."""
        source = self._workdir / "libcuda.c"
        source.write_text("void fusedserve_libcuda_stand_in(void) {}\n")
        subprocess.run([self._cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        str(self._workdir / "libcuda.so.1"), str(source)], check=True, capture_output=True)
        wrapper = self._workdir / "cc"
        wrapper.write_text(f'#!/bin/sh\nexec "{self._cc}" -Wl,--no-as-needed "$@"\n')
        wrapper.chmod(0o755)
        return self._workdir

    def utilities(self) -> None:
        """Triton's driver module (``cuda_utils``), built once per node at its first CUDA use."""
        if self.available:
            had = hasattr(self._nvidia.CudaUtils, "instance")
            self._built_here(lambda: self._nvidia.CudaUtils())
            if not had and hasattr(self._nvidia.CudaUtils, "instance"):
                del self._nvidia.CudaUtils.instance  # half-made without a driver: never reuse it

    def __call__(self, kernel) -> None:
        if self.available and id(kernel) not in self._seen:
            self._seen.add(id(kernel))
            self._built_here(lambda: self._nvidia.CudaLauncher(kernel.src, kernel.metadata))

    def _built_here(self, build) -> None:
        """``build()`` with Triton's module loading replaced by a stand-in (the module is for the
        node's driver): a build ends once its module is in the cache, and a second kernel of the same
        signature finds it there."""
        from triton.runtime import build as builds

        load = builds._load_module_from_path
        builds._load_module_from_path = lambda name, path: object()  # (no attributes: the caller stops)
        try:
            build()
        except AttributeError:  # what the caller read off the stand-in: the module is built and cached
            pass
        except (subprocess.CalledProcessError, RuntimeError) as exc:  # the C compiler failed: kernels only
            log.warning("could not build Triton's launcher stubs (%s); kernels are compiled without them", exc)
            self.available = False
            return
        finally:
            builds._load_module_from_path = load
        self.built += 1
