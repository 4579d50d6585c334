"""Tuned choices kept on disk, so a restarted server does not time configs again.

One JSON file per GPU model, Triton version and tuner version, in ``$FUSEDSERVE_TUNE_CACHE``
(default ``~/.cache/fusedserve``); delete it to re-tune. (Triton's own ``cache_results`` keys its
timings by compiler hash under its kernel cache, with no directory of its own to point at.)
"""

import functools
import json
import os
import re
import tempfile
import threading
from pathlib import Path

import triton

ENV_VAR = "FUSEDSERVE_TUNE_CACHE"
# Part of the file name: bumped when candidates or the timing method change, so choices made by an
# older tuner are not reused (their files stay, unread).
TUNER_VERSION = 13


def cache_dir() -> Path:
    """The directory tuned configs are written to (``$FUSEDSERVE_TUNE_CACHE`` or the default)."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "fusedserve")


@functools.cache
def device_cache(device_name: str) -> "TuneCache":
    """The one ``TuneCache`` of this process for a device model (every kernel family shares it)."""
    _device_names.add(device_name)
    return TuneCache(device_name)


def reload_all() -> None:
    """Read every device cache of this process again from its file (another process, a tuning
    worker, may have added choices since)."""
    for name in list(_device_names):
        device_cache(name).reload()


_device_names: set[str] = set()


class TuneCache:
    """Tuned configs for one device model: in memory, backed by a JSON file."""

    def __init__(self, device_name: str, directory=None):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name)
        self.path = Path(directory or cache_dir()) / f"{slug}-triton-{triton.__version__}-tuner{TUNER_VERSION}.json"
        self._lock = threading.Lock()
        self._configs = self._read()

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            with open(self.path) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"tune cache {self.path} is not valid JSON ({e}); delete it to re-tune") from e

    def reload(self) -> None:
        """Add what the file holds now (written by another process) to what this one knows."""
        with self._lock:
            self._configs = {**self._configs, **self._read()}

    def get(self, key: str):
        return self._configs.get(key)

    def put(self, key: str, config: dict) -> None:
        """Store a config and rewrite the file atomically (a crash never leaves half a file)."""
        with self._lock:
            self._configs[key] = dict(config)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self._configs, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
