"""Autotuning with results kept on disk, so a restarted server does not time configs again.

Tuned configs live in one JSON file per GPU model and Triton version, in the directory named by the
``FUSEDSERVE_TUNE_CACHE`` environment variable (default ``~/.cache/fusedserve``). Delete the file
to re-tune. Keys name the kernel, the batch bucket, N, K, the dtype and the fp32 dot precision.
(Triton's own ``autotune(cache_results=True)`` stores timings under Triton's kernel cache keyed by
its compiler hash, with no directory of its own to point at; hence this small store.)
"""

import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

import triton
import triton.testing
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

ENV_VAR = "FUSEDSERVE_TUNE_CACHE"


def cache_dir():
    """The directory tuned configs are written to (``$FUSEDSERVE_TUNE_CACHE`` or the default)."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "fusedserve")


def config_str(config):
    """A config dict as the short string shown in kernel stats, e.g. ``BLOCK_M=64,...,num_warps=4``."""
    return ",".join(f"{k}={v}" for k, v in config.items())


class TuneCache:
    """Tuned configs for one device model: in memory, backed by a JSON file."""

    def __init__(self, device_name, directory=None):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name)
        self.path = Path(directory or cache_dir()) / f"{slug}-triton-{triton.__version__}.json"
        self._lock = threading.Lock()
        self._configs = self._read()

    def _read(self):
        if not self.path.exists():
            return {}
        try:
            with open(self.path) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"tune cache {self.path} is not valid JSON ({e}); delete it to re-tune") from e

    def get(self, key):
        return self._configs.get(key)

    def put(self, key, config):
        """Store a config and rewrite the file atomically (a crash never leaves half a file)."""
        with self._lock:
            self._configs[key] = dict(config)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self._configs, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)


def time_configs(candidates, run):
    """Median milliseconds of ``run(config)`` for each candidate, and the fastest config.

    Configs that do not fit the GPU (too much shared memory, too many registers) are skipped
    quietly; a candidate that fails otherwise (say an optional kernel that does not build here) is
    skipped with a warning naming it, so one broken candidate cannot take the layer down. If every
    candidate fails, the last error is raised.
    """
    timings = []
    failure = None
    for config in candidates:
        try:
            ms = triton.testing.do_bench(lambda config=config: run(config), warmup=5, rep=25, return_mode="median")
        except (OutOfResources, CompileTimeAssertionFailure, PTXASError) as e:
            failure = e
            continue
        except Exception as e:
            warnings.warn(f"tuning candidate {config} failed and was skipped: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
            failure = e
            continue
        timings.append((ms, config))
    if not timings:
        raise failure
    best = min(timings, key=lambda t: t[0])[1]
    return timings, best
