"""Opt-in OpenTelemetry: a request's traceparent continues into one server span (HTTP and gRPC), a
real server exports its spans over OTLP/HTTP, and with tracing off (the default) none is made."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as triton_grpc

from fusedserve.service import tracing
from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings

from .conftest import IN, Server

# The otel extra (the test extra brings it); a host without it, such as the GPU check's, skips these.
ExportTraceServiceRequest = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2").ExportTraceServiceRequest
InMemorySpanExporter = pytest.importorskip(
    "opentelemetry.sdk.trace.export.in_memory_span_exporter").InMemorySpanExporter

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.enable(exporter)
    yield exporter
    tracing.disable()


def _continues(span) -> bool:
    return (f"{span.context.trace_id:032x}", span.parent and f"{span.parent.span_id:016x}") == (TRACE, PARENT)


async def test_an_http_request_continues_its_traceparent(client, exported):
    r = await client.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]},
                          headers={"traceparent": TRACEPARENT, "x-request-id": "r-1"})
    assert r.status_code == 200, r.text
    await client.get("/v2/health/live")  # no traceparent: a root span of its own
    spans = {s.name: s for s in exported.get_finished_spans()}
    infer = spans["POST /infer"]
    assert _continues(infer), infer
    assert infer.attributes["http.response.status_code"] == 200 and infer.attributes["fusedserve.request_id"] == "r-1"
    assert infer.end_time > infer.start_time
    assert spans["GET /v2/health/live"].parent is None


async def test_a_grpc_call_continues_its_traceparent(served, exported):
    x = triton_grpc.InferInput("input", [1, IN], "FP32")
    x.set_data_from_numpy(np.ones((1, IN), dtype=np.float32))
    await served.triton.infer("tiny", [x], headers={"traceparent": TRACEPARENT})
    span = next(s for s in exported.get_finished_spans() if s.name.endswith("/ModelInfer"))
    assert span.name == "inference.GRPCInferenceService/ModelInfer" and _continues(span), span
    assert (span.attributes["rpc.system"], span.attributes["rpc.grpc.status_code"]) == ("grpc", 0)


def test_tracing_is_off_unless_asked(settings):
    assert Settings().tracing is False
    create_app(settings)
    assert tracing.spans is None


class _Collector(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.requests.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(120)
def test_a_server_exports_its_spans_over_otlp(repository, tmp_path, monkeypatch):
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    collector.requests = []
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "digits-test")
    server = Server(repository, tmp_path / "server.log", "--tracing", "on")
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]},
                       headers={"traceparent": TRACEPARENT}, timeout=10)
        assert r.status_code == 200, r.text
    finally:
        server.stop()  # the exporter sends what it holds as the process exits
        collector.shutdown()
    spans = []
    for path, body in collector.requests:
        assert path == "/v1/traces", path
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
            assert any(a.value.string_value == "digits-test" for a in resource.resource.attributes)
            spans += [s for scope in resource.scope_spans for s in scope.spans]
    infer = [s for s in spans if s.name == "POST /infer"]
    assert infer, (collector.requests, server.log.read_text()[-2000:])
    assert (infer[0].trace_id.hex(), infer[0].parent_span_id.hex()) == (TRACE, PARENT)
