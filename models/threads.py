"""How many torch threads a CPU batch runs on, per bucket.

A small batch runs faster on one thread: waking the others costs more than its compute, and they
take cores from the event loop that serves requests. A large one runs faster on all of them. Each
bucket's choice comes from timing both at warm-up; torch's thread count is per OS thread, so ``use``
sets it on whichever thread runs the batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger("fusedserve")

# The threaded run must beat one thread by this factor: a tie goes to one thread, which leaves the
# other cores to the front end.
MARGIN = 0.9
ROUNDS = 3


def fastest_call(step: Callable[[], object], budget_s: float = 0.01, max_reps: int = 30) -> float:
    """Seconds of the fastest of at most ``max_reps`` calls of ``step`` (or ``budget_s``), after one
    untimed call. The fastest, not the median: other processes on the cores only ever add time."""
    step()
    best, reps, end = float("inf"), 0, time.perf_counter() + budget_s
    while reps < max_reps and (not reps or time.perf_counter() < end):
        t0 = time.perf_counter()
        step()
        best, reps = min(best, time.perf_counter() - t0), reps + 1
    return best


class CpuThreads:
    """Per bucket, 1 or ``many`` threads (torch's count on the warming thread, read once)."""

    def __init__(self):
        self.many: int | None = None
        self.by_bucket: dict[int, int] = {}

    def choose(self, bucket: int, step: Callable[[], object]) -> int:
        """Time ``step`` (one batch of ``bucket``) on 1 and on ``many`` threads; keep the faster."""
        if self.many is None:
            self.many = torch.get_num_threads()
        threads = 1
        if self.many > 1:  # rounds alternate, so drifting load on the cores hits both alike
            rounds = [(self._timed(1, step), self._timed(self.many, step)) for _ in range(ROUNDS)]
            one, many = min(r[0] for r in rounds), min(r[1] for r in rounds)
            threads = self.many if many < one * MARGIN else 1
            log.debug("bucket %d on the CPU: 1 thread %.1f us, %d threads %.1f us: %d", bucket, one * 1e6,
                      self.many, many * 1e6, threads)
        self.by_bucket[bucket] = threads
        return threads

    def use(self, bucket: int) -> None:
        """Set this thread's torch thread count for a batch of ``bucket`` (a no-op when it is set)."""
        threads = self.by_bucket.get(bucket)
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    @staticmethod
    def _timed(threads: int, step: Callable[[], object]) -> float:
        torch.set_num_threads(threads)
        with torch.no_grad():
            return fastest_call(step)
