"""Tuning after ready: a daemon thread that tunes every runner's provisional buckets one at a time
(``ModelRunner.retune``) while the runners serve, and swaps each result in between two batches.

It yields between candidates (``kernels.tuning.yielding``: a short sleep, so the serving threads
get the GIL and the GPU), tunes on a CUDA stream of its own, and logs each bucket it tunes. A
bucket whose tuning fails keeps its provisional choice (logged); ``stop()`` ends it at the next
candidate.
"""

from __future__ import annotations

import logging
import threading
import time

from fusedserve.kernels.tuning import yielding

log = logging.getLogger(__name__)


class TuningStopped(Exception):
    """Raised between two candidates once ``BackgroundTuner.stop()`` was called."""


class BackgroundTuner:
    """Tunes ``runners``' provisional buckets on one daemon thread; ``pause_s`` between candidates."""

    def __init__(self, runners, pause_s: float = 0.005):
        self.runners = list(runners)
        self.pause_s = pause_s
        self.tuned: list[tuple[str, int, float]] = []  # (model, bucket, seconds) as they finish
        self.failed: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fusedserve-tuning", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop at the next candidate and wait (at most ``timeout`` s) for the thread to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _between(self) -> None:
        if self._stop.wait(self.pause_s):
            raise TuningStopped()

    def _run(self) -> None:
        work = [(runner, bucket) for runner in self.runners for bucket in runner.provisional_buckets()]
        if not work:
            return
        log.info("background tuning: %d provisional buckets to tune (%s)", len(work),
                 ", ".join(f"{r.name} M={b}" for r, b in work))
        start = time.perf_counter()
        with yielding(self._between):
            for i, (runner, bucket) in enumerate(work, 1):
                if self._stop.is_set() or not self._tune_one(runner, bucket, i, len(work)):
                    log.info("background tuning stopped after %d of %d buckets", len(self.tuned), len(work))
                    return
        log.info("background tuning done: %d buckets tuned, %d failed, in %.1f s", len(self.tuned),
                 len(self.failed), time.perf_counter() - start)

    def _tune_one(self, runner, bucket: int, index: int, total: int) -> bool:
        """Tune one bucket; False once stopped."""
        start = time.perf_counter()
        try:
            path = runner.retune(bucket)
        except TuningStopped:
            return False
        except Exception:  # the bucket keeps serving its provisional choice
            log.warning("background tuning of %r at M=%d failed; it keeps its provisional choice", runner.name,
                        bucket, exc_info=True)
            self.failed.append((runner.name, bucket))
            return True
        seconds = time.perf_counter() - start
        self.tuned.append((runner.name, bucket, seconds))
        log.info("background tuning %d/%d: %r at M=%d tuned in %.1f s, swapped in (path %s)", index, total,
                 runner.name, bucket, seconds, path)
        return True
