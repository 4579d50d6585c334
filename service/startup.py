"""Loading, warming up and starting the batchers of one ``ServiceState``: the models' side of start-up,
shared by the single-process app's lifespan and the engine process of ``--workers N``."""

from __future__ import annotations

import asyncio
import gc
import logging

from fusedserve.service.batcher import Batcher
from fusedserve.service.settings import Settings
from fusedserve.service.state import ModelInfo, ServiceState
from fusedserve.service.timing import LayerSinks

log = logging.getLogger("fusedserve")


def _load_runners(settings: Settings, sink: LayerSinks) -> list:
    from fusedserve import models

    device = None if settings.device == "auto" else settings.device
    backend = None if settings.backend == "auto" else settings.backend
    loaded = models.load_repository(settings.model_repository, device=device, backend=backend)
    return [models.ModelRunner(m, max_batch_size=settings.max_batch_size, timing_sink=sink)
            for m in loaded.values()]


async def load(state: ServiceState) -> list:
    """Load every model of the repository into ``state`` (known, not yet warm); returns the runners.
    Loading errors (missing repository, bad config) raise with their message."""
    sink = LayerSinks((state.stats, state.metrics))
    runners = await asyncio.to_thread(_load_runners, state.settings, sink)
    if state.settings.torch_threads and any(r.device.type == "cpu" for r in runners):
        import torch

        # Here, on the event loop's thread: OpenMP keeps a thread count per thread, and batches run
        # on this thread (inline) or on worker threads started later, which take the new default.
        torch.set_num_threads(state.settings.torch_threads)
    for r in runners:
        state.runners[r.name] = r
        state.models[r.name] = ModelInfo(r.name, r.in_features, r.out_features, str(r.dtype).removeprefix("torch."),
                                         r.backend, str(r.device))
    return runners


async def warm_up_and_serve(state: ServiceState, runners: list) -> None:
    """Warm every runner up, then start one batcher per model; a warm-up failure is kept in
    ``state.startup_error`` (readiness says why) rather than raised."""
    try:
        for runner in runners:
            seconds = await asyncio.to_thread(runner.warmup)
            log.info("warmed up %r: %s", runner.name, seconds)
    except Exception as exc:  # readiness reports it; the process stays up to say why
        log.exception("warm-up failed")
        state.startup_error = f"{type(exc).__name__}: {exc}"
        return
    # Warm-up launches (autotuning, graph capture) are not traffic: never count them.
    state.stats.reset()
    settings = state.settings
    for runner in runners:
        batcher = Batcher(runner, max_batch_size=settings.max_batch_size, max_delay_ms=settings.max_delay_ms,
                          max_queue_rows=settings.max_queue_rows, recorders=(state.stats, state.metrics),
                          inline_batch_ms=settings.inline_ms(runner.device.type))
        batcher.start()
        state.batchers[runner.name] = batcher
    if settings.gc_freeze:
        # Everything alive now (torch, the models) lives for the whole process. Frozen, the
        # collector stops re-scanning it on every full collection: on the 2-core dev machine those
        # scans cost tens of ms each and, under 64 clients, halved throughput and set the p99.
        gc.collect()
        gc.freeze()
    state.serving = True
    log.info("ready: %s", sorted(state.batchers))


async def stop(state: ServiceState, warm: asyncio.Task) -> None:
    """End serving: cancel a warm-up still running, then stop the batchers (each answers what it queued)."""
    if not warm.done():
        warm.cancel()
    await asyncio.gather(warm, return_exceptions=True)
    state.serving = False
    await asyncio.gather(*(b.stop() for b in state.batchers.values()))
