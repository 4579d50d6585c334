"""The app factory: lifespan (load, start gRPC, warm up, batch, drain), error handlers, routers."""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fusedserve.service.batcher import Batcher
from fusedserve.service.engine import LocalEngine
from fusedserve.service.errors import ServiceError
from fusedserve.service.metrics import Metrics
from fusedserve.service.hotpath import HotPath
from fusedserve.service.middleware import RequestIdMiddleware, RequestIds
from fusedserve.service.routers import dashboard, health, infer, metrics, model_stats, stats, v2
from fusedserve.service.settings import Settings
from fusedserve.service.state import ModelInfo, ServiceState
from fusedserve.service.stats import ServiceStats
from fusedserve.service.timing import LayerSinks

log = logging.getLogger("fusedserve")


def _load_runners(settings: Settings, sink: LayerSinks) -> list:
    from fusedserve import models

    device = None if settings.device == "auto" else settings.device
    backend = None if settings.backend == "auto" else settings.backend
    loaded = models.load_repository(settings.model_repository, device=device, backend=backend)
    return [models.ModelRunner(m, max_batch_size=settings.max_batch_size, timing_sink=sink)
            for m in loaded.values()]


async def _warm_up_and_serve(state: ServiceState, runners: list) -> None:
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


async def _start_grpc(app: FastAPI):
    """The gRPC server on ``grpc_port`` (None when 0: off), draining with the rest of the service."""
    state: ServiceState = app.state.service
    settings = state.settings
    if not settings.grpc_port:
        return None
    from fusedserve.service.grpc_server import GrpcServer  # grpc is imported only when it serves

    server = GrpcServer(app.state.engine, settings)
    await server.start()
    state.drain_hooks.append(lambda: server.drain(settings.drain_grace_s))
    app.state.grpc = server
    return server


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServiceState = app.state.service
    # Loading errors (missing repository, bad config) stop start-up at once with their message.
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


class ServiceApp(FastAPI):
    """FastAPI, with the routes that carry rows served first, framework-free (``service.hotpath``)."""

    hot_path: HotPath

    async def __call__(self, scope, receive, send):
        if not await self.hot_path(scope, receive, send):
            await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = ServiceApp(title="fusedserve", version="0.1.0", lifespan=_lifespan,
                  summary="MLPs on fused Triton GEMM + bias + activation kernels, batched on the fly")
    service_stats = ServiceStats()  # its outcome counts hear every request /metrics counts
    state = ServiceState(settings=settings, stats=service_stats,
                         metrics=Metrics(on_request=service_stats.record_outcome))
    app.state.service = state
    app.state.engine = LocalEngine(state)  # what the front ends (HTTP inference, gRPC) ask of the models
    app.state.grpc = None  # the GrpcServer while it serves (service.grpc_server)
    state.metrics.watch_queues(state.batchers)  # filled once warm; /metrics reads it at each scrape
    ids = RequestIds()
    app.hot_path = HotPath(app, state, ids)
    app.add_middleware(RequestIdMiddleware, is_draining=lambda: state.draining, ids=ids)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for module in (infer, v2, stats, health, metrics, model_stats, dashboard):
        app.include_router(module.router)
    return app
