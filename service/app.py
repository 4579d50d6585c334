"""The app factory: lifespan (load, start gRPC, warm up, batch, drain), error handlers, routers."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fusedserve.service.engine import LocalEngine
from fusedserve.service.errors import ServiceError, log_unexpected
from fusedserve.service.metrics import Metrics
from fusedserve.service.hotpath import HotPath, route
from fusedserve.service.middleware import RequestIdMiddleware, RequestIds
from fusedserve.service.repository import ModelControl, load_runner, reason, start_batcher
from fusedserve.service.routers import health, infer, metrics, repository, stats, v2
from fusedserve.service.security import Guard, GuardMiddleware
from fusedserve.service.settings import Settings
from fusedserve.service.state import LOAD_FAILED, WARMUP_FAILED, ServiceState
from fusedserve.service.stats import ServiceStats
from fusedserve.service.timing import LayerSinks

log = logging.getLogger("fusedserve")


def _load_runners(settings: Settings, failed: dict[str, str]) -> list:
    """``(runner, ModelInfo)`` per model; with ``exit_on_error`` off, a model that fails to load is
    left out and ``failed`` says why, else its error stops start-up."""
    from fusedserve import models

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


async def _warm_up(state: ServiceState, runners: list) -> list:
    """The runners that warmed up. A failure stops start-up (readiness says why) or, with
    ``exit_on_error`` off, leaves only that model out of serving."""
    warm = []
    if state.settings.parallel_compile:
        from fusedserve.models.precompile import compile_ahead

        try:
            await asyncio.to_thread(compile_ahead, runners)
        except Exception:  # not fatal: each runner's own warm-up below compiles what is missing
            log.exception("compiling ahead failed; each model compiles its own kernels")
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
    if not warm and not state.startup_error:
        state.startup_error = f"no model could be served: {state.failed}"
    return warm


async def _warm_up_and_serve(state: ServiceState, runners: list) -> None:
    start = time.perf_counter()
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
    log.info("ready after %.2f s of warm-up: %s", time.perf_counter() - start, sorted(state.batchers))
    if settings.background_tuning and any(r.provisional_buckets() for r in runners):
        from fusedserve.models.background import BackgroundTuner

        state.tuner = BackgroundTuner(runners)
        state.tuner.start()


async def _start_grpc(app: FastAPI):
    """The gRPC server on ``grpc_port`` (None when 0: off), draining with the rest of the service."""
    state: ServiceState = app.state.service
    settings = state.settings
    if not settings.grpc_port:
        return None
    from fusedserve.service.grpc_server import GrpcServer  # grpc is imported only when it serves

    server = GrpcServer(app.state.engine, settings, app.state.control)
    await server.start()
    state.drain_hooks.append(lambda: server.drain(settings.drain_grace_s))
    app.state.grpc = server
    return server


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServiceState = app.state.service
    # Loading errors (missing repository, bad config) stop start-up at once with their message.
    loaded = await asyncio.to_thread(_load_runners, state.settings, state.failed)
    runners = [runner for runner, _ in loaded]
    if state.settings.torch_threads and any(r.device.type == "cpu" for r in runners):
        import torch

        # Here, on the event loop's thread: OpenMP keeps a thread count per thread, and batches run
        # on this thread (inline) or on worker threads started later, which take the new default.
        torch.set_num_threads(state.settings.torch_threads)
    for runner, info in loaded:
        runner.timing_sink = app.state.timing_sink
        state.runners[info.name], state.models[info.name] = runner, info
    # gRPC listens from here, like HTTP: liveness and metadata now, readiness and inference once warm.
    grpc_server = await _start_grpc(app)
    # Warm-up (autotuning, CUDA graphs) can take a while: serve liveness meanwhile, readiness after.
    warm = asyncio.create_task(_warm_up_and_serve(state, runners))
    try:
        yield
    finally:
        state.start_draining()
        if grpc_server is not None:  # calls in flight are answered before the batchers stop
            await grpc_server.stop(state.settings.drain_grace_s)
        if not warm.done():
            warm.cancel()
        await asyncio.gather(warm, return_exceptions=True)
        if state.tuner is not None:  # it stops at its next candidate
            await asyncio.to_thread(state.tuner.stop)
        state.serving = False
        await asyncio.gather(*(b.stop() for b in state.batchers.values()))


def _error_response(status: int, message: str, headers=None) -> JSONResponse:
    # {"error": ...} everywhere: the Open Inference Protocol's error body, which tritonclient reads.
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    state: ServiceState = request.app.state.service
    state.metrics.record_request(getattr(request.state, "model", ""), exc.outcome)
    return _error_response(exc.status, exc.message, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return _error_response(422, "invalid request: " + "; ".join(parts))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))


def _unexpected_reporter(state: ServiceState):
    """What the middleware calls on a bug in a framework route: one log record, counted in /metrics."""

    def report(scope, exc: Exception) -> None:
        log_unexpected(log, f"{scope['method']} {scope['path']} failed", exc)
        state.metrics.unexpected.labels("http").inc()
        model = scope.get("state", {}).get("model")
        if model:  # an inference route that got as far as naming its model
            state.metrics.record_request(model, "error")

    return report


class ServiceApp(FastAPI):
    """FastAPI, with the routes that carry rows served first, framework-free (``service.hotpath``)."""

    hot_path: HotPath

    async def __call__(self, scope, receive, send):
        if not await self.hot_path(scope, receive, send):
            await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = ServiceApp(title="fusedserve", version="0.1.0", lifespan=_lifespan, **docs,
                     summary="MLPs on fused Triton GEMM + bias + activation kernels, batched on the fly")
    state = ServiceState(settings=settings, stats=ServiceStats(), metrics=Metrics())
    app.state.service = state
    app.state.engine = LocalEngine(state)  # what the front ends (HTTP inference, gRPC) ask of the models
    app.state.grpc = None  # the GrpcServer while it serves (service.grpc_server)
    app.state.timing_sink = LayerSinks((state.stats, state.metrics))
    app.state.control = ModelControl(state, app.state.timing_sink)  # the v2 repository routes
    state.metrics.watch_queues(state.batchers)  # filled once warm; /metrics reads it at each scrape
    state.metrics.watch_models(state.model_readiness)
    ids, guard = RequestIds(), Guard(settings)
    app.hot_path = HotPath(app, state, ids, guard)
    # Added first, so it runs inside the request id middleware: refusals carry an id and are logged.
    app.add_middleware(GuardMiddleware, guard=guard, is_inference=lambda path: route(path) is not None)
    app.add_middleware(RequestIdMiddleware, is_draining=lambda: state.draining, ids=ids,
                       on_error=_unexpected_reporter(state))
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for module in (infer, v2, repository, stats, health, metrics):
        app.include_router(module.router)
    return app
