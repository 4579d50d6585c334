"""The app factory: lifespan (load, start gRPC, warm up, batch, drain), error handlers, routers."""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fusedserve import __version__
from fusedserve.service import tracing
from fusedserve.service.engine.client import Engine, LocalEngine
from fusedserve.service.engine.state import ServiceState
from fusedserve.service.errors import ServiceError, log_unexpected
from fusedserve.service.http.hotpath import HotPath, route
from fusedserve.service.http.middleware import RequestIdMiddleware, RequestIds
from fusedserve.service.http.routes import (
    dashboard,
    health,
    infer,
    metrics,
    model_stats,
    openapi,
    repository,
    stats,
    v2,
)
from fusedserve.service.security import Guard, GuardMiddleware
from fusedserve.service.settings import Settings
from fusedserve.service.stats.sinks import LayerSinks
from fusedserve.service.workers.pool import engine_client

log = logging.getLogger("fusedserve")


async def _start_grpc(app: FastAPI):
    """The gRPC server on ``grpc_port`` (None when 0: off), draining with the rest of the service."""
    state: ServiceState = app.state.service
    settings = state.settings
    if not settings.grpc_port:
        return None
    from fusedserve.service.grpc.server import GrpcServer  # grpc is imported only when it serves

    server = GrpcServer(app.state.engine, settings, app.state.control,
                        reuse_port=app.state.engine_process is not None)
    await server.start()
    state.drain_hooks.append(lambda: server.drain(settings.drain_grace_s))
    app.state.grpc = server
    return server


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServiceState = app.state.service
    if app.state.engine_process is not None:  # a front end of --workers N: the models live elsewhere
        async with _front_end(app):
            yield
        return
    from fusedserve.service.engine import startup  # torch, the models: never in a front-end process

    runners = await startup.load(state, app.state.timing_sink)
    # gRPC listens from here, like HTTP: liveness and metadata now, readiness and inference once warm.
    grpc_server = await _start_grpc(app)
    state.startup.record("front_ends")  # HTTP (and gRPC) answer from here: liveness now, inference once warm
    # Warm-up (autotuning, CUDA graphs) can take a while: serve liveness meanwhile, readiness after.
    warm = asyncio.create_task(startup.warm_up_and_serve(state, runners))
    try:
        yield
    finally:
        state.start_draining()
        if grpc_server is not None:  # calls in flight are answered before the batchers stop
            await grpc_server.stop(state.settings.drain_grace_s)
        await startup.stop(state, warm)


@asynccontextmanager
async def _front_end(app: FastAPI):
    """A front-end process: connect to the engine process, serve gRPC if this one does, and on the
    way out answer what is in flight before the connection closes."""
    state: ServiceState = app.state.service
    engine = app.state.engine
    await engine.start()
    grpc_server = await _start_grpc(app)
    try:
        yield
    finally:
        state.start_draining()
        if grpc_server is not None:
            await grpc_server.stop(state.settings.drain_grace_s)
        await engine.close()


def _error_response(status: int, message: str, headers=None) -> JSONResponse:
    # {"error": ...} everywhere: the Open Inference Protocol's error body, which tritonclient reads.
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    request.app.state.engine.record_error(getattr(request.state, "model", ""), exc.outcome)
    return _error_response(exc.status, exc.message, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return _error_response(422, "invalid request: " + "; ".join(parts))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))


def _unexpected_reporter(engine: Engine):
    """What the middleware calls on a bug in a framework route: one log record, counted in /metrics
    (by the engine: a front end's own registry is never scraped under --workers N)."""

    def report(scope, exc: Exception) -> None:
        log_unexpected(log, f"{scope['method']} {scope['path']} failed", exc)
        engine.record_unexpected("http")
        model = scope.get("state", {}).get("model")
        if model:  # an inference route that got as far as naming its model
            engine.record_error(model, "error")

    return report


class ServiceApp(FastAPI):
    """FastAPI, with the routes that carry rows served first, framework-free (``service.http.hotpath``)."""

    hot_path: HotPath

    async def __call__(self, scope, receive, send):
        if not await self.hot_path(scope, receive, send):
            await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None, engine_process: str | dict[str, str] | None = None) -> FastAPI:
    """The app; ``engine_process`` (the engine's Unix socket path, or ``{device label: path}`` of one
    engine per device) makes it a front end of ``--workers N`` whose models live in those processes;
    its gRPC port is shared (SO_REUSEPORT) with the others."""
    settings = settings or Settings()
    if settings.tracing:  # a span per request from this front end, over OTLP (service.tracing)
        tracing.enable()
    # /docs and /redoc are our own page (routes.openapi), not the framework's, which loads from a CDN.
    docs = {"docs_url": None, "redoc_url": None, **({} if settings.docs else {"openapi_url": None})}
    app = ServiceApp(title="fusedserve", version=__version__, lifespan=_lifespan, **docs,
                     summary="MLPs on fused Triton GEMM + bias + activation kernels, batched on the fly")
    app.openapi = functools.partial(openapi.document, app)  # our schemas and {"error": ...} answers
    state = ServiceState.fresh(settings)
    app.state.service = state
    # What the front ends (HTTP inference, gRPC) ask of the models: here, or in the engine process.
    app.state.engine = LocalEngine(state) if engine_process is None else engine_client(engine_process, state)
    app.state.engine_process = engine_process
    app.state.grpc = None  # the GrpcServer while it serves (service.grpc.server)
    app.state.timing_sink = LayerSinks((state.stats, state.metrics))
    # The v2 repository routes; a front end of --workers N has no models to control.
    app.state.control = None
    if engine_process is None:
        from fusedserve.service.engine.model_control import ModelControl  # torch: never in a front-end process

        app.state.control = ModelControl(state, app.state.timing_sink)
    state.metrics.watch_queues(state.batchers)  # filled once warm; /metrics reads it at each scrape
    state.metrics.watch_models(state.model_readiness)
    ids, guard = RequestIds(), Guard(settings)
    app.hot_path = HotPath(app, state, ids, guard)
    # Added first, so it runs inside the request id middleware: refusals carry an id and are logged.
    app.add_middleware(GuardMiddleware, guard=guard, is_inference=lambda path: route(path) is not None)
    app.add_middleware(RequestIdMiddleware, is_draining=lambda: state.draining, ids=ids,
                       on_error=_unexpected_reporter(app.state.engine))
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for module in (infer, v2, repository, stats, health, metrics, model_stats, dashboard):
        app.include_router(module.router)
    if settings.docs:
        app.include_router(openapi.router)
    return app
