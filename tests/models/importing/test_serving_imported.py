"""Imported models served: a skl2onnx pipeline and a torch module answer over HTTP and gRPC as their
source framework does, and the classifier's labels come back through the classification extension
(Triton's "score:index:label" strings) and /infer's top_k, in one process and behind --workers 2."""

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as triton_grpc
import tritonclient.http as triton_http

from fusedserve.models import from_onnx, from_torch
from fusedserve.service.settings import Settings

from ...service.conftest import Server, _close, _serve, wait_ready
from .conftest import skl2onnx_file

pytestmark = pytest.mark.timeout(180)
LABELS = ["setosa", "versicolor", "virginica"]


@pytest.fixture
def repository(tmp_path, pipeline, sources):
    from_onnx(skl2onnx_file(pipeline.model, pipeline.x, tmp_path / "iris.onnx"), tmp_path / "repo" / "iris")
    from_torch(sources.scaled, tmp_path / "repo" / "scaled")
    return tmp_path / "repo"


def expected_strings(probabilities: np.ndarray, k: int) -> list[list[str]]:
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [[f"{p[i]:f}:{i}:{LABELS[i]}" for i in row] for p, row in zip(probabilities, order, strict=True)]


async def test_http_and_grpc_answer_as_the_source_with_classes(repository, pipeline, sources):
    settings = Settings(model_repository=repository, device="cpu", max_batch_size=8, gc_freeze=False)
    served = await _serve(settings)
    x = pipeline.x[:5]
    want = pipeline.model.predict_proba(x)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(served.app), base_url="http://localhost") as client:
            await wait_ready(client)
            r = await client.post("/infer", json={"model": "iris", "inputs": x.tolist(), "top_k": 2})
            assert r.status_code == 200, r.text
            # float64 scikit-learn against our float32 model: a few float32 roundings of probabilities.
            np.testing.assert_allclose(r.json()["outputs"], want, rtol=1e-4, atol=1e-6)
            best = [row[0] for row in r.json()["classes"]]
            assert [c["label"] for c in best] == [LABELS[i] for i in want.argmax(1)], best
            body = {"inputs": [{"name": "input", "shape": [5, 6], "datatype": "FP32", "data": x.ravel().tolist()}],
                    "outputs": [{"name": "output", "parameters": {"classification": 3}}]}
            r = await client.post("/v2/models/iris/infer", json=body)
            out = r.json()["outputs"][0]
            assert out["datatype"] == "BYTES" and out["shape"] == [5, 3], out
            got = [s.split(":") for s in out["data"]]
            assert [[int(i), label] for _, i, label in got] == \
                [[int(s.split(":")[1]), s.split(":")[2]] for row in expected_strings(want, 3) for s in row]
            np.testing.assert_allclose([float(score) for score, _, _ in got], np.sort(want, 1)[:, ::-1].ravel(),
                                       atol=2e-6)  # (six decimals, as Triton writes them)
            r = await client.post("/infer", json={"model": "iris", "inputs": x.tolist(), "top_k": 4})
            assert r.status_code == 422 and "from 1 to 3" in r.json()["error"], r.text
        inputs = triton_grpc.InferInput("input", list(x.shape), "FP32")
        inputs.set_data_from_numpy(x)
        result = await served.triton.infer("iris", [inputs], outputs=[triton_grpc.InferRequestedOutput("output",
                                                                                                      class_count=1)])
        top = [s.decode().split(":") for s in result.as_numpy("output").ravel()]
        assert [label for _, _, label in top] == [LABELS[i] for i in want.argmax(1)], top
        rows = (x - 100).astype(np.float32)
        inputs = triton_grpc.InferInput("input", list(rows.shape), "FP32")
        inputs.set_data_from_numpy(rows)
        result = await served.triton.infer("scaled", [inputs])
        with torch.no_grad():
            want_scaled = sources.scaled(torch.from_numpy(rows)).numpy()
        np.testing.assert_allclose(result.as_numpy("output"), want_scaled, rtol=1e-5, atol=1e-6)
    finally:
        await _close(served)


@pytest.mark.timeout(240)
def test_front_end_processes_know_the_labels(repository, pipeline, tmp_path):
    server = Server(repository, tmp_path / "server.log", "--workers", "2")
    try:
        server.wait_ready()
        x = pipeline.x[:4]
        client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
        inputs = triton_http.InferInput("input", list(x.shape), "FP32")
        inputs.set_data_from_numpy(x)
        result = client.infer("iris", [inputs], outputs=[triton_http.InferRequestedOutput("output", class_count=2)])
        got = [[s.decode() for s in row] for row in result.as_numpy("output")]
        want = expected_strings(pipeline.model.predict_proba(x), 2)
        assert [[s.split(":", 1)[1] for s in row] for row in got] == [[s.split(":", 1)[1] for s in row] for row in want]
        assert "classification" in client.get_server_metadata()["extensions"]
    finally:
        server.stop()
