"""What a protocol front end (the HTTP routes, the gRPC servicer) asks of the models, and nothing
more: which models there are, liveness, readiness, and ``infer`` on rows it has already decoded.

``Engine`` is the seam for splitting the service into front-end processes and one engine process:
a front end holds an ``Engine`` and never touches the batchers, the runners or ``ServiceState``.
``LocalEngine`` implements it in this process over the batchers; a remote one would move the rows
(float32 ``[n, in_features]`` in, ``[n, out_features]`` out) and the same errors across processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from fusedserve.service.errors import ServiceError
from fusedserve.service.state import ModelInfo, ServiceState


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
                    abandon: asyncio.Future | None = None) -> np.ndarray:
        """``rows`` (C-contiguous float32 ``[n, in_features]``, checked) to ``[n, out_features]``.
        Raises QueueFull, DeadlineExceeded after ``timeout_s``, ClientGone once ``abandon`` is done,
        BatchFailed, NotReady; counts the request in the stats and metrics either way."""

    def record_error(self, model: str, outcome: str) -> None:
        """Count a request the front end refused or lost (``ServiceError.outcome``) in the metrics."""


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
                    abandon: asyncio.Future | None = None) -> np.ndarray:
        state = self._state
        t0 = time.perf_counter()
        try:
            out = await state.batchers[model].submit(rows, timeout_s, abandon=abandon)
        except (ServiceError, asyncio.CancelledError):  # cancelled: a gRPC client left or its deadline passed
            state.stats.record_request(model, ok=False, seconds=time.perf_counter() - t0)
            raise
        state.stats.record_request(model, ok=True, seconds=time.perf_counter() - t0)
        state.metrics.record_request(model, "ok")
        return out

    def record_error(self, model: str, outcome: str) -> None:
        self._state.metrics.record_request(model, outcome)
