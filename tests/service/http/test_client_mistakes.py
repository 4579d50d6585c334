"""Issue 25, defect 4: a client's mistake is a 4xx with ``{"error": ...}`` on the hot path and on
the framework's routes alike; a bug is a JSON 500 with the request id, counted and logged once."""

import json
import logging

import pytest
from prometheus_client import generate_latest

V2 = "/v2/models/tiny/infer"


def _v2(**fields) -> bytes:
    body = {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}], **fields}
    return json.dumps(body).encode()


DEEP = b"[" * 5000 + b"]" * 5000
MISTAKES = {  # name: (path, body, headers, status, fragment of the message)
    "ragged data": (V2, json.dumps({"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32",
                                                "data": [[1, 2, 3], [1, 2]]}]}).encode(), {}, 422, "ragged"),
    "bool shape": (V2, json.dumps({"inputs": [{"name": "input", "shape": [True, 3], "datatype": "FP32",
                                               "data": [1, 2, 3]}]}).encode(), {}, 422, "shape"),
    "list parameters": (V2, _v2(parameters=[1]), {}, 422, "parameters must be an object"),
    "string parameters": (V2, _v2(parameters="binary_data_output"), {}, 422, "parameters must be an object"),
    "string output parameters": (V2, _v2(outputs=[{"name": "output", "parameters": "binary_data"}]), {}, 422,
                                 "outputs[0].parameters must be an object"),
    "number output": (V2, _v2(outputs=[5]), {}, 422, "outputs[0] must be an object"),
    "outputs a number": (V2, _v2(outputs=5), {}, 422, '"outputs" must be a list'),
    "non-ASCII header length": (V2, _v2(), {"inference-header-content-length": "\u00b2"}, 422,
                                "Inference-Header-Content-Length"),
    "deep v2": (V2, DEEP, {}, 422, "nested too deeply"),
    "deep infer": ("/infer", DEEP, {}, 422, "nested too deeply"),
    "deep data": (V2, b'{"inputs":[{"name":"input","shape":[1,3],"datatype":"FP32","data":'
                  + b"[" * 900 + b"1" + b"]" * 900 + b"}]}", {}, 422, "nested evenly"),
    "deep inputs": ("/infer", b'{"model":"tiny","inputs":' + b"[" * 900 + b"1" + b"]" * 900 + b"}", {}, 422,
                    "nested evenly"),
}


async def _without_hot_path(client, *args, **kwargs):
    served = client.app.hot_path

    async def declined(scope, receive, send):
        return False

    client.app.hot_path = declined
    try:
        return await client.post(*args, **kwargs)
    finally:
        client.app.hot_path = served


@pytest.mark.parametrize("hot", [True, False], ids=["hot path", "framework"])
@pytest.mark.parametrize("name", MISTAKES)
async def test_client_mistakes_are_4xx_with_a_message(client, name, hot):
    path, body, headers, status, fragment = MISTAKES[name]
    headers = {k: v.encode("latin-1") for k, v in headers.items()}
    post = client.post if hot else (lambda *a, **k: _without_hot_path(client, *a, **k))
    r = await post(path, content=body, headers=headers)
    assert r.status_code == status, (name, r.status_code, r.text)
    assert fragment in r.json()["error"], (name, r.json())


def _one_bounded_error(caplog) -> logging.LogRecord:
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1, [r.getMessage()[:200] for r in records]
    message = records[0].getMessage()
    assert records[0].exc_info is None and len(message.splitlines()) < 25, message
    assert "boom" in message.splitlines()[0], message
    return records[0]


def _unexpected_count(client) -> float:
    text = generate_latest(client.app.state.service.metrics.registry).decode()
    line = [x for x in text.splitlines() if x.startswith('fusedserve_unexpected_errors_total{front_end="http"}')]
    return float(line[0].split()[-1]) if line else 0.0


async def test_a_bug_in_a_framework_route_is_a_json_500_counted_and_logged_once(client, monkeypatch, caplog):
    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(client.app.state.service.stats, "snapshot", boom)
    caplog.set_level(logging.INFO)
    r = await client.get("/kernel-stats", headers={"x-request-id": "bug-1"})
    assert r.status_code == 500 and r.json() == {"error": "internal server error; see the server log"}, r.text
    assert r.headers["x-request-id"] == "bug-1"
    _one_bounded_error(caplog)
    access = [rec for rec in caplog.records if rec.name == "fusedserve.access"]
    assert access and access[-1].status == 500, [a.getMessage() for a in access]
    assert _unexpected_count(client) == 1


async def test_a_bug_on_the_hot_path_is_a_json_500_counted_and_logged_once(client, monkeypatch, caplog):
    async def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(client.app.state.engine, "infer", boom)
    caplog.set_level(logging.INFO)
    r = await client.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]}, headers={"x-request-id": "bug-2"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "bug-2" and "error" in r.json(), r.text
    _one_bounded_error(caplog)
    assert _unexpected_count(client) == 1
    text = generate_latest(client.app.state.service.metrics.registry).decode()
    assert 'fusedserve_requests_total{model="tiny",outcome="error"} 1.0' in text
