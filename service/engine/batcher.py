"""Dynamic batching for one model, one batch at a time: the policy around ``service.engine.queue``.

A request that finds the model idle runs at once (waiting would only add latency). Requests that
arrive while a batch runs queue up; when it finishes, the next batch closes as soon as it holds
``max_batch_size`` rows or ``max_delay_ms`` after its oldest request arrived, whichever is first;
with ``quiet_ms`` > 0 also once no request has arrived for that long (an experiment, off by default:
a few closed-loop clients never fill a batch, so each of their batches waits out the whole delay).
Requests are never split or reordered; one that would overflow the batch waits for the next.

Where a batch runs: handing it to a worker thread and back costs ~0.15 ms of CPU and latency (two
thread wake-ups and the GIL changing hands), more than a small model's whole batch on the CPU
(digits: ~0.05 ms) or a CUDA graph replay. So a batch whose row count last took less than
``inline_batch_ms`` (``inf``: every batch) runs on the event loop's thread; longer ones (and any row
count not yet measured) run in the one worker thread, so the loop keeps reading requests meanwhile.
A time measured on the worker includes waiting for the GIL, which a busy event loop holds for up to
the interpreter's switch interval (5 ms): once a row count went to the worker (after its first
batch, say, or a garbage-collection pause) its times there could keep it there. So one batch in
``REMEASURE_EVERY`` of a row count on the worker runs on the loop, to measure it again.
While an inline batch runs nothing is read, so after an inline batch of several requests the next
batch fills (as behind a busy model) even from an empty queue: its requests are still arriving."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from fusedserve.kernels import rules
from fusedserve.service.engine.queue import Pending, RequestQueue
from fusedserve.service.engine.waiting import wait_answer
from fusedserve.service.errors import BatchFailed, NonFiniteOutput, NotReady, redact_paths

log = logging.getLogger(__name__)

# One batch in this many of a row count that runs on the worker thread runs on the loop instead.
REMEASURE_EVERY = 32


class Runner(Protocol):
    name: str

    def run(self, x: torch.Tensor) -> torch.Tensor: ...


class BatchRecorder(Protocol):
    def record_batch(self, model: str, rows: int, waits: list[float], compute_s: float) -> None: ...


_IDLE, _FILLING, _BUSY = "idle", "filling", "busy"  # what the batch loop is doing


class WhereToRun:
    """Whether a batch runs on the event loop's thread or the worker thread (module docstring):
    inline when its row-count bucket last took less than ``inline_batch_s`` (``inf``: always),
    and one batch in ``REMEASURE_EVERY`` of a bucket sent to the worker is measured again inline."""

    def __init__(self, inline_batch_s: float):
        self.inline_batch_s = inline_batch_s
        # Last compute seconds per bucket of row counts (the runner pads a batch to its bucket).
        self._compute_s: dict[int, float] = {}
        # Batches per row-count bucket sent to the worker since that bucket last ran on the loop.
        self._on_worker: dict[int, int] = {}

    def inline(self, bucket: int) -> bool:
        last = self._compute_s.get(bucket)
        inline = self.inline_batch_s == math.inf or (last is not None and last < self.inline_batch_s)
        if not inline and last is not None and self.inline_batch_s > 0:
            self._on_worker[bucket] = self._on_worker.get(bucket, 0) + 1
            inline = self._on_worker[bucket] >= REMEASURE_EVERY  # measure it again where it would run
        if inline:
            self._on_worker.pop(bucket, None)
        return inline

    def quick(self, bucket: int) -> bool:
        """Whether the bucket's last batch took less than ``inline_batch_s`` (no side effect)."""
        last = self._compute_s.get(bucket)
        return self.inline_batch_s == math.inf or (last is not None and last < self.inline_batch_s)

    def measured(self, bucket: int, seconds: float) -> None:
        self._compute_s[bucket] = seconds


class Batcher:
    """One model's batcher: owns its queue, ``max_batch_size`` and the delay, closes each batch (module
    docstring), runs it inline or on the worker thread (``WhereToRun``) and answers every request
    in it, with its rows of the output or with the batch's error."""

    def __init__(self, runner: Runner, *, max_batch_size: int, max_delay_ms: float,
                 max_queue_rows: int, recorders: tuple[BatchRecorder, ...] = (),
                 inline_batch_ms: float = 1.0, quiet_ms: float = 0.0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms}")
        if inline_batch_ms < 0:
            raise ValueError(f"inline_batch_ms must be >= 0, got {inline_batch_ms}")
        if quiet_ms < 0:
            raise ValueError(f"quiet_ms must be >= 0, got {quiet_ms}")
        if max_queue_rows < max_batch_size:
            raise ValueError(f"max_queue_rows ({max_queue_rows}) must be >= max_batch_size "
                             f"({max_batch_size})")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000.0
        self.quiet_s = quiet_ms / 1000.0
        self._arrivals = 0  # requests ever queued (the quiet rule watches it grow)
        self.max_queue_rows = max_queue_rows
        self._recorders = recorders
        self._queue = RequestQueue(runner.name, max_queue_rows)
        self._where = WhereToRun(inline_batch_ms / 1000.0)
        # The loop sleeps on _wake while idle (any request wakes it) or while filling a batch (only
        # a full batch, the deadline's timer or stop wake it): one wake-up per batch, not per request.
        self._wake = asyncio.Event()
        self._state = _BUSY
        self._stopping = False
        # Whether the last batch ran inline with several requests: then the next one fills (its
        # requests were sent while nothing was read), even from an empty queue.
        self._loaded = False
        self._task: asyncio.Task | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # Batches holding requests of several origins (front-end processes): proof that they merge.
        self.mixed_batches = 0
        # One thread, and the loop awaits each batch: the runner computes one batch at a time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"run-{runner.name}")

    @property
    def queued_rows(self) -> int:
        return self._queue.rows

    @property
    def inline_batch_s(self) -> float:
        return self._where.inline_batch_s

    @property
    def running(self) -> bool:
        """Whether the batch loop is alive (started and not ended)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("batcher already started")
        # Kept: on Python 3.11 each asyncio.get_running_loop() costs a getpid() system call.
        self._event_loop = asyncio.get_running_loop()
        self._task = self._event_loop.create_task(self._loop(), name=f"batcher-{self.runner.name}")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        # The loop only returns on stop; anything else is a bug that must not pass silently.
        if not task.cancelled() and task.exception() is not None:
            log.critical("the batch loop of model %r died; its requests will time out",
                         self.runner.name, exc_info=task.exception())

    async def stop(self) -> None:
        """Refuse new requests, answer every queued one, then end the loop and the worker thread."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.wait([self._task])  # a loop that died was logged by _loop_ended
        for item in self._queue.clear():  # left only by a dead loop: answer them rather than leave them hanging
            if not item.future.done():
                item.future.set_exception(NotReady(f"model {self.runner.name!r} stopped serving"))
        self._executor.shutdown(wait=True)

    async def submit(self, x: np.ndarray, timeout_s: float | None = None,
                     abandon: asyncio.Future | None = None, origin: int = 0, alone: bool = False) -> np.ndarray:
        """Queue ``x`` ([rows, in] float32) and wait for its ``[rows, out]`` output.

        ``timeout_s`` bounds the wait (DeadlineExceeded); ``abandon`` (e.g. a task that ends when the
        client disconnects) withdraws the request if it completes first (ClientGone). Either way a
        request not yet in a batch leaves the queue at once and is never computed. ``origin`` says
        who sent it (``mixed_batches``); ``alone``: the caller knows no other request was read in this
        turn of the event loop (``_lead``)."""
        if self._state is _IDLE and not self._queue and not self._loaded and not self._stopping \
                and self._where.quick(rules.bucket(x.shape[0], self.max_batch_size)):
            return await self._lead(x, origin, alone)
        item = self.put(x, origin)
        return await wait_answer(item.future, self.runner.name, timeout_s, abandon,
                                 functools.partial(self.give_up, item))

    async def _lead(self, x: np.ndarray, origin: int, alone: bool) -> np.ndarray:
        """A request that finds the model idle and quick runs its batch in its own task, as the
        batch loop would at once, without waking the loop (a task switch and an event per batch).
        Requests read in the same turn of the event loop join it (unless it is ``alone``, when the
        turn it would wait costs ~3% of a digits request at one client); later arrivals queue and
        wake the loop once this batch is done."""
        item = self._queue.put(x, self._event_loop.create_future(), origin)
        self._state = _BUSY
        try:
            if not alone:
                await asyncio.sleep(0)  # let the requests read in this turn reach the queue
            await self._execute(self._queue.take(self.max_batch_size))
        finally:
            self._state = _IDLE
            if self._queue or self._stopping:
                self._wake.set()
        return item.future.result()

    def give_up(self, item: Pending, error: Exception | None) -> None:
        """End the wait of ``item`` with ``error`` (None: cancel it); a request not yet in a batch
        leaves the queue at once and is never computed."""
        if item.future.done():
            return
        self._queue.discard(item)
        if error is None:
            item.future.cancel()
        else:
            item.future.set_exception(error)

    def put(self, x: np.ndarray, origin: int = 0, requests: int = 1) -> Pending:
        """Queue ``x`` without waiting for it, for a caller that answers by callback (the engine
        process; ``requests``: how many client requests its rows are): ``item.future`` gets the
        output or the error; ``give_up`` withdraws it."""
        if self._stopping:
            raise NotReady(f"model {self.runner.name!r} is shutting down; retry on another replica")
        if self._event_loop is None:
            raise NotReady(f"model {self.runner.name!r} is not serving yet")
        item = self._queue.put(x, self._event_loop.create_future(), origin, requests)
        self._arrivals += 1
        if self._state is _IDLE or (self._state is _FILLING and self._queue.rows >= self.max_batch_size):
            self._wake.set()
        return item

    async def _loop(self) -> None:
        idle = True
        while True:
            if not self._queue:
                if self._stopping:
                    return
                await self._sleep(_IDLE, None)
                # A request woke an idle model: run at once. But after an inline batch of several
                # requests, an empty queue only means the loop could not read the requests sent
                # meanwhile: they are arriving now, so this batch fills like one behind a busy model.
                idle = not self._loaded
                continue
            if not idle and self._queue.rows < self.max_batch_size and not self._stopping:
                # The model just finished a batch: let this one fill up to the oldest's deadline.
                await self._fill(self._queue.oldest.enqueued + self.max_delay_s)
            batch = self._queue.take(self.max_batch_size)
            idle = False
            if batch:
                await self._execute(batch)

    async def _fill(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic) or a full batch; with ``quiet_s``, also until a slice
        of that long passes with no new request."""
        if not self.quiet_s:
            return await self._sleep(_FILLING, deadline - time.monotonic())
        while self._queue.rows < self.max_batch_size and not self._stopping:
            seen = self._arrivals
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._sleep(_FILLING, min(left, self.quiet_s))
            if self._arrivals == seen:
                return

    async def _sleep(self, state: str, timeout_s: float | None) -> None:
        """Wait for ``_wake`` (set by ``put`` as ``state`` asks, or by stop), at most ``timeout_s``."""
        if timeout_s is not None and timeout_s <= 0:
            return
        self._wake.clear()
        self._state = state
        timer = None if timeout_s is None else self._event_loop.call_later(timeout_s, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            self._state = _BUSY
            if timer is not None:
                timer.cancel()

    async def _execute(self, batch: list[Pending]) -> bool:
        """Run ``batch`` and answer its requests; returns whether it ran on the event loop's thread."""
        started = time.monotonic()
        waits = [started - item.enqueued for item in batch for _ in range(item.requests)]
        x = np.concatenate([item.x for item in batch]) if len(batch) > 1 else batch[0].x
        if len(batch) > 1 and any(item.origin != batch[0].origin for item in batch):
            self.mixed_batches += 1
        rows = x.shape[0]
        bucket = rules.bucket(rows, self.max_batch_size)
        inline = self._where.inline(bucket)
        self._loaded = inline and len(batch) > 1
        try:
            if inline:
                out, compute_s = self._run(x)
            else:
                out, compute_s = await self._event_loop.run_in_executor(self._executor, self._run, x)
        except Exception as exc:  # noqa: BLE001 - every request in the batch gets it; the loop keeps serving
            log.error("model %r failed on a batch of %d rows: %s: %s", self.runner.name, rows, type(exc).__name__, exc)
            error = BatchFailed(f"model {self.runner.name!r} failed on a batch of {rows} rows: "
                                f"{type(exc).__name__}: {redact_paths(str(exc))}")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return inline
        self._where.measured(bucket, compute_s)
        # One pass over the outputs; only a batch with a NaN or Infinity looks row by row.
        bad = None if np.isfinite(out).all() else ~np.isfinite(out).all(axis=1)
        start = 0
        for item in batch:
            stop = start + item.x.shape[0]
            if not item.future.done():
                if bad is not None and bad[start:stop].any():
                    item.future.set_exception(self._non_finite(bad[start:stop]))
                else:
                    item.future.set_result(out[start:stop])
            start = stop
        # Answers first: a failing stats hook must neither hold them back nor end the batch loop.
        for recorder in self._recorders:
            try:
                recorder.record_batch(self.runner.name, rows, waits, compute_s)
            except Exception:
                log.exception("recording a batch of model %r failed", self.runner.name)
        return inline

    def _non_finite(self, bad_rows: np.ndarray) -> NonFiniteOutput:
        row = int(np.argmax(bad_rows))
        return NonFiniteOutput(f"model {self.runner.name!r} computed NaN or Infinity for row {row} of this request: "
                               "its values overflow the model's dtype; send smaller (normalized) inputs")

    def _run(self, x: np.ndarray) -> tuple[np.ndarray, float]:
        """The runner's output for ``x`` and its wall time, measured where it runs (no hand-off)."""
        t0 = time.perf_counter()
        out = self.runner.run(torch.from_numpy(x))
        seconds = time.perf_counter() - t0
        if out.ndim != 2 or out.shape[0] != x.shape[0]:
            raise RuntimeError(f"runner returned shape {tuple(out.shape)} for {x.shape[0]} input rows; "
                               "expected one output row per input row")
        return out.numpy(), seconds
