"""The rows' routes served framework-free (``service.http.hotpath``) answer exactly as the framework's
routes do, and are what serves them."""

import asyncio
import json

import numpy as np
import pytest

from fusedserve.service.http.hotpath import route

ROWS = [[0.5, -1.0, 2.0], [3.0, 0.0, -7.0]]
RAW = np.array(ROWS, dtype=np.float32).tobytes()
HEADER = (b'{"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32", "parameters": '
          b'{"binary_data_size": %d}}], "parameters": {"binary_data_output": true}}' % len(RAW))
REQUESTS = [  # (path, body, headers): answers and mistakes of every kind
    ("/infer", json.dumps({"model": "tiny", "inputs": ROWS}).encode(), {}),
    ("/infer", json.dumps({"inputs": ROWS}).encode(), {}),
    ("/infer", json.dumps({"model": "tiny", "inputs": [[1.0]]}).encode(), {}),
    ("/infer", json.dumps({"model": "nope", "inputs": ROWS}).encode(), {}),
    ("/infer", b"{not json", {}),
    ("/infer", json.dumps({"model": "tiny", "inputs": ROWS}).encode(), {"x-request-timeout-ms": "soon"}),
    ("/infer", b"x" * 2000, {}),
    ("/v2/models/tiny/infer", json.dumps({"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32",
                                                       "data": sum(ROWS, [])}]}).encode(), {}),
    ("/v2/models/tiny/versions/1/infer", HEADER + RAW, {"inference-header-content-length": str(len(HEADER))}),
    ("/v2/models/tiny/versions/7/infer", HEADER + RAW, {"inference-header-content-length": str(len(HEADER))}),
    ("/v2/models/nope/infer", b"{}", {}),
    ("/v2/models/tiny/infer", b'{"inputs": []}', {}),
]


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"max_body_bytes": 1000})


@pytest.mark.parametrize("path, body, headers", REQUESTS)
async def test_the_hot_path_answers_as_the_framework_does(client, path, body, headers):
    fast = await client.post(path, content=body, headers=headers)
    served = client.app.hot_path

    async def declined(scope, receive, send):
        return False

    client.app.hot_path = declined  # the framework's own routes
    try:
        slow = await client.post(path, content=body, headers=headers)
    finally:
        client.app.hot_path = served
    assert (fast.status_code, fast.content) == (slow.status_code, slow.content), (fast.text, slow.text)
    for name in ("content-type", "inference-header-content-length", "retry-after"):
        assert fast.headers.get(name) == slow.headers.get(name), name
    assert fast.headers["x-request-id"] and fast.headers["x-request-id"] != slow.headers["x-request-id"]


async def test_the_hot_path_serves_rows_without_the_framework_routes(client):
    client.app.router.routes[:] = [r for r in client.app.router.routes if not getattr(r, "path", "").endswith("infer")]
    r = await client.post("/infer", json={"model": "tiny", "inputs": ROWS}, headers={"x-request-id": "abc"})
    assert r.status_code == 200 and len(r.json()["outputs"]) == 2 and r.headers["x-request-id"] == "abc"
    assert (await client.post("/v2/models/tiny/infer", content=b"{}")).status_code == 422


@pytest.mark.parametrize("path, want", [
    ("/infer", ("infer", None, None)), ("/v2/models/m/infer", ("v2", "m", None)),
    ("/v2/models/m/versions/1/infer", ("v2", "m", "1")), ("/v2/models//infer", None),
    ("/v2/models/m/x/1/infer", None), ("/infer/", None), ("/v2/models/m/ready", None)])
def test_routes(path, want):
    assert route(path) == want


@pytest.mark.parametrize("others, alone", [(0, True), (2, False)])
async def test_a_request_alone_on_the_server_does_not_wait_for_others(client, monkeypatch, others, alone):
    # The HTTP protocol puts the server's requests in progress in the scope (middleware.REQUESTS);
    # a request alone there tells the engine so, and its batch need not wait a turn for others.
    from fusedserve.service.http.middleware import GONE, REQUESTS as IN_PROGRESS

    engine, seen = client.app.state.engine, []
    real = engine.infer

    async def spy(*args, **kwargs):
        seen.append(kwargs.get("alone"))
        return await real(*args, **kwargs)

    monkeypatch.setattr(engine, "infer", spy)
    body = json.dumps({"model": "tiny", "inputs": ROWS}).encode()
    scope = {"type": "http", "method": "POST", "path": "/infer", "headers": [(b"content-length", b"%d" % len(body))],
             "client": ("127.0.0.1", 5), "query_string": b"", IN_PROGRESS: set(range(1 + others)),
             GONE: asyncio.get_running_loop().create_future()}  # (as the protocol sets them)
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent = []

    async def receive():
        return next(messages, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    assert await client.app.hot_path(scope, receive, send)
    assert sent[0]["status"] == 200 and seen == [alone]
