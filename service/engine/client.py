"""What a protocol front end (the HTTP routes, the gRPC servicer) asks of the models, and nothing
more: which models there are, liveness, readiness, and ``infer`` on rows it has already decoded.

``Engine`` is the seam for splitting the service into front-end processes and one engine process:
a front end holds an ``Engine`` and never touches the batchers, the runners or ``ServiceState``.
``LocalEngine`` implements it in this process over the batchers; ``service.workers.remote.RemoteEngine``
moves the rows (float32 ``[n, in_features]`` in, ``[n, out_features]`` out), the same errors and the
stats across processes (``--workers N``)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
from prometheus_client import generate_latest

from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.engine.waiting import deadline
from fusedserve.service.errors import ServiceError
from fusedserve.service.stats.model_stats import snapshot


class Engine(Protocol):
    def models(self) -> Mapping[str, ModelInfo]:
        """Every loaded model by name (known while warming up, before ``ready``)."""

    def live(self) -> bool:
        """False once a model's batch loop died: only a restart helps."""

    def ready(self) -> bool:
        """Warm, every batch loop running, not draining: requests will be answered."""

    def model(self, name: str | None) -> ModelInfo:
        """The model to run (``None``: the only one); raises NotReady, UnknownModel or BadInput."""

    async def infer(self, model: str, rows: np.ndarray, timeout_s: float,
                    abandon: asyncio.Future | None = None, alone: bool = False) -> np.ndarray:
        """``rows`` (C-contiguous float32 ``[n, in_features]``, checked) to ``[n, out_features]``.
        Raises QueueFull, DeadlineExceeded after ``timeout_s``, ClientGone once ``abandon`` is done,
        BatchFailed, NotReady; counts the request in the stats and metrics either way. ``alone``: the
        caller knows no other request can join this one's batch now (``Batcher.submit``)."""

    def record_error(self, model: str, outcome: str) -> None:
        """Count a request the front end refused or lost (``ServiceError.outcome``) in the metrics."""

    def record_unexpected(self, where: str) -> None:
        """Count a request front end ``where`` ("http", "grpc") answered with an internal error (a bug)."""

    def failed(self) -> Mapping[str, str]:
        """Models that failed to load or warm up (or were unloaded), and why."""

    def reason(self) -> str:
        """Why it is not ready or not live, for the probes' ``error`` field."""

    async def kernel_stats(self) -> dict:
        """The ``GET /kernel-stats`` body: layer timings, batch sizes, queue waits, served models."""

    async def reset_stats(self) -> None:
        """Clear every timing and histogram (``POST /kernel-stats/reset``)."""

    async def metrics_text(self) -> bytes:
        """``GET /metrics`` in the Prometheus text format."""

    async def model_stats(self) -> dict:
        """``GET /model-stats``: per model request rate, latency, queue depth, errors by status."""

    async def model_counts(self, model: str) -> dict:
        """``ServiceStats.model_counts`` of one model, for the v2 statistics route."""


class LocalEngine:
    """``Engine`` over this process's ``ServiceState``: its batchers, stats and metrics."""

    def __init__(self, state: ServiceState):
        self._state = state

    def models(self) -> Mapping[str, ModelInfo]:
        return self._state.models

    def live(self) -> bool:
        return not self._state.stalled

    def ready(self) -> bool:
        return self._state.ready

    def model(self, name: str | None) -> ModelInfo:
        return self._state.model(name)

    async def infer(self, model: str, rows: np.ndarray, timeout_s: float,
                    abandon: asyncio.Future | None = None, alone: bool = False, origin: int = 0) -> np.ndarray:
        state = self._state
        t0 = time.perf_counter()
        try:
            out = await state.batchers[model].submit(rows, timeout_s, abandon=abandon, origin=origin, alone=alone)
        except (ServiceError, asyncio.CancelledError):  # cancelled: a gRPC client left or its deadline passed
            state.stats.record_request(model, ok=False, seconds=time.perf_counter() - t0)
            raise
        seconds = time.perf_counter() - t0
        state.stats.record_request(model, ok=True, seconds=seconds)
        state.metrics.record_request(model, "ok")
        state.metrics.record_duration(model, seconds)
        return out

    def submit(self, model: str, rows: np.ndarray, timeout_s: float, answer: Callable, origin: int = 0,
               requests: int = 1) -> Callable:
        """``infer`` with no task or coroutine per request, for the engine process: queues ``rows`` (of
        ``requests`` client requests, one group of a front end) and calls ``answer(out, None)`` or
        ``answer(None, error)`` once, unless withdrawn first by calling what this returns. Raises
        QueueFull or NotReady at once."""
        state = self._state
        batcher = state.batchers[model]
        t0 = time.perf_counter()
        try:
            item = batcher.put(rows, origin, requests)
        except ServiceError:
            state.stats.record_request(model, ok=False, seconds=time.perf_counter() - t0, count=requests)
            raise
        give_up = functools.partial(batcher.give_up, item)
        timer = deadline(item.future, model, timeout_s, give_up)

        def done(future: asyncio.Future) -> None:
            timer.cancel()
            ok = not future.cancelled() and future.exception() is None
            seconds = time.perf_counter() - t0
            state.stats.record_request(model, ok=ok, seconds=seconds, count=requests)
            if ok:
                state.metrics.record_request(model, "ok", requests)
                state.metrics.record_duration(model, seconds, requests)
                answer(future.result(), None)
            elif not future.cancelled():  # cancelled: withdrawn, the front end already answered its client
                answer(None, future.exception())

        item.future.add_done_callback(done)
        return functools.partial(give_up, None)

    def record_error(self, model: str, outcome: str) -> None:
        self._state.metrics.record_request(model, outcome)

    def record_unexpected(self, where: str) -> None:
        self._state.metrics.unexpected.labels(where).inc()

    def reason(self) -> str:
        return self._state.reason

    def failed(self) -> Mapping[str, str]:
        return self._state.failed

    async def kernel_stats(self) -> dict:
        state = self._state
        state.collect_timings()
        snap = state.stats.snapshot()
        snap["served"] = {
            name: {"in_features": m.in_features, "out_features": m.out_features, "dtype": m.dtype,
                   "backend": m.backend, "device": m.device,
                   "layer_timings": _timing_policy(state.runners[name]), **_choices(state.runners[name])}
            for name, m in state.models.items()}
        snap["startup"] = state.startup.snapshot()  # each start-up phase's seconds, and when it ended
        return snap

    async def reset_stats(self) -> None:
        self._state.collect_timings()  # finished launches from before the reset must not show up after it
        self._state.stats.reset()

    async def metrics_text(self) -> bytes:
        self._state.collect_timings()
        return generate_latest(self._state.metrics.registry)

    async def model_counts(self, model: str) -> dict:
        return self._state.stats.model_counts(model)

    async def model_stats(self) -> dict:
        return snapshot(self._state)


def _choices(runner) -> dict:
    """Per bucket whether its kernels run a provisional choice (not timed yet), a tuned one, or a
    fixed one (nothing is timed there); and how warm-up's seconds split."""
    return {"choices": {str(bucket): state for bucket, state in runner.choice_states.items()},
            "startup_s": {phase: round(s, 3) for phase, s in runner.startup_seconds.items()}}


def _timing_policy(runner) -> dict:
    """How the runner times layers, so a reader knows whether ``calls`` counts every batch."""
    if runner.device.type == "cuda" and not runner.cuda_graphs:
        return {"sampled": False, "every_batch": True, "method": runner.timing_method}
    # Graph replays hide single kernels, and on the CPU a timed batch's records cost more than a
    # small model's compute: only some batches are timed layer by layer.
    return {"sampled": True, "every_batch": False, "method": runner.timing_method,
            "sample_every": runner.timing_sample_every,
            "min_interval_s": runner.timing_min_interval_s,
            "rule": "first batch of each bucket, then at most one batch in sample_every per bucket, "
                    "and at most one per min_interval_s"}
