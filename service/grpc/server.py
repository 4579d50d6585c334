"""KServe v2 gRPC (``inference.GRPCInferenceService``, the messages of ``grpc/inference.proto``) on
our own HTTP/2 connections (``service.grpc.h2``) in the HTTP app's event loop. The servicer sees only an
``Engine``; a client's mistake is answered with the status code its ``ServiceError`` names
(INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, DEADLINE_EXCEEDED) and the message, never with a crash.
ModelStreamInfer answers each request of a stream with its id (a mistake in ``error_message``, the
stream going on). Model configuration and statistics are HTTP's bodies (``http.v2_body``) as messages.
Methods not listed here (shared-memory control, trace, log settings) answer UNIMPLEMENTED; the
repository methods are ``ModelControl``'s, as over HTTP."""

from __future__ import annotations

import asyncio
import functools
import logging

from fusedserve.service import tensors
from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ModelInfo
from fusedserve.service.errors import (
    ClientGone,
    DeadlineExceeded,
    NotReady,
    NotServed,
    ServiceError,
    UnknownModel,
    log_unexpected,
)
from fusedserve.service.grpc import calls, codec, h2, h2_limits, inference_pb2 as pb, policy
from fusedserve.service.http import v2_body
from fusedserve.service.security import Guard
from fusedserve.service.settings import Settings

log = logging.getLogger("fusedserve")
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
# The name clients call it by: the protocol's package, not our messages' own (inference.proto says why).
SERVICE_PATH = f"/inference.{SERVICE.name}"
OPEN = frozenset({"ServerLive", "ServerReady"})  # answered without an API key, like HTTP's probes


def _service_error(exc: Exception, engine: Engine) -> ServiceError:
    """``exc`` itself if it is a ServiceError; anything else is a bug: logged, counted in /metrics,
    answered INTERNAL."""
    if isinstance(exc, ServiceError):
        return exc
    log_unexpected(log, "gRPC call failed", exc)
    engine.record_unexpected("grpc")
    return ServiceError("internal error; see the server log")


async def _abort(context, engine: Engine, model: str, exc: Exception):
    """Answer ``exc`` as a status: a ServiceError with its own code, anything else INTERNAL (logged)."""
    exc = _service_error(exc, engine)
    engine.record_error(model, exc.outcome)
    await context.abort(exc.grpc_code, exc.message)


def _answers_errors(method):
    """Turn a ServiceError raised by a (non-inference) method into its status code and message."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - answered as a status, never a dropped call
            await _abort(context, self._engine, "", exc)

    return wrapper


class InferenceServicer:
    """The methods of ``GRPCInferenceService`` served here, by their names in the service."""

    def __init__(self, engine: Engine, max_rows: int, timeout_s: float, control=None, max_delay_ms: float = 0.0):
        self._engine = engine
        self._control = control  # service.engine.model_control.ModelControl: the repository methods
        self._max_rows = max_rows
        self._timeout_s = timeout_s
        self._max_delay_ms = max_delay_ms  # the model configuration's dynamic batching delay
        self._server_metadata = codec.server_metadata(control is not None)

    def _known(self, name: str, version: str) -> ModelInfo:
        """A loaded model, warm or not (metadata and readiness need no warm model)."""
        models = self._engine.models()
        info = models.get(name)
        if info is None:
            if self._engine.ready():  # NotReady saying why for a model that failed, else UnknownModel
                self._engine.model(name)
            if not models:
                raise NotReady("the server is starting: no model is loaded yet")
            raise UnknownModel(f"unknown model {name!r}; loaded models: {sorted(models)}")
        tensors.check_version(info, version)
        return info

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self._engine.live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._engine.ready())

    async def ServerMetadata(self, request, context):
        return self._server_metadata

    @_answers_errors
    async def ModelReady(self, request, context):
        try:
            self._known(request.name, request.version)
        except NotReady:  # a model that failed to load or warm up: not ready (its metadata says why)
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self._engine.ready())

    @_answers_errors
    async def ModelMetadata(self, request, context):
        return codec.model_metadata(self._known(request.name, request.version))

    @_answers_errors
    async def ModelConfig(self, request, context):
        info = self._known(request.name, request.version)
        return codec.model_config(info, self._max_rows, self._max_delay_ms)

    @_answers_errors
    async def ModelStatistics(self, request, context):
        """One model's statistics, or every model's for an empty name, as Triton."""
        infos = ([self._known(request.name, request.version)] if request.name
                 else list(self._engine.models().values()))
        return codec.statistics(await v2_body.statistics(self._engine, infos))

    @_answers_errors
    async def RepositoryIndex(self, request, context):
        models = (await self._controlled(context)).index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in models])

    @_answers_errors
    async def RepositoryModelLoad(self, request, context):
        await (await self._controlled(context)).load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @_answers_errors
    async def RepositoryModelUnload(self, request, context):
        await (await self._controlled(context)).unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def _controlled(self, context):
        if self._control is None:
            raise NotServed("model control is not served here")
        return self._control

    async def ModelInfer(self, request, context):
        model = ""  # the metrics label: a loaded model's name, never the client's
        try:
            info = self._engine.model(request.model_name)
            model = info.name
            return await self._infer(request, info, context)
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed, while queued
            self._record_cancel(model, context)
            raise
        except Exception as exc:  # noqa: BLE001 - answered as a status, never a dropped call
            await _abort(context, self._engine, model, exc)

    async def ModelStreamInfer(self, requests, context):
        """Triton's stream: every request read is answered on the stream, in the order the answers
        come, with the request's id; a failed request gets ``error_message`` and the stream goes on.
        Many requests may be in flight on one stream, which costs far less per call than unary."""
        answers: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(self._read_stream(requests, context, answers))
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            reader.cancel()

    async def _read_stream(self, requests, context, answers: asyncio.Queue) -> None:
        """Start one answer per request read; put None on ``answers`` once all are in."""
        pending: set[asyncio.Task] = set()
        try:
            async for request in requests:
                task = asyncio.ensure_future(self._stream_answer(request, context, answers))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.wait(pending)
        finally:  # on a cancelled or broken stream, its requests still queued are dropped
            for task in pending:
                task.cancel()
            answers.put_nowait(None)

    async def _stream_answer(self, request, context, answers: asyncio.Queue) -> None:
        model = ""
        try:
            info = self._engine.model(request.model_name)
            model = info.name
            answers.put_nowait(pb.ModelStreamInferResponse(infer_response=await self._infer(request, info, context)))
        except asyncio.CancelledError:
            self._record_cancel(model, context)
            raise
        except Exception as exc:  # noqa: BLE001 - answered on the stream, which goes on
            exc = _service_error(exc, self._engine)
            self._engine.record_error(model, exc.outcome)
            answers.put_nowait(pb.ModelStreamInferResponse(
                error_message=exc.message,
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id)))

    async def _infer(self, request, info: ModelInfo, context):
        tensors.check_version(info, request.model_version)
        x, raw = codec.decode(request, info, self._max_rows)
        out = await self._engine.infer(info.name, x, self._timeout(request, context))
        return codec.encode(request, info, out, raw)

    def _record_cancel(self, model: str, context) -> None:
        left = context.time_remaining()
        self._engine.record_error(model, (DeadlineExceeded if left is not None and left <= 0 else ClientGone).outcome)

    def _timeout(self, request, context) -> float:
        """The server's deadline, shortened by the call's gRPC deadline and Triton's timeout parameter."""
        limit = codec.timeout_s(request, self._timeout_s)
        left = context.time_remaining()
        if left is not None and left < limit:
            if left <= 0:
                raise DeadlineExceeded("the call's deadline passed before it was queued: give it more time")
            limit = left
        return limit


def key_check(guard: Guard):
    """The HTTP API keys on gRPC (``authorization: Bearer <key>`` metadata): (method, metadata) ->
    the reason to refuse, or None. Server health stays open; repository control is an admin call."""

    def refusal(method: str, metadata: tuple) -> str | None:
        if method in OPEN:
            return None
        given = next((v for k, v in metadata if k == "authorization"), "")
        refused = guard.authorize("/v2/repository" if method.startswith("Repository") else "",
                                  given.encode("latin-1", "replace"))
        return None if refused is None else refused[1]

    return refusal


def methods(servicer: InferenceServicer) -> dict[str, calls.Method]:
    """The service's methods the servicer has, by path; any other path is answered UNIMPLEMENTED."""
    found = {}
    for method in SERVICE.methods:
        handler = getattr(servicer, method.name, None)
        if handler is not None:
            path = f"{SERVICE_PATH}/{method.name}"
            found[path] = calls.Method(method.name, getattr(pb, method.input_type.name).FromString, handler,
                                       method.client_streaming, path)
    return found


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """The gRPC front door (``service.grpc.h2`` connections): ``start`` once models are loaded, ``drain``
    on SIGTERM (GOAWAY: no new calls; calls in flight go on), ``stop`` at shutdown (what is still
    open after the grace period is cancelled)."""

    def __init__(self, engine: Engine, settings: Settings, control=None, reuse_port: bool = False):
        self.host, self.port = settings.host, settings.grpc_port
        self.address = _address(settings.host, settings.grpc_port)
        guard = Guard(settings)
        servicer = InferenceServicer(engine, settings.rows_per_request, settings.request_timeout_ms / 1000, control,
                                     settings.max_delay_ms)
        self.methods = methods(servicer)  # what h2.Connection reads: these six attributes
        self.refuse = key_check(guard) if guard.keyed else None
        self.max_message = settings.max_body_bytes
        self.limits = h2_limits.Limits.of(settings)
        self.connections: set[h2.Connection] = set()
        self.policy = policy.GrpcPolicy(settings, self.connections)  # the cap, the budget, the timers
        self.draining = False
        self._listener: asyncio.AbstractServer | None = None
        self._stopping: asyncio.Future | None = None
        self._reuse_port = reuse_port  # the front ends of --workers N share the port (the supervisor checked it free)

    async def start(self) -> None:
        # Without reuse_port (but among the front ends of --workers N) a busy port is an error, never shared.
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                lambda: h2.Connection(self), self.host, self.port, reuse_port=self._reuse_port, backlog=1024)
        except OSError as exc:
            raise RuntimeError(f"cannot listen for gRPC on {self.address} ({exc}): is the port taken? "
                               "Choose another with --grpc-port, or turn gRPC off with --grpc-port 0") from None
        self.policy.start(asyncio.get_running_loop())
        log.info("gRPC (KServe v2) on %s", self.address)

    def drain(self, grace_s: float) -> None:
        """Stop taking calls now; calls in flight get ``grace_s`` to finish, then are cancelled."""
        if self._stopping is None:
            self.draining = True
            if self._listener is not None:
                self._listener.close()
            for connection in list(self.connections):
                connection.go_away()
            self._stopping = asyncio.ensure_future(self._close_after(grace_s))

    async def _close_after(self, grace_s: float) -> None:
        end = asyncio.get_running_loop().time() + grace_s
        while any(c.streams for c in self.connections) and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            connection.close()

    async def stop(self, grace_s: float) -> None:
        self.drain(grace_s)
        await self._stopping
        self.policy.stop()
