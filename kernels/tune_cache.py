"""Tuned choices kept on disk, so a restarted server does not time configs again.

One JSON file per GPU model, Triton version and tuner version, in ``$FUSEDSERVE_TUNE_CACHE``
(default ``~/.cache/fusedserve``); delete it to re-tune. (Triton's own ``cache_results`` keys its
timings by compiler hash under its kernel cache, with no directory of its own to point at.)
"""

import fcntl
import functools
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import triton

log = logging.getLogger(__name__)

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


def _parse(path: Path) -> dict:
    """The file's entries ({key: config object}); ValueError or OSError if it cannot be read as such."""
    with open(path, "rb") as f:
        data = json.loads(f.read().decode("utf-8"))
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError("not a JSON object of config objects")
    return data


class TuneCache:
    """Tuned configs for one device model: in memory, backed by a JSON file that every process of
    the machine shares. A cache that cannot be read or written is a warning, never an error:
    tuning then lives in memory for this process (serving must not wait on a cache file)."""

    def __init__(self, device_name: str, directory=None):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name)
        self.path = Path(directory or cache_dir()) / f"{slug}-triton-{triton.__version__}-tuner{TUNER_VERSION}.json"
        self._lock = threading.Lock()
        self._writable = True
        self._configs = self._read()

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            return _parse(self.path)
        except (OSError, ValueError) as exc:  # JSON, UTF-8 and shape errors are all ValueError
            log.warning("tune cache %s is unreadable (%s): tuning in memory; it is rewritten at the next "
                        "tuning, or delete it", self.path, exc)
            return {}

    def reload(self) -> None:
        """Add what the file holds now (written by another process) to what this one knows."""
        with self._lock:
            self._configs = {**self._configs, **self._read()}

    def get(self, key: str):
        return self._configs.get(key)

    def put(self, key: str, config: dict) -> None:
        """Store a config, and merge it into the file under a lock shared with other processes."""
        with self._lock:
            self._configs[key] = dict(config)
            if not self._writable:
                return
            try:
                self._write_merged()
            except OSError as exc:
                self._writable = False  # said once; this process keeps its tuning in memory
                log.warning("cannot write tune cache %s (%s): tuning stays in memory for this process",
                            self.path, exc)

    def _write_merged(self) -> None:
        """Under an exclusive lock on a sidecar file: read what other processes wrote, add ours, write
        to a temporary file, fsync it, rename it over the cache (atomic), fsync the directory."""
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            try:
                on_disk = _parse(self.path) if self.path.exists() else {}
            except ValueError:  # a broken file is replaced by a good one
                on_disk = {}
            self._configs = {**on_disk, **self._configs}
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self._configs, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself survives a power cut
            finally:
                os.close(dir_fd)
