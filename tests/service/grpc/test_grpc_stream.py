"""KServe v2 gRPC streaming (``ModelStreamInfer``): ``tritonclient.grpc.aio``'s ``stream_infer``
unmodified, many requests in flight on one stream, each answered with its id; a mistake answered on
the stream while the stream goes on; a cancelled stream drops its queued requests; keys apply."""

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as triton_grpc
from prometheus_client import generate_latest

from ..conftest import IN, OUT, _close, _serve, reference
from .test_grpc import ATOL, ROWS, RTOL, _hold_next_batch, raw_request


def _inputs(x: np.ndarray) -> list:
    tensor = triton_grpc.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


async def test_every_request_is_answered_with_its_id_and_mistakes_do_not_end_the_stream(served, repository):
    rng = np.random.default_rng(3)
    sent = {f"r{i}": rng.normal(size=(1 + i % 4, IN)).astype(np.float32) for i in range(24)}
    wrong = {"bad-width": ("tiny", np.ones((1, IN + 1), np.float32)), "bad-model": ("nope", ROWS)}

    async def requests():
        for i, (rid, x) in enumerate(sent.items()):
            yield {"model_name": "tiny", "inputs": _inputs(x), "request_id": rid}
            if i == 5:  # mistakes in the middle of the stream
                for bad, (model, y) in wrong.items():
                    yield {"model_name": model, "inputs": _inputs(y), "request_id": bad}

    answers, errors = {}, []
    async for result, error in served.triton.stream_infer(requests()):
        if error is not None:
            errors.append(error.message())
        else:
            answers[result.get_response().id] = result.as_numpy("output")
    assert sorted(answers) == sorted(sent), "every good request answered once, under its own id"
    for rid, x in sent.items():
        np.testing.assert_allclose(answers[rid], reference(repository, "tiny", x), rtol=RTOL, atol=ATOL, err_msg=rid)
    assert len(errors) == 2, errors
    assert any("expects 3" in e for e in errors) and any("loaded models: ['tiny', 'wide']" in e for e in errors), errors
    text = generate_latest(served.state.metrics.registry).decode()
    for line in ('fusedserve_requests_total{model="tiny",outcome="ok"} 24.0',
                 'fusedserve_requests_total{model="tiny",outcome="bad_input"} 1.0',
                 'fusedserve_requests_total{model="",outcome="unknown_model"} 1.0'):
        assert line in text, f"{line!r} not in /metrics"


async def _queued_on_a_stream(served, count: int, prefix: str):
    """A stream with ``count`` one-row requests (ids prefix0...) queued behind a batch the runner
    holds; returns the call and the gate that lets the runner go."""
    gate = await _hold_next_batch(served)
    call = served.stub.ModelStreamInfer()
    for i in range(count):
        await call.write(raw_request(ROWS[:1], id=f"{prefix}{i}"))
    while served.state.batchers["tiny"].queued_rows < count:
        await asyncio.sleep(0.005)
    return call, gate


async def test_requests_in_flight_on_one_stream_share_batches(served):
    call, gate = await _queued_on_a_stream(served, 6, "q")
    gate.set()
    ids = set()
    for _ in range(6):
        answer = await call.read()
        assert not answer.error_message, answer.error_message
        ids.add(answer.infer_response.id)
        assert len(answer.infer_response.raw_output_contents[0]) == OUT * 4
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF and ids == {f"q{i}" for i in range(6)}
    await served.held
    hist = served.state.stats.snapshot()["models"]["tiny"]["batch_size_histogram"]
    assert hist.get("6") or hist.get(6), f"the six queued rows ran as one batch: {hist}"


async def test_a_cancelled_stream_drops_its_queued_requests(served):
    call, gate = await _queued_on_a_stream(served, 3, "c")
    call.cancel()
    for _ in range(200):
        if served.state.batchers["tiny"].queued_rows == 0:
            break
        await asyncio.sleep(0.01)
    gate.set()
    await served.held
    text = generate_latest(served.state.metrics.registry).decode()
    assert 'fusedserve_requests_total{model="tiny",outcome="disconnected"} 3.0' in text, text
    ok = await served.stub.ModelInfer(raw_request(ROWS))  # the server goes on
    assert list(ok.outputs[0].shape) == [3, OUT]


async def test_the_stream_needs_the_key(settings):
    served = await _serve(settings.model_copy(update={"api_key": "s3cret"}))
    try:
        call = served.stub.ModelStreamInfer()
        await call.write(raw_request(ROWS))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
        call = served.stub.ModelStreamInfer(metadata=(("authorization", "Bearer s3cret"),))
        await call.write(raw_request(ROWS, id="k"))
        answer = await call.read()
        assert answer.infer_response.id == "k" and not answer.error_message
        await call.done_writing()
    finally:
        await _close(served)

