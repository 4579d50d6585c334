"""Loading, warming up and starting the batchers of one ``ServiceState``: the models' side of start-up,
shared by the single-process app's lifespan and the engine process of ``--workers N``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time

from fusedserve.service.engine.model_control import load_runner, reason, start_batcher
from fusedserve.service.engine.state import LOAD_FAILED, WARMUP_FAILED, ServiceState
from fusedserve.service.logs import seconds_since_start
from fusedserve.service.settings import Settings

log = logging.getLogger("fusedserve")


def _load_runners(settings: Settings, failed: dict[str, str]) -> list:
    """``(runner, ModelInfo)`` per model; with ``exit_on_error`` off, a model that fails to load is
    left out and ``failed`` says why, else its error stops start-up."""
    from fusedserve import models
    from fusedserve.kernels.choosing import SEARCH_ENV

    os.environ[SEARCH_ENV] = settings.tuning_search  # for this process's tuning and the workers it starts
    loaded = []
    for directory in models.model_directories(settings.model_repository):
        try:
            loaded.append(load_runner(settings, directory.name))
        except Exception as exc:
            if settings.exit_on_error:
                raise
            log.error("model %r failed to load; serving the others: %s", directory.name, exc)
            failed[directory.name] = f"{LOAD_FAILED}: {reason(exc, settings)}"
    return loaded


async def load(state: ServiceState, timing_sink) -> list:
    """Load every model of the repository into ``state`` (known, not yet warm); returns the runners.
    Loading errors (missing repository, bad config) raise with their message."""
    state.startup.record("engine_start")  # the command's and this process's imports and set-up
    start = time.perf_counter()
    loaded = await asyncio.to_thread(_load_runners, state.settings, state.failed)
    runners = [runner for runner, _ in loaded]
    # torch's import and the devices' set-up come with the first model
    state.startup.record("load", time.perf_counter() - start, models=len(runners))
    if state.settings.torch_threads and any(r.device.type == "cpu" for r in runners):
        import torch

        # Here, on the event loop's thread: OpenMP keeps a thread count per thread, and batches run
        # on this thread (inline) or on worker threads started later, which take the new default.
        torch.set_num_threads(state.settings.torch_threads)
    for runner, info in loaded:
        runner.timing_sink = timing_sink
        state.runners[info.name], state.models[info.name] = runner, info
    return runners


@contextlib.contextmanager
def _counting_compiles(runners: list):
    """Within the block, the names of the Triton kernels this process compiles (a miss of Triton's
    cache: what compile workers or an image's precompiled cache did not hold), in a list."""
    compiled: list[str] = []
    if not any(r.device.type == "cuda" for r in runners):
        yield compiled
        return
    from triton import knobs

    def listen(src, cache_hit, **_):
        if not cache_hit:
            compiled.append(getattr(src, "name", "?"))

    previous, knobs.compilation.listener = knobs.compilation.listener, listen
    try:
        yield compiled
    finally:
        knobs.compilation.listener = previous


async def _compile_ahead(state: ServiceState, runners: list) -> None:
    """A cold start's kernels compiled in worker processes at once (``models.precompile``)."""
    from fusedserve.models.precompile import compile_ahead

    start = time.perf_counter()
    try:
        await asyncio.to_thread(compile_ahead, runners)
    except Exception:  # not fatal: each runner's own warm-up below compiles what is missing
        log.exception("compiling ahead failed; each model compiles its own kernels")
    state.startup.record("compile", time.perf_counter() - start)


async def _warm_up(state: ServiceState, runners: list) -> list:
    """The runners that warmed up. A failure stops start-up (readiness says why) or, with
    ``exit_on_error`` off, leaves only that model out of serving."""
    warm = []
    if state.settings.parallel_compile:
        await _compile_ahead(state, runners)
    start = time.perf_counter()
    with _counting_compiles(runners) as compiled:
        for runner in runners:
            try:
                seconds = await asyncio.to_thread(runner.warmup)
            except Exception as exc:  # readiness reports it; the process stays up to say why
                log.exception("warm-up of %r failed", runner.name)
                why = reason(exc, state.settings)
                if state.settings.exit_on_error:
                    state.startup_error = why
                    return []
                state.failed[runner.name] = f"{WARMUP_FAILED}: {why}"
                state.models.pop(runner.name, None)
                state.runners.pop(runner.name, None)
                continue
            log.info("warmed up %r: %s", runner.name, seconds)
            warm.append(runner)
    split = {f"{phase}_s": round(sum(r.startup_seconds[phase] for r in warm), 3) for phase in ("compile", "capture")}
    state.startup.record("warm_up", time.perf_counter() - start, **split, kernels_compiled=len(compiled))
    if compiled:  # after compile workers or a precompiled cache, a sign that they compiled other kernels
        log.info("warm-up compiled %d kernels in this process: %s", len(compiled), sorted(set(compiled)))
    if not warm and not state.startup_error:
        state.startup_error = f"no model could be served: {state.failed}"
    return warm


async def warm_up_and_serve(state: ServiceState, runners: list) -> None:
    """Warm every runner up, then start one batcher per model and, where a bucket started on a
    provisional kernel choice, the background tuner."""
    if state.settings.background_tuning and any(r.device.type == "cuda" and r.needs_tuning(b)
                                                 for r in runners for b in r.buckets):
        from fusedserve.models import precompile

        precompile.start_compile_server()  # its imports run during warm-up; tuning's compiles fork from it
    runners = await _warm_up(state, runners)
    if not runners:
        return
    # Warm-up launches (autotuning, graph capture) are not traffic: never count them.
    state.stats.reset()
    settings = state.settings
    for runner in runners:
        state.batchers[runner.name] = start_batcher(state, runner)
    if settings.gc_freeze:
        # Everything alive now (torch, the models) lives for the whole process. Frozen, the
        # collector stops re-scanning it on every full collection: on the 2-core dev machine those
        # scans cost tens of ms each and, under 64 clients, halved throughput and set the p99.
        gc.collect()
        gc.freeze()
    state.serving = True
    state.startup.record("ready", models=sorted(state.batchers))
    log.info("ready after %.1f s since start: %s", seconds_since_start(), sorted(state.batchers))
    if settings.background_tuning and any(r.provisional_buckets() for r in runners):
        from fusedserve.models.background import BackgroundTuner

        # Tuning yields to batches: it waits between candidates while any model has rows queued.
        state.tuner = BackgroundTuner(runners, busy=lambda: any(b.queued_rows for b in state.batchers.values()))
        state.tuner.start()


async def stop(state: ServiceState, warm: asyncio.Task) -> None:
    """End serving: cancel a warm-up still running, stop the background tuner, then the batchers
    (each answers what it queued)."""
    if not warm.done():
        warm.cancel()
    await asyncio.gather(warm, return_exceptions=True)
    if state.tuner is not None:  # it stops at its next candidate
        await asyncio.to_thread(state.tuner.stop)
    state.serving = False
    await asyncio.gather(*(b.stop() for b in state.batchers.values()))
