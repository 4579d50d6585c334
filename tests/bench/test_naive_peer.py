"""bench/peers/naive_fastapi.py in memory (httpx.ASGITransport, lifespan run): same JSON as /infer."""

import httpx
import numpy as np
import pytest
import torch

from bench.peers.naive_fastapi import create_app
from fusedserve.models import DEFAULT_REPOSITORY, load_model

ROWS = [[float((i * 7 + r) % 17) for i in range(64)] for r in range(3)]


@pytest.fixture
async def client(monkeypatch):
    monkeypatch.setenv("NAIVE_REPOSITORY", str(DEFAULT_REPOSITORY))
    monkeypatch.setenv("NAIVE_DEVICE", "cpu")
    threads = torch.get_num_threads()
    app = create_app()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            yield c
    torch.set_num_threads(threads)  # the app sets 1 for its process; leave this one as it was


async def test_answers_infer_as_fusedserve_does(client):
    reference = load_model(DEFAULT_REPOSITORY / "digits", device="cpu", backend="torch")
    expected = reference(torch.tensor(ROWS)).tolist()
    for body in ({"model": "digits", "inputs": ROWS}, {"inputs": ROWS}):  # the model may be left out
        r = await client.post("/infer", json=body)
        assert r.status_code == 200
        assert r.json()["model"] == "digits"
        np.testing.assert_allclose(r.json()["outputs"], expected, atol=1e-5)  # the same float32 torch model


async def test_is_ready_and_refuses_an_unknown_model(client):
    assert (await client.get("/v2/health/ready")).status_code == 200
    r = await client.post("/infer", json={"model": "nope", "inputs": ROWS})
    assert r.status_code == 404 and "nope" in r.text
    assert (await client.post("/infer", json={"model": "digits"})).status_code == 422


async def test_the_onnxruntime_app_answers_infer_as_its_file_does(tmp_path, monkeypatch):
    import onnxruntime

    from bench.onnx_peer import QUICK_MODELS, export
    from bench.peers.naive_fastapi import ONNX_FILE, create_onnx_app

    name, widths, act = QUICK_MODELS[0]
    (tmp_path / name).mkdir()
    path = export(name, widths, act, tmp_path).rename(tmp_path / name / ONNX_FILE)
    monkeypatch.setenv("NAIVE_REPOSITORY", str(tmp_path))
    monkeypatch.setenv("NAIVE_DEVICE", "cuda")  # no CUDA provider in CPU builds: the app says it runs on CPU
    rows = np.random.default_rng(0).standard_normal((5, widths[0]), dtype=np.float32)
    expected = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": rows})[0]
    app = create_onnx_app()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post("/infer", json={"inputs": rows.tolist()})
            assert r.status_code == 200 and r.json()["model"] == name
            np.testing.assert_allclose(r.json()["outputs"], expected, atol=1e-6)  # the same session, one float32 file
            providers = (await c.get("/providers")).json()
            assert (await c.post("/infer", json={"model": "nope", "inputs": rows.tolist()})).status_code == 404
    available = onnxruntime.get_available_providers()
    assert providers == {name: "CUDAExecutionProvider" if "CUDAExecutionProvider" in available
                         else "CPUExecutionProvider"}
