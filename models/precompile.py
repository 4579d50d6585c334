"""Warming several runners up, with a cold start's compiling spread over worker processes.

On a fresh machine Triton's cache is empty and every provisional kernel compiles at warm-up, one
after another (seconds each). ``warm_up`` warms the first bucket that takes provisional choices in
this process; if its launches took longer than ``COLD_COMPILE_S`` (they compiled), the remaining
such buckets of every runner are compiled first by up to ``max_workers`` processes at once
(``models.tune_worker --warm``: the same provisional choices, nothing timed or captured), filling
Triton's cache, and then warmed here from it. With a warm Triton cache nothing is started. A worker
that fails only costs time: its buckets compile here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

from fusedserve.models import tune_worker

log = logging.getLogger(__name__)

# A first bucket whose launches took longer than this compiled: Triton's cache is cold.
COLD_COMPILE_S = 1.0
WORKER_TIMEOUT_S = 600


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def warm_up(runners, parallel: bool = True, max_workers: int | None = None) -> dict[str, dict[int, float]]:
    """Warm every runner (``ModelRunner.warmup``); ``{model: {bucket: seconds}}``."""
    seconds = compile_ahead(runners, max_workers) if parallel else {r.name: {} for r in runners}
    for runner in runners:
        seconds[runner.name].update(runner.warmup())
    return seconds


def compile_ahead(runners, max_workers: int | None = None) -> dict[str, dict[int, float]]:
    """Warm the first CUDA bucket that needs tuning; if its launches found Triton's cache cold,
    compile the other buckets' kernels in worker processes at once. ``{model: {bucket: seconds}}``
    of what it warmed; ``ModelRunner.warmup`` does the rest."""
    jobs = [(r, b) for r in runners if r.device.type == "cuda" for b in r.buckets if r.needs_tuning(b)]
    seconds: dict[str, dict[int, float]] = {r.name: {} for r in runners}
    if len(jobs) > 1:
        runner, bucket = jobs[0]
        seconds[runner.name][bucket] = runner.warm(bucket)
        cold = runner.startup_seconds["compile"] > COLD_COMPILE_S
        log.info("warm-up: the first bucket's launches took %.2f s: Triton's cache is %s", runner.startup_seconds[
            "compile"], "cold, compiling the rest in parallel" if cold else "warm")
        if cold:
            precompile(jobs[1:], max_workers or default_workers())
    return seconds


def split(jobs, workers: int) -> list[tuple[object, list[int]]]:
    """``[(runner, buckets), ...]``: ``jobs`` ((runner, bucket) pairs) dealt into about ``workers``
    groups of one runner each (at least one per runner), in proportion to each runner's count."""
    by_runner: dict[int, tuple[object, list[int]]] = {}
    for runner, bucket in jobs:
        by_runner.setdefault(id(runner), (runner, []))[1].append(bucket)
    groups = []
    for runner, buckets in by_runner.values():
        parts = max(1, min(len(buckets), round(workers * len(buckets) / len(jobs))))
        groups += [(runner, buckets[i::parts]) for i in range(parts)]
    return groups


def precompile(jobs, max_workers: int) -> float:
    """Compile ``jobs``' provisional kernels in worker processes, all at once; seconds it took."""
    start = time.perf_counter()
    groups = split(jobs, max_workers)
    log.info("compiling %d buckets in %d worker processes (Triton's cache is cold)", len(jobs), len(groups))
    procs = []
    for runner, buckets in groups:
        try:
            procs.append((runner, buckets, subprocess.Popen(tune_worker.argv(runner, buckets, warm=True),
                                                            stdout=subprocess.DEVNULL)))
        except OSError:
            log.warning("could not start a compile worker for %r", runner.name, exc_info=True)
    for runner, buckets, proc in procs:
        try:
            code = proc.wait(max(1.0, WORKER_TIMEOUT_S - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code:
            log.warning("the compile worker of %r (M=%s) exited with code %s; those buckets compile here",
                        runner.name, ",".join(map(str, buckets)), code)
    seconds = time.perf_counter() - start
    log.info("compile workers done in %.1f s", seconds)
    return seconds
