"""Opt-in OpenTelemetry tracing (``--tracing on``): one server span per request, HTTP or gRPC, from its
arrival to its answer (queue wait, batch and answer inside it), continuing the caller's W3C
``traceparent``, exported over OTLP/HTTP (the standard ``OTEL_EXPORTER_OTLP_*`` and
``OTEL_SERVICE_NAME`` variables say where and as what). The span is made when the request ends, from
its start time, so nothing is open while it waits. Off (the default) a request pays one check; the SDK
comes with the ``otel`` extra (``pip install 'fusedserve[otel]'``)."""

from __future__ import annotations

import os
import time

# The spans of this process while tracing is on (``enable``), else None.
spans: Spans | None = None

# gRPC statuses that are the server's fault (OpenTelemetry's rule for server spans): the span is an error.
_GRPC_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                                 "DATA_LOSS"})
_TRACE_HEADERS = ("traceparent", "tracestate")


class Spans:
    """Makes each finished request's span with the tracer of one provider, whose exporter (OTLP/HTTP
    unless given) sends them in batches from a thread of its own."""

    def __init__(self, exporter=None):
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor = BatchSpanProcessor(OTLPSpanExporter())
        else:  # a test's in-memory exporter: each span as it ends
            processor = SimpleSpanProcessor(exporter)
        name = os.environ.get("OTEL_SERVICE_NAME", "fusedserve")
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        self.provider.add_span_processor(processor)
        self._tracer = self.provider.get_tracer("fusedserve")
        self._propagator, self._getter = TraceContextTextMapPropagator(), DefaultGetter()
        self._server, self._error = SpanKind.SERVER, Status(StatusCode.ERROR)

    def record(self, name: str, carrier: dict, started: float, attributes: dict, error: bool) -> None:
        """The span of a request that began at ``started`` (``time.perf_counter``) and ends now;
        ``carrier`` holds its trace headers, if it came with any."""
        now_ns, now = time.time_ns(), time.perf_counter()
        parent = self._propagator.extract(carrier, getter=self._getter) if carrier else None
        span = self._tracer.start_span(name, context=parent, kind=self._server, attributes=attributes,
                                       start_time=now_ns - int((now - started) * 1e9))
        if error:
            span.set_status(self._error)
        span.end(end_time=now_ns)


def http_span(scope, status: int, started: float, request_id: str) -> None:
    """The span of an HTTP request (``spans`` must be set)."""
    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
               if k in (b"traceparent", b"tracestate")}
    spans.record(f"{scope['method']} {scope['path']}", carrier, started,
                 {"http.request.method": scope["method"], "url.path": scope["path"],
                  "http.response.status_code": status, "fusedserve.request_id": request_id}, status >= 500)


def grpc_span(path: str, metadata: tuple, started: float, code: str, number: int, request_id: str) -> None:
    """The span of a gRPC call (``spans`` must be set); ``path`` is /service/method."""
    carrier = {k: v for k, v in metadata if k in _TRACE_HEADERS}
    service, _, method = path.strip("/").partition("/")
    spans.record(path.strip("/"), carrier, started,
                 {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                  "rpc.grpc.status_code": number, "fusedserve.request_id": request_id},
                 code in _GRPC_SERVER_ERRORS)


def unavailable() -> str | None:
    """Why tracing cannot be turned on here (its packages are missing), or None."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return (f"--tracing on needs OpenTelemetry's SDK and OTLP exporter ({exc.name} is missing): "
                "pip install 'fusedserve[otel]'")
    return None


def enable(exporter=None) -> Spans:
    """Turn tracing on in this process (again: a new provider); ``exporter`` replaces OTLP (tests)."""
    global spans
    why = unavailable() if exporter is None else None
    if why:
        raise RuntimeError(why)
    made = Spans(exporter)
    disable()
    spans = made
    return made


def disable() -> None:
    """Turn tracing off, sending what the exporter still holds."""
    global spans
    if spans is not None:
        spans.provider.shutdown()
    spans = None
