"""Warming several runners up, with a cold start's compiling spread over worker processes.

On a fresh machine Triton's cache is empty and every provisional kernel compiles at warm-up, one
after another (seconds each). ``warm_up`` warms the first bucket that takes provisional choices in
this process; if its launches took longer than ``COLD_COMPILE_S`` (they compiled), the remaining
such buckets of every runner are compiled first by up to ``max_workers`` processes at once
(``models.tune_worker --warm``: the same provisional choices, nothing timed or captured), filling
Triton's cache, and then warmed here from it. With a warm Triton cache nothing is started. A worker
that fails only costs time: its buckets compile here.

The processes ``models.aot`` compiles in without a GPU (an image's kernels, tuning's candidates)
fork from one compile server (``start_compile_server``), at idle CPU priority for tuning's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import subprocess
import tempfile
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


# Compile processes that need no GPU (models.aot: an image's kernels, tuning's candidates ahead).

def run_in_pool(task, argument_lists, jobs: int, initializer) -> list:
    """``task(*arguments)`` for each of ``argument_lists`` in a pool of up to ``jobs`` fresh
    processes (forked from the compile server: no state from this one but its environment) set up by
    ``initializer``; their results in order."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(argument_lists))),
                                                mp_context=_compile_server(), initializer=_in_environment,
                                                initargs=(dict(os.environ), initializer)) as pool:
        return [f.result() for f in [pool.submit(task, *arguments) for arguments in argument_lists]]


def _compile_server():
    """The multiprocessing context whose processes fork from one server process that imported
    ``models.aot``, the compile tasks' module (torch's import took 4.7 s on a fresh GPU host, in each
    of 8 spawned processes at once); that process never initializes CUDA."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fusedserve.models.aot"])
    return context


def start_compile_server() -> None:
    """Start the compile server now, so its imports run beside this process's work and the compile
    processes started later fork in milliseconds (it lives as long as this process)."""
    from multiprocessing import forkserver

    _compile_server()
    forkserver.ensure_running()


def _in_environment(environ: dict, initializer) -> None:
    """A compile process takes the environment of the process that asked for it (the server's is
    that of its own start), then runs ``initializer``."""
    os.environ.clear()
    os.environ.update(environ)
    initializer()


def log_to_stderr() -> None:
    """A compile process's progress lines (one per bucket) on stderr, and one torch thread: its tensor
    ops stand in for GPU ones, and each of 8 processes spinning torch's threads over 16 cores took 35 s
    of CPU for a share that needs 9 s on one thread."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)


def throwaway_tune_cache() -> None:
    """A compile process for ``every_candidate`` (background tuning's, beside a serving process): an
    empty tune cache of its own, idle CPU priority, and progress lines."""
    from fusedserve.kernels import tune_cache

    os.environ[tune_cache.ENV_VAR] = tempfile.mkdtemp(prefix="fusedserve-candidates-")
    idle_priority()
    log_to_stderr()


def idle_priority() -> None:
    """Run this process, and the compilers it starts, only on CPU time the server leaves idle:
    Linux's SCHED_IDLE class, else the lowest nice. At nice 10 these compiles took throughput
    from a loaded server (docs/performance.md)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed here
        if hasattr(os, "nice"):
            os.nice(19)
