"""Issue 25, model control: the KServe v2 repository extension (index, load, unload), version
folders, and a new version that warms up before it takes traffic, with no failed request while
requests keep coming during the switch."""

import asyncio

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from fusedserve import models

from ..conftest import IN, OUT, _close, _serve

ROW = [[0.5, -1.0, 2.0]]


def write_version(repository, version: str, seed: int):
    torch.manual_seed(seed)
    return models.save_model(models.MLP(models.MLPConfig(IN, (17,), OUT)), repository / "tiny" / version)


def outputs_of(path, rows):
    model = models.load_model(path, device="cpu", backend="torch")
    with torch.no_grad():
        return model(torch.tensor(rows, dtype=torch.float32)).numpy()


async def test_index_unload_and_load(client):
    assert "model_repository" in (await client.get("/v2")).json()["extensions"]
    index = (await client.post("/v2/repository/index")).json()
    assert index == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""},
                     {"name": "wide", "version": "1", "state": "READY", "reason": ""}], index
    assert (await client.post("/v2/repository/models/tiny/unload")).status_code == 200
    r = await client.post("/infer", json={"model": "tiny", "inputs": ROW})
    assert r.status_code == 503 and "unloaded" in r.json()["error"], r.text
    assert (await client.get("/v2/models/tiny/ready")).status_code == 503
    assert (await client.post("/v2/repository/index", json={"ready": True})).json() == [
        {"name": "wide", "version": "1", "state": "READY", "reason": ""}]
    assert (await client.post("/infer", json={"model": "wide", "inputs": [[1, 2, 3, 4, 5]]})).status_code == 200
    assert (await client.post("/v2/repository/models/tiny/load")).status_code == 200
    assert (await client.post("/infer", json={"model": "tiny", "inputs": ROW})).status_code == 200
    r = await client.post("/v2/repository/models/nope/load")
    assert r.status_code == 400 and "no model directory 'nope'" in r.json()["error"], r.text


async def test_a_new_version_warms_up_then_takes_over_with_no_failed_request(client, repository, monkeypatch):
    v2_path = write_version(repository, "2", seed=7)
    state = client.app.state.service
    seen_at_warmup = []
    real_warmup = models.ModelRunner.warmup

    def warmup(self):  # what requests are routed to while the new version warms up
        seen_at_warmup.append(state.models["tiny"].version)
        return real_warmup(self)

    monkeypatch.setattr(models.ModelRunner, "warmup", warmup)
    statuses, stop = [], asyncio.Event()

    async def keep_asking():
        while not stop.is_set():
            r = await client.post("/infer", json={"model": "tiny", "inputs": ROW})
            statuses.append((r.status_code, r.text if r.status_code != 200 else ""))

    load = [asyncio.create_task(keep_asking()) for _ in range(8)]
    await asyncio.sleep(0.1)
    r = await client.post("/v2/repository/models/tiny/load")
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*load)
    assert r.status_code == 200, r.text
    assert seen_at_warmup == ["1"], "the new version took traffic before it was warm"
    failed = [s for s in statuses if s[0] != 200]
    assert not failed and len(statuses) > 16, (len(statuses), failed[:3])
    meta = (await client.get("/v2/models/tiny")).json()
    assert meta["versions"] == ["2"], meta
    r = await client.post("/v2/models/tiny/versions/2/infer", json={
        "inputs": [{"name": "input", "shape": [1, IN], "datatype": "FP32", "data": ROW[0]}]})
    assert r.status_code == 200 and r.json()["model_version"] == "2", r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]).reshape(1, OUT), outputs_of(v2_path, ROW),
                               rtol=1e-5, atol=1e-6)
    assert (await client.get("/v2/models/tiny/versions/1")).status_code == 404


async def test_a_broken_new_version_leaves_the_old_one_serving(client, repository):
    path = write_version(repository, "3", seed=1)
    (path / "config.json").write_text("{not json")
    r = await client.post("/v2/repository/models/tiny/load")
    assert r.status_code == 400 and "failed to load" in r.json()["error"], r.text
    assert str(repository) not in r.text
    assert (await client.post("/infer", json={"model": "tiny", "inputs": ROW})).status_code == 200
    assert (await client.get("/v2/models/tiny")).json()["versions"] == ["1"]


async def test_model_control_over_grpc(settings):
    served = await _serve(settings)
    try:
        index = await served.triton.get_model_repository_index()
        assert [(m.name, m.version, m.state) for m in index.models] == [("tiny", "1", "READY"), ("wide", "1", "READY")]
        await served.triton.unload_model("tiny")
        assert not await served.triton.is_model_ready("tiny")
        index = await served.triton.get_model_repository_index()
        assert index.models[0].state == "UNAVAILABLE" and "unloaded" in index.models[0].reason, index
        await served.triton.load_model("tiny")
        assert await served.triton.is_model_ready("tiny")
        with pytest.raises(InferenceServerException) as caught:
            await served.triton.load_model("nope")
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and "nope" in caught.value.message()
    finally:
        await _close(served)
