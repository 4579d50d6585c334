"""Issue 25, defects 5 and 6: non-finite weights are refused at load, non-finite outputs are never
answered 200, and with ``exit_on_error`` off one bad model leaves the others serving while it says
why it is not ready (v2 ready and metadata routes, /metrics)."""

import grpc
import httpx
import pytest
from safetensors.torch import load_file, save_file
from tritonclient.grpc import service_pb2 as pb

from fusedserve import models
from fusedserve.service.app import create_app
from fusedserve.service.cli import parser, settings_from_args

from ..conftest import _close, _serve, wait_ready


def _poison(repository, name="wide", tensor="layers.0.weight"):
    path = repository / name / "model.safetensors"
    tensors = load_file(path)
    tensors[tensor][0, 0] = float("nan")
    save_file(tensors, path)


async def test_outputs_that_overflow_are_an_error_not_nulls(settings, repository):
    # Finite weights of 1e30 times finite inputs of 1e10 overflow float32 in the hidden layer.
    path = repository / "tiny" / "model.safetensors"
    tensors = load_file(path)
    tensors["layers.0.weight"] *= 1e30
    save_file(tensors, path)
    app = create_app(settings)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c:
        await wait_ready(c)
        big = [1e10, -1e10, 1e10]
        r = await c.post("/infer", json={"model": "tiny", "inputs": [[0.0, 0.0, 0.0], big]})
        assert r.status_code == 422 and "NaN or Infinity for row 1" in r.json()["error"], r.text
        r = await c.post("/v2/models/tiny/infer", json={"inputs": [{"name": "input", "shape": [1, 3],
                                                                     "datatype": "FP32", "data": big}]})
        assert r.status_code == 422 and "NaN or Infinity" in r.json()["error"], r.text
        assert (await c.post("/infer", json={"model": "tiny", "inputs": [[0.0, 0.0, 0.0]]})).status_code == 200
        assert 'outcome="non_finite_output"} 2.0' in (await c.get("/metrics")).text


async def test_a_bad_model_stops_start_up_by_default(settings, repository):
    _poison(repository)
    app = create_app(settings)
    with pytest.raises(ValueError, match="'layers.0.weight' holds 1 NaN"):
        async with app.router.lifespan_context(app):
            pass


async def _serving(settings):
    app = create_app(settings.model_copy(update={"exit_on_error": False}))
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")


async def test_without_exit_on_error_the_others_serve_and_the_bad_one_says_why(settings, repository):
    _poison(repository)
    app, c = await _serving(settings)
    async with app.router.lifespan_context(app), c:
        await wait_ready(c)
        assert (await c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]})).status_code == 200
        for r in (await c.get("/v2/models/wide/ready"), await c.get("/v2/models/wide"),
                  await c.post("/infer", json={"model": "wide", "inputs": [[1, 2, 3, 4, 5]]})):
            assert r.status_code == 503 and "failed to load" in r.json()["error"], r.text
            assert "'layers.0.weight' holds 1 NaN" in r.json()["error"], r.text
            assert str(repository) not in r.text, "an error body names a path of the server's disk"
        assert (await c.get("/v2/models/tiny/ready")).json()["ready"] is True
        metrics = (await c.get("/metrics")).text
        for line in ('fusedserve_model_ready{model="tiny"} 1.0', 'fusedserve_model_ready{model="wide"} 0.0',
                     'fusedserve_model_failed{model="wide",stage="load"} 1.0'):
            assert line in metrics, line


async def test_without_exit_on_error_a_failed_warm_up_leaves_the_others_serving(settings, held_warmup):
    held_warmup.fail = "wide"
    held_warmup.release.set()
    app, c = await _serving(settings)
    async with app.router.lifespan_context(app), c:
        await wait_ready(c)
        r = await c.get("/v2/models/wide/ready")
        assert r.status_code == 503 and "warm-up failed: RuntimeError: autotune exploded" in r.json()["error"], r.text
        assert (await c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]})).status_code == 200
        assert 'fusedserve_model_failed{model="wide",stage="warmup"} 1.0' in (await c.get("/metrics")).text


def test_exit_on_error_flag():
    assert settings_from_args(parser().parse_args(["serve", "--exit-on-error", "false"])).exit_on_error is False
    assert settings_from_args(parser().parse_args(["serve"])).exit_on_error is True


async def test_without_exit_on_error_grpc_says_the_bad_model_is_not_ready(settings, repository):
    _poison(repository)
    served = await _serve(settings.model_copy(update={"exit_on_error": False}))
    try:
        assert not (await served.stub.ModelReady(pb.ModelReadyRequest(name="wide"))).ready
        assert (await served.stub.ModelReady(pb.ModelReadyRequest(name="tiny"))).ready
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.ModelMetadata(pb.ModelMetadataRequest(name="wide"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "layers.0.weight" in caught.value.details()
    finally:
        await _close(served)


@pytest.mark.timeout(60)
async def test_a_version_folder_that_is_no_decimal_number_is_ignored(settings, repository, caplog):
    # "²" is a digit to str.isdigit() but no version: int() refuses it. It must not stop start-up
    # or the repository routes; the model keeps serving its decimal versions.
    for folder in ("²", "٣"):  # a superscript two, an Arabic-Indic three
        models.save_model(models.MLP(models.MLPConfig(5, (7,), 4)), repository / "wide" / folder)
    models.save_model(models.MLP(models.MLPConfig(5, (7,), 4)), repository / "wide" / "2")
    app, c = await _serving(settings)
    async with app.router.lifespan_context(app), c:
        await wait_ready(c)
        assert (await c.post("/infer", json={"model": "wide", "inputs": [[1, 2, 3, 4, 5]]})).status_code == 200
        r = await c.post("/v2/repository/index")
        assert r.status_code == 200, r.text
        assert {m["name"]: (m["version"], m["state"]) for m in r.json()} == {
            "tiny": ("1", "READY"), "wide": ("2", "READY")}, r.json()
        r = await c.post("/v2/repository/models/wide/load")
        assert r.status_code == 200, r.text
        assert (await c.get("/v2/models/wide")).json()["versions"] == ["2"]
    warned = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert any("'²'" in m and "wide" in m for m in warned), warned
