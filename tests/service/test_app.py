"""The app in memory (httpx.ASGITransport) with its lifespan run: routes, errors, batching, limits."""

import asyncio
import gc
import json
import threading

import httpx
import numpy as np
import pytest

from fusedserve import models
from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings

from .conftest import IN, OUT, reference, wait_ready

ROWS = [[0.5, -1.0, 2.0], [3.0, 0.0, -7.0], [1.0, 1.0, 1.0]]
# Same float32 math on the same CPU, but batched rows may take another BLAS path: allow rounding.
RTOL, ATOL = 1e-5, 1e-6


async def test_infer_matches_the_model(client, repository):
    r = await client.post("/infer", json={"model": "tiny", "inputs": ROWS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny"
    np.testing.assert_allclose(body["outputs"], reference(repository, "tiny", ROWS), rtol=RTOL, atol=ATOL,
                               err_msg="/infer outputs differ from the model's own forward")


async def test_model_may_be_omitted_only_when_one_is_loaded(client, tmp_path, repository):
    r = await client.post("/infer", json={"inputs": ROWS})
    assert r.status_code == 422 and "tiny" in r.json()["error"] and "wide" in r.json()["error"], r.text
    one = tmp_path / "one"
    models.save_model(models.load_model(repository / "tiny"), one / "tiny")
    app = create_app(Settings(model_repository=one, device="cpu", gc_freeze=False))
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c):
        await wait_ready(c)
        r = await c.post("/infer", json={"inputs": ROWS[:1]})
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "tiny", "inputs": [[1.0, 2.0]]}, 422, "expects 3"),
    ({"model": "tiny", "inputs": [[1.0, 2.0, 3.0, 4.0]]}, 422, "have 4 values"),
    ({"model": "nope", "inputs": ROWS}, 404, "loaded models: ['tiny', 'wide']"),
    ({"model": "tiny", "inputs": []}, 422, "empty"),
    ({"model": "tiny", "inputs": [["a", 1, 2]]}, 422, "only numbers"),
    ({"model": "tiny", "inputs": [[1, 2, 3], [1, 2]]}, 422, "rectangular"),
    ({"model": "tiny", "inputs": [[True, 1, 2]]}, 422, "not true/false"),
    ({"model": "tiny", "inputs": [[1.5, False, 2]]}, 422, "not true/false"),
    ({"model": "tiny", "inputs": [[None, 1, 2]]}, 422, "only numbers"),
    ({"model": "tiny", "inputs": [[1e39, 1, 2]]}, 422, "inputs[0][0]"),
    ({"model": "tiny", "inputs": [1, 2, 3]}, 422, "list of rows"),
    ({"model": "tiny"}, 422, "no \"inputs\""),
    ({"model": 3, "inputs": ROWS}, 422, "must be a string"),
    ([1, 2], 422, "JSON object"),
])
async def test_client_mistakes_get_a_message_never_a_500(client, body, status, fragment):
    r = await client.post("/infer", json=body)
    assert r.status_code == status, f"{body} -> {r.status_code} {r.text}"
    assert fragment in r.json()["error"], f"{body} -> {r.json()['error']!r} lacks {fragment!r}"


@pytest.mark.parametrize("raw, fragment", [
    (b'{"model": "tiny", "inputs": [[NaN, 1, 2]]}', "NaN"),
    (b'{"model": "tiny", "inputs": [[1, -Infinity, 2]]}', "-Infinity"),
    (b'{"model": "tiny", "inputs": [[1e400, 1, 2]]}', "inputs[0][0]"),
    (b'{"model": "tiny", "inputs": [[1, 2', "not valid JSON"),
    (b'', "empty request body"),
])
async def test_non_finite_and_broken_json_are_422(client, raw, fragment):
    r = await client.post("/infer", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, f"{raw!r} -> {r.status_code} {r.text}"
    assert fragment in r.json()["error"], r.text


async def test_two_concurrent_requests_land_in_one_batch(client, repository):
    """The first request holds the model (a gate inside the runner); two more queue up meanwhile."""
    runner = client.app.state.service.batchers["tiny"].runner
    gate, calls, real_run = threading.Event(), [], runner.run

    def spy(x):
        calls.append(x.shape[0])
        gate.wait(timeout=10)
        return real_run(x)

    runner.run = spy
    first = asyncio.ensure_future(client.post("/infer", json={"model": "tiny", "inputs": ROWS[:1]}))
    while not calls:
        await asyncio.sleep(0.005)
    pair = [asyncio.ensure_future(client.post("/infer", json={"model": "tiny", "inputs": [row]}))
            for row in ROWS[1:]]
    while client.app.state.service.batchers["tiny"].queued_rows < 2:
        await asyncio.sleep(0.005)
    gate.set()
    responses = await asyncio.gather(first, *pair)
    assert calls == [1, 2], f"runner saw batches of {calls} rows; the two queued requests should share one"
    for row, r in zip(ROWS[1:], responses[1:], strict=True):
        np.testing.assert_allclose(r.json()["outputs"], reference(repository, "tiny", [row]), rtol=RTOL,
                                   atol=ATOL, err_msg=f"row {row} got another request's output")
    stats = (await client.get("/kernel-stats")).json()
    assert stats["models"]["tiny"]["batch_size_histogram"] == {"1": 1, "2": 1}, stats["models"]


async def test_kernel_stats_count_layers_and_reset(client):
    runner = client.app.state.service.runners["wide"]
    runner.timing_sample_every, runner.timing_min_interval_s = 1, 0.0  # every batch, to count them
    await client.post("/kernel-stats/reset")
    for _ in range(3):
        assert (await client.post("/infer", json={"model": "wide", "inputs": [[1, 2, 3, 4, 5]]})).status_code == 200
    stats = (await client.get("/kernel-stats")).json()
    layers = [row for row in stats["layers"] if row["model"] == "wide"]
    assert len({row["layer"] for row in layers}) == 2, f"expected 2 layers of 'wide', got {layers}"
    assert sum(row["calls"] for row in layers) == 6, layers
    for row in layers:
        assert row["mean_s"] > 0 and row["p99_s"] >= row["p50_s"] > 0, row
        assert (row["N"], row["K"]) in ((7, 5), (4, 7)), row
    assert stats["models"]["wide"]["queue_wait"]["count"] == 3
    served = stats["served"]["wide"]
    assert served.pop("choices") == {"1": "fixed", "2": "fixed", "4": "fixed", "8": "fixed"}, \
        "the torch backend on the CPU times nothing"
    assert sorted(served.pop("startup_s")) == ["capture", "compile", "path_choice", "tune"]
    assert served == {"in_features": 5, "out_features": 4, "dtype": "float32",
                                       "backend": "torch", "device": "cpu",
                                       "layer_timings": {"sampled": True, "every_batch": False,
                                                         "method": "perf_counter", "sample_every": 1,
                                                         "min_interval_s": 0.0,
                                                         "rule": stats["served"]["wide"]["layer_timings"]["rule"]}}
    assert (await client.post("/kernel-stats/reset")).json() == {"reset": True}
    assert (await client.get("/kernel-stats")).json()["layers"] == []


async def test_stats_reads_collect_finished_timings_and_say_when_sampled(client, monkeypatch):
    # A CUDA runner resolves its events lazily: /kernel-stats and /metrics must sweep them first.
    runner = client.app.state.service.runners["wide"]
    swept = []
    monkeypatch.setattr(runner, "collect_timings", lambda: swept.append(1) or 0)
    await client.get("/kernel-stats")
    await client.get("/metrics")
    assert len(swept) == 2, f"collect_timings ran {len(swept)} times for 2 stats reads"
    # Under CUDA graphs only some batches are timed: the stats must say so and how often.
    monkeypatch.setattr(runner, "cuda_graphs", True)
    policy = (await client.get("/kernel-stats")).json()["served"]["wide"]["layer_timings"]
    assert policy["sampled"] is True and policy["sample_every"] == runner.timing_sample_every, policy
    assert policy["min_interval_s"] == runner.timing_min_interval_s, policy


async def test_v2_json_and_binary_infer(client, repository):
    meta = (await client.get("/v2/models/tiny")).json()
    assert meta["inputs"][0]["shape"] == [-1, IN] and meta["outputs"][0]["shape"] == [-1, OUT], meta
    want = reference(repository, "tiny", ROWS)
    req = {"id": "r1", "inputs": [{"name": "input", "shape": [3, IN], "datatype": "FP32",
                                   "data": [v for row in ROWS for v in row]}]}
    r = await client.post("/v2/models/tiny/versions/1/infer", json=req)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert r.json()["id"] == "r1" and out["shape"] == [3, OUT], r.json()
    np.testing.assert_allclose(np.array(out["data"]).reshape(3, OUT), want, rtol=RTOL, atol=ATOL)

    raw = np.array(ROWS, dtype=np.float32).tobytes()
    header = (b'{"inputs": [{"name": "input", "shape": [3, 3], "datatype": "FP32", "parameters": '
              b'{"binary_data_size": %d}}], "parameters": {"binary_data_output": true}}' % len(raw))
    r = await client.post("/v2/models/tiny/infer", content=header + raw,
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:n])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 3 * OUT * 4, head
    got = np.frombuffer(r.content[n:], dtype=np.float32).reshape(3, OUT)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg="binary output differs")


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v2/models/nope/infer", {"inputs": []}, 404, "loaded models"),
    ("/v2/models/tiny/versions/2/infer", {"inputs": []}, 404, "only version"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "input", "shape": [1, 2], "datatype": "FP32",
                                           "data": [1, 2]}]}, 422, "expects 3"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "BYTES",
                                           "data": [1, 2, 3]}]}, 422, "datatype"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32",
                                           "data": [1, 2, 3]}]}, 422, "needs 6"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32",
                                           "data": [1, 2, 3], "parameters": {"binary_data_size": 12}}]},
     422, "only 0 bytes"),
])
async def test_v2_errors_are_error_objects(client, path, body, status, fragment):
    r = await client.post(path, json=body)
    assert r.status_code == status, f"{path} {body} -> {r.status_code} {r.text}"
    assert fragment in r.json()["error"], r.text


async def test_v2_server_ready_and_stats(client):
    assert (await client.get("/v2")).json()["name"] == "fusedserve"
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/models/tiny/ready")).json() == {"name": "tiny", "ready": True}
    await client.post("/infer", json={"model": "tiny", "inputs": ROWS})
    stats = (await client.get("/v2/models/tiny/stats")).json()["model_stats"][0]
    assert stats["inference_count"] >= 3 and stats["inference_stats"]["success"]["count"] >= 1, stats


async def test_metrics_count_requests_rows_and_kernel_time(client):
    await client.post("/infer", json={"model": "tiny", "inputs": ROWS})
    await client.post("/infer", json={"model": "tiny", "inputs": [[1.0]]})
    text = (await client.get("/metrics")).text
    for line in ('fusedserve_requests_total{model="tiny",outcome="ok"} 1.0',
                 'fusedserve_requests_total{model="tiny",outcome="bad_input"} 1.0',
                 'fusedserve_rows_total{model="tiny"} 3.0',
                 'fusedserve_batch_rows_count{model="tiny"} 1.0'):
        assert line in text, f"/metrics lacks {line!r}"
    assert 'fusedserve_kernel_seconds_total{kernel=' in text and 'layer="layers.1"' in text
    assert 'fusedserve_request_duration_seconds_count{model="tiny"} 1.0' in text, "one answered request"
    assert "_created" not in text, "every series has a *_created twin"
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text, "no process metrics"


async def test_serving_cpu_models_sets_torch_threads(repository):
    import torch

    app = create_app(Settings(model_repository=repository, device="cpu", gc_freeze=False, torch_threads=1))
    torch.set_num_threads(2)  # conftest restores the session's count after the test
    async with app.router.lifespan_context(app):
        assert torch.get_num_threads() == 1, "torch_threads=1 was not applied for CPU models"


async def test_request_id_is_echoed_or_generated(client):
    r = await client.get("/v2/health/live", headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = await client.get("/v2/health/live")
    assert len(r.headers["x-request-id"]) == 32, r.headers


async def test_limits_body_rows_queue_and_deadline(repository):
    # inline_batch_ms=0: the gated runner below must hold the worker thread, not the event loop.
    settings = Settings(model_repository=repository, device="cpu", gc_freeze=False, max_batch_size=4, max_queue_rows=4,
                        max_body_bytes=300, request_timeout_ms=10_000, inline_batch_ms=0.0)
    app = create_app(settings)
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c):
        await wait_ready(c)
        r = await c.post("/infer", json={"model": "tiny", "inputs": [[1.0, 2.0, 3.0]] * 40})
        assert r.status_code == 413 and "300-byte" in r.json()["error"], r.text
        r = await c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]] * 5})
        assert r.status_code == 422 and "at most 4" in r.json()["error"], r.text

        runner = app.state.service.batchers["tiny"].runner
        gate, real_run = threading.Event(), runner.run
        runner.run = lambda x: (gate.wait(timeout=10), real_run(x))[1]
        busy = asyncio.ensure_future(c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]}))
        await asyncio.sleep(0.1)
        # The header shortens the 10 s server deadline to 50 ms.
        r = await c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]] * 4},
                         headers={"X-Request-Timeout-Ms": "50"})
        assert r.status_code == 504 and "within 50 ms" in r.json()["error"], r.text
        queued = asyncio.ensure_future(c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]] * 4}))
        while app.state.service.batchers["tiny"].queued_rows < 4:
            await asyncio.sleep(0.005)
        r = await c.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3]]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        gate.set()
        assert (await busy).status_code == 200 and (await queued).status_code == 200


async def test_not_ready_until_warm_and_failed_warmup_is_reported(repository, held_warmup):
    held_warmup.fail = "wide"
    app = create_app(Settings(model_repository=repository, device="cpu", gc_freeze=False))
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c):
        while not held_warmup.started.is_set():
            await asyncio.sleep(0.005)
        assert (await c.get("/v2/health/live")).status_code == 200
        r = await c.get("/v2/health/ready")
        assert r.status_code == 503 and r.json()["error"] == "warming up", r.text
        r = await c.post("/infer", json={"model": "tiny", "inputs": ROWS})
        assert r.status_code == 503 and "warming up" in r.json()["error"], r.text
        held_warmup.release.set()
        while app.state.service.startup_error is None:
            await asyncio.sleep(0.005)
        r = await c.get("/v2/health/ready")
        assert r.status_code == 503 and "autotune exploded" in r.json()["error"], r.text


async def test_disconnected_client_is_dropped_before_its_batch_runs(client):
    """Raw ASGI, so the test decides when the client goes away: while its request is still queued."""
    app, batcher = client.app, client.app.state.service.batchers["tiny"]
    gate, calls, real_run = threading.Event(), [], batcher.runner.run

    def spy(x):
        calls.append(x.shape[0])
        gate.wait(timeout=10)
        return real_run(x)

    batcher.runner.run = spy
    first = asyncio.ensure_future(client.post("/infer", json={"model": "tiny", "inputs": ROWS[:1]}))
    while not calls:
        await asyncio.sleep(0.005)

    body = json.dumps({"model": "tiny", "inputs": ROWS}).encode()
    messages, gone, sent = [{"type": "http.request", "body": body, "more_body": False}], asyncio.Event(), []

    async def receive():
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/infer", "raw_path": b"/infer", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    request = asyncio.ensure_future(app(scope, receive, send))
    while batcher.queued_rows < len(ROWS):
        await asyncio.sleep(0.005)
    gone.set()
    await asyncio.wait_for(request, 5)
    gate.set()
    assert (await first).status_code == 200
    assert (await client.post("/infer", json={"model": "tiny", "inputs": ROWS[:2]})).status_code == 200
    assert calls == [1, 2], f"runner saw {calls}: the disconnected 3-row request was computed"
    assert sent[0]["status"] == 499, sent[0]
    assert 'outcome="disconnected"} 1.0' in (await client.get("/metrics")).text


async def test_gc_freeze_after_warm_up(repository):
    gc.unfreeze()
    app = create_app(Settings(model_repository=repository, device="cpu", gc_freeze=True))
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://localhost") as c:
            await wait_ready(c)
            assert gc.get_freeze_count() > 0, "objects alive after warm-up were not frozen"
    finally:
        gc.unfreeze()  # give the rest of the test session its collector back


async def test_a_dead_batch_loop_fails_both_probes(client):
    batcher = client.app.state.service.batchers["tiny"]

    def broken_take(max_rows):
        raise RuntimeError("bug in the batch loop")

    batcher._queue.take = broken_take  # the loop's next batch kills it
    r = await client.post("/infer", json={"model": "tiny", "inputs": [[1.0, 2.0, 3.0]]},
                          headers={"X-Request-Timeout-Ms": "300"})
    assert r.status_code == 504, r.text
    for path in ("/v2/health/ready", "/v2/health/live"):
        r = await client.get(path)
        assert r.status_code == 503 and "batch loop stopped for ['tiny']" in r.json()["error"], (path, r.text)


@pytest.mark.parametrize("background", [False, True])
async def test_kernel_stats_say_which_buckets_are_provisional(settings, monkeypatch, background):
    # As on a GPU with an empty tune cache: every bucket starts on provisional choices.
    monkeypatch.setattr(models.paths.LayersPath, "tuned", lambda self, bucket: False)
    app = create_app(settings.model_copy(update={"background_tuning": background}))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://localhost") as c:
        await wait_ready(c)
        want = "tuned" if background else "provisional"
        for _ in range(500):  # background tuning of these tiny CPU models takes milliseconds
            choices = (await c.get("/kernel-stats")).json()["served"]["tiny"]["choices"]
            if set(choices.values()) == {want} or not background:
                break
            await asyncio.sleep(0.01)
        assert choices == dict.fromkeys(("1", "2", "4", "8"), want)
        r = await c.post("/infer", json={"model": "tiny", "inputs": ROWS})
        np.testing.assert_allclose(r.json()["outputs"], reference(settings.model_repository, "tiny", ROWS),
                                   rtol=RTOL, atol=ATOL)
        assert (app.state.service.tuner is not None) == background
