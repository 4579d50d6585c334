"""Models in and out of service: loading a model directory's served version into a runner, a
batcher per runner, and model control (the KServe v2 repository extension, as Triton's): index,
load and unload while serving. A load warms the new runner up before one request reaches it, then
swaps it in; the old batcher answers what it had queued. Versions are numbered folders of a model
directory (``<model>/<version>/``); the highest is served."""

from __future__ import annotations

import asyncio
import logging
import os

from fusedserve.service.engine.batcher import Batcher
from fusedserve.service.engine.state import LOAD_FAILED, UNLOADED, WARMUP_FAILED, ModelInfo, ServiceState
from fusedserve.service.errors import LoadFailed, NotReady, redact_paths
from fusedserve.service.settings import Settings

log = logging.getLogger("fusedserve")


def reason(exc: Exception, settings: Settings) -> str:
    """Why a model failed, for clients: paths shown relative to the model repository, never whole."""
    root = str(settings.model_repository).rstrip(os.sep) + os.sep
    return redact_paths(f"{type(exc).__name__}: {exc}".replace(root, ""))


def load_runner(settings: Settings, name: str, sink=None):
    """``(runner, ModelInfo)`` for the served (highest) version of model directory ``name``."""
    from fusedserve import models

    device = None if settings.device == "auto" else settings.device
    backend = None if settings.backend == "auto" else settings.backend
    version, path = models.latest_version(settings.model_repository / name)
    model = models.load_model(path, device=device, backend=backend, name=name)
    runner = models.ModelRunner(model, max_batch_size=settings.max_batch_size, timing_sink=sink)
    info = ModelInfo(name, runner.in_features, runner.out_features, str(runner.dtype).removeprefix("torch."),
                     runner.backend, str(runner.device), version, model.labels)
    return runner, info


def start_batcher(state: ServiceState, runner) -> Batcher:
    settings = state.settings
    batcher = Batcher(runner, max_batch_size=settings.max_batch_size, max_delay_ms=settings.max_delay_ms,
                      max_queue_rows=settings.max_queue_rows, recorders=(state.stats, state.metrics),
                      inline_batch_ms=settings.inline_ms(runner.device.type), quiet_ms=settings.batch_quiet_ms)
    batcher.start()
    return batcher


class ModelControl:
    """Index, load and unload one at a time (a lock), while the other models keep serving."""

    def __init__(self, state: ServiceState, sink):
        self._state = state
        self._sink = sink
        self._lock = asyncio.Lock()

    def names(self) -> list[str]:
        from fusedserve import models

        return [d.name for d in models.model_directories(self._state.settings.model_repository)]

    def index(self, ready_only: bool = False) -> list[dict]:
        """Every model of the repository: its served (or latest) version, state and why not ready."""
        from fusedserve import models

        state, out = self._state, []
        for name in self.names():
            info = state.models.get(name)
            if info is not None and name in state.batchers:
                out.append({"name": name, "version": info.version, "state": "READY", "reason": ""})
            elif not ready_only:
                version = models.latest_version(state.settings.model_repository / name)[0]
                out.append({"name": name, "version": version, "state": "UNAVAILABLE",
                            "reason": state.failed.get(name, "not loaded")})
        return out

    def _check(self, name: str) -> None:
        if not self._state.serving or self._state.draining:
            raise NotReady("the server is starting or draining: load and unload models once it is ready")
        if name not in self.names():
            raise LoadFailed(f"no model directory {name!r} in the repository; it has {self.names()}")

    async def load(self, name: str) -> ModelInfo:
        """Load (or reload: its latest version) model ``name``, warm it, then route requests to it."""
        async with self._lock:
            self._check(name)
            state = self._state
            try:
                runner, info = await asyncio.to_thread(load_runner, state.settings, name)
            except Exception as exc:
                raise self._failed(name, LOAD_FAILED, exc) from None
            try:
                seconds = await asyncio.to_thread(runner.warmup)
            except Exception as exc:
                raise self._failed(name, WARMUP_FAILED, exc) from None
            runner.timing_sink = self._sink  # from now on: warm-up launches are not traffic
            batcher = start_batcher(state, runner)
            old = state.batchers.get(name)
            # One step, no await: a request sees the old model or the new one, whole.
            state.runners[name], state.models[name], state.batchers[name] = runner, info, batcher
            state.failed.pop(name, None)
            log.info("model %r version %s loaded and warm (%s); serving it", name, info.version, seconds)
            if old is not None:
                await old.stop()  # answers what it had queued
            return info

    async def unload(self, name: str) -> None:
        async with self._lock:
            self._check(name)
            state = self._state
            old = state.batchers.pop(name, None)
            state.models.pop(name, None)
            state.runners.pop(name, None)
            state.failed[name] = f"{UNLOADED} by a repository request"
            log.info("model %r unloaded", name)
            if old is not None:
                await old.stop()

    def _failed(self, name: str, stage: str, exc: Exception) -> LoadFailed:
        log.exception("%s: model %r", stage, name)
        why = f"{stage}: {reason(exc, self._state.settings)}"
        if name not in self._state.models:  # a model already serving keeps serving its old version
            self._state.failed[name] = why
        return LoadFailed(f"model {name!r} {why}")
