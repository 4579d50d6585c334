"""Tuning after ready: a daemon thread that tunes every runner's provisional buckets one at a time
while the runners serve, and swaps each result in between two batches (``ModelRunner.retune``).

On CUDA the kernels are compiled ahead by processes that need no GPU (``models.aot``), bucket by
bucket, while a worker process per model (``models.tune_worker``) times each bucket once its kernels
are compiled: compiling holds the GIL for long stretches (docs/kernels.md), which in this process
would stall the batches. The worker fills the tune
cache and Triton's cache and reports each bucket; this thread then reloads the tune cache and
retunes the bucket from the caches (graphs captured, path timed, swapped). Where the worker fails,
or off CUDA (``isolate``), the thread tunes in this process, yielding between candidates
(``kernels.tuning.yielding``: a short sleep). It logs each bucket; a bucket whose tuning fails keeps
its provisional choice; ``stop()`` ends it at the next candidate (and the worker).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
import time

from fusedserve.kernels import tune_cache
from fusedserve.kernels.tuning import yielding
from fusedserve.models import aot, tune_worker

log = logging.getLogger(__name__)

# How often the busy state is polled for a tuning worker (it waits up to tune_worker.BUSY_WAIT_S).
BUSY_POLL_S = 0.01


def _log_compiled(name: str, done) -> None:
    """Log how compiling ``name``'s candidates ahead ended (``done``: its future)."""
    if done.exception() is not None:
        log.warning("compiling the tuning candidates of %r ahead failed; its tuning worker compiles them", name,
                    exc_info=done.exception())
    else:
        launches, _, seconds = done.result()
        log.info("background tuning: %d candidate launches of %r compiled in %.1f s", launches, name, seconds)


class TuningStopped(Exception):
    """Raised between two candidates once ``BackgroundTuner.stop()`` was called."""


class BackgroundTuner:
    """Tunes ``runners``' provisional buckets on one daemon thread; ``pause_s`` between candidates
    tuned in this process. ``isolate``: tune in a worker process (default: for models on CUDA).
    ``busy()``: whether serving has work waiting (rows queued); while it has, tuning waits between
    candidates, up to ``tune_worker.BUSY_WAIT_S`` each (``tune_worker.BusyGate``), so it yields the GPU to batches."""

    def __init__(self, runners, pause_s: float = 0.005, isolate: bool | None = None, busy=None):
        self.runners = list(runners)
        self.pause_s = pause_s
        self.isolate = isolate
        self.busy = busy
        self._worker: subprocess.Popen | None = None
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
        worker = self._worker
        if worker is not None and worker.poll() is None:
            worker.terminate()
        if self._thread is not None:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _between(self) -> None:
        deadline = time.monotonic() + tune_worker.BUSY_WAIT_S
        while True:
            if self._stop.wait(self.pause_s):
                raise TuningStopped()
            if self.busy is None or not self.busy() or time.monotonic() >= deadline:
                return

    def _report_busy(self, fd: int, worker: subprocess.Popen) -> None:
        """Write b"1"/b"0" to the worker's gate (``fd``) as ``busy()`` changes, until it exits."""
        last = None
        try:
            while worker.poll() is None and not self._stop.is_set():
                now = bool(self.busy())
                if now != last:
                    os.write(fd, b"1" if now else b"0")
                    last = now
                time.sleep(BUSY_POLL_S)
        except OSError:  # the worker closed its end
            pass
        finally:
            os.close(fd)

    def _run(self) -> None:
        work = [(runner, runner.provisional_buckets()) for runner in self.runners]
        work = [(runner, buckets) for runner, buckets in work if buckets]
        total = sum(len(buckets) for _, buckets in work)
        if not total:
            return
        log.info("background tuning: %d provisional buckets to tune (%s)", total,
                 "; ".join(f"{r.name} M={','.join(map(str, b))}" for r, b in work))
        start = time.perf_counter()
        with yielding(self._between):
            for runner, buckets in work:
                if not self._tune_runner(runner, buckets, total):
                    log.info("background tuning stopped after %d of %d buckets", len(self.tuned), total)
                    return
        log.info("background tuning done: %d buckets tuned, %d failed, in %.1f s", len(self.tuned),
                 len(self.failed), time.perf_counter() - start)

    def _tune_runner(self, runner, buckets: list[int], total: int) -> bool:
        """Tune one runner's ``buckets`` (in a worker where isolated); False once stopped."""
        isolate = self.isolate if self.isolate is not None else runner.device.type == "cuda"
        left = list(buckets)
        if isolate:
            with tempfile.TemporaryDirectory(prefix="fusedserve-compiled-") as directory:
                cuda = runner.device.type == "cuda"
                compiled = self._compile_candidates(runner, buckets, directory) if cuda else None
                for bucket in self._worker_buckets(runner, buckets, compiled):
                    tune_cache.reload_all()  # the worker's choices, for retune to find
                    left.remove(bucket)
                    if self._stop.is_set() or not self._tune_one(runner, bucket, total):
                        return False
            if left and not self._stop.is_set():
                log.warning("the tuning worker of %r left M=%s untuned; tuning them in this process", runner.name,
                            ",".join(map(str, left)))
        for bucket in left:
            if self._stop.is_set() or not self._tune_one(runner, bucket, total):
                return False
        return True

    def _compile_candidates(self, runner, buckets: list[int], directory: str) -> tune_worker.CompileProgress | None:
        """Start compiling every kernel the worker will time in processes that need no GPU, several at
        once (``models.aot.compile_candidates_ahead``); the worker times each bucket once its kernels
        are compiled, while the next ones compile. Where that fails the worker compiles: None."""
        try:
            progress, compiled = aot.compile_candidates_ahead(
                aot.local_target(runner.device), runner.name, runner.model.config.to_dict(), runner.max_batch_size,
                buckets, directory)
        except Exception:
            log.warning("compiling the tuning candidates of %r ahead failed; its tuning worker compiles them",
                        runner.name, exc_info=True)
            return None
        compiled.add_done_callback(lambda done: _log_compiled(runner.name, done))
        return progress

    def _worker_buckets(self, runner, buckets: list[int], compiled: tune_worker.CompileProgress | None = None):
        """Start a tuning worker for ``buckets`` (each timed once ``compiled`` says its kernels are) and
        yield each bucket it reports done."""
        argv = tune_worker.argv(runner, buckets, compiled=compiled)
        gate = os.pipe() if self.busy is not None else None
        try:
            if gate is not None:
                argv += ["--busy-fd", str(gate[0])]
            self._worker = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                            pass_fds=gate[:1] if gate else ())
        except OSError:
            log.warning("could not start the tuning worker of %r", runner.name, exc_info=True)
            for fd in gate or ():
                os.close(fd)
            return
        if gate is not None:
            os.close(gate[0])
            threading.Thread(target=self._report_busy, args=(gate[1], self._worker), daemon=True,
                             name="fusedserve-tuning-busy").start()
        if self._stop.is_set():  # stop() came while it started: it may not have seen this worker
            self._worker.terminate()
        last = time.perf_counter()
        try:
            for line in self._worker.stdout:
                word, _, value = line.strip().partition(" ")
                if word == tune_worker.TUNED and int(value) in buckets:
                    log.info("tuning worker of %r: M=%s timed in %.1f s", runner.name, value,
                             time.perf_counter() - last)
                    yield int(value)
                    last = time.perf_counter()
        finally:
            self._worker.stdout.close()
            code = self._worker.wait()
            if code and not self._stop.is_set():
                log.warning("the tuning worker of %r exited with code %s", runner.name, code)

    def _tune_one(self, runner, bucket: int, total: int) -> bool:
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
        log.info("background tuning %d/%d: %r at M=%d tuned and swapped in (%.1f s in this process, path %s)",
                 len(self.tuned) + len(self.failed), total, runner.name, bucket, seconds, path)
        return True
