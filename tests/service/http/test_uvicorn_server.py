"""A real uvicorn (``python -m fusedserve serve``) on a free loopback port, in a subprocess stopped by PID."""

import http.client
import json
import signal
import time

import httpx
import numpy as np
import pytest

from ..conftest import IN, OUT, Server, reference, write_repository

ROWS = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -7.0], [100.0, 1.0, 1.0]], dtype=np.float32)
# Same float32 math on the same CPU in another process; batched rows may take another BLAS path.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_repository(tmp_path_factory.mktemp("repo"))


# One process, and --workers 2 (a supervisor, an engine process, two front ends): the same answers.
@pytest.fixture(scope="module", params=["1", "2"], ids=["workers1", "workers2"])
def server(repo, tmp_path_factory, request):
    s = Server(repo, tmp_path_factory.mktemp("log") / "server.log", "--max-batch-size", "16",
               "--log-format", "json", "--workers", request.param)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_infer_over_http(server, repo):
    r = httpx.post(server.url + "/infer", json={"model": "tiny", "inputs": ROWS.tolist()},
                   headers={"X-Request-ID": "req-7"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-7"
    np.testing.assert_allclose(r.json()["outputs"], reference(repo, "tiny", ROWS), rtol=RTOL, atol=ATOL)
    r = httpx.post(server.url + "/infer", json={"model": "tiny", "inputs": [[1.0]]}, timeout=10)
    assert r.status_code == 422 and "expects 3" in r.json()["error"], r.text


def test_json_access_log_names_the_request_id(server):
    r = httpx.post(server.url + "/infer", json={"model": "tiny", "inputs": ROWS.tolist()},
                   headers={"X-Request-ID": "log-me-42"}, timeout=10)
    assert r.status_code == 200, r.text
    end = time.monotonic() + 5  # the server writes its log line after answering
    while time.monotonic() < end:
        lines = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
        hits = [e for e in lines if e.get("request_id") == "log-me-42"]
        if hits:
            break
        time.sleep(0.05)
    assert hits, f"no access-log entry for the request id in:\n{server.log.read_text()[-2000:]}"
    entry = hits[0]
    assert (entry["logger"], entry["method"], entry["path"], entry["status"]) == \
        ("fusedserve.access", "POST", "/infer", 200), entry
    assert entry["duration_ms"] > 0, entry


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_unmodified_tritonclient(server, repo, binary):
    # A test dependency (pyproject's `test` extra), imported here so that a machine without it
    # (a GPU host given only the serving stack) still runs the other tests of this module.
    triton_http = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"][0]["shape"] == [-1, IN], meta
    x = triton_http.InferInput("input", list(ROWS.shape), "FP32")
    x.set_data_from_numpy(ROWS, binary_data=binary)
    result = client.infer("tiny", [x], outputs=[triton_http.InferRequestedOutput("output", binary_data=binary)])
    got = result.as_numpy("output")
    assert got.shape == (len(ROWS), OUT), got.shape
    np.testing.assert_allclose(got, reference(repo, "tiny", ROWS), rtol=RTOL, atol=ATOL,
                               err_msg=f"tritonclient ({'binary' if binary else 'JSON'}) output differs")
    with pytest.raises(InferenceServerException, match="loaded models"):
        client.infer("nope", [x])
    stats = client.get_inference_statistics("tiny")
    assert stats["model_stats"][0]["inference_count"] >= len(ROWS), stats


def test_unmodified_tritonclient_grpc(server, repo):
    triton_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    assert client.get_server_metadata().name == "fusedserve"
    meta = client.get_model_metadata("tiny")
    assert list(meta.inputs[0].shape) == [-1, IN] and list(meta.outputs[0].shape) == [-1, OUT], meta
    x = triton_grpc.InferInput("input", list(ROWS.shape), "FP32")
    x.set_data_from_numpy(ROWS)
    got = client.infer("tiny", [x], outputs=[triton_grpc.InferRequestedOutput("output")]).as_numpy("output")
    np.testing.assert_allclose(got, reference(repo, "tiny", ROWS), rtol=RTOL, atol=ATOL,
                               err_msg="tritonclient.grpc output differs")
    with pytest.raises(InferenceServerException, match="loaded models") as caught:
        client.infer("nope", [x])
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    client.close()


def test_sigterm_drain_answers_requests_on_open_connections(repo, tmp_path):
    triton_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    s = Server(repo, tmp_path / "server.log", "--drain-grace-s", "1.5")
    try:
        s.wait_ready()
        body = json.dumps({"model": "tiny", "inputs": ROWS.tolist()})
        headers = {"Content-Type": "application/json"}
        conns = [http.client.HTTPConnection("127.0.0.1", s.port, timeout=10) for _ in range(4)]
        for c in conns:  # open keep-alive connections, idle when SIGTERM comes
            c.request("POST", "/infer", body, headers)
            assert c.getresponse().read()
        probe = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        probe.request("GET", "/v2/health/ready")
        assert probe.getresponse().read()
        socks = [c.sock for c in conns]
        grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        assert grpc_client.is_server_ready()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        # gRPC refuses new calls at once (its clients retry elsewhere on UNAVAILABLE).
        with pytest.raises(InferenceServerException) as caught:
            grpc_client.is_server_live(client_timeout=5)
        assert caught.value.status() == "StatusCode.UNAVAILABLE", caught.value
        for c, sock in zip(conns, socks, strict=True):
            assert c.sock is sock, "the client reconnected: this test must reuse the idle connection"
            c.request("POST", "/infer", body, headers)
            r = c.getresponse()
            assert r.status == 200, f"during drain got {r.status} {r.read()!r}"
            assert r.getheader("connection") == "close", r.getheaders()
            assert len(json.loads(r.read())["outputs"]) == len(ROWS)
        probe.request("GET", "/v2/health/ready")
        r = probe.getresponse()
        assert r.status == 503 and json.loads(r.read())["error"] == "draining"
        # New connections are refused from the start of the drain: clients go to another replica.
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/v2/health/ready", timeout=5)
        # Every connection was told to close: the server exits without waiting out the grace.
        s.proc.wait(timeout=15)
        assert s.proc.returncode in (0, -signal.SIGTERM), s.log.read_text()
    finally:
        s.stop()
