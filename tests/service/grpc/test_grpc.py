"""KServe v2 gRPC in the app's own event loop, on a free loopback port: ``tritonclient.grpc.aio``
unmodified, and the generated stub for the messages tritonclient never sends (typed contents and
every kind of client mistake, each answered with its status code and a message)."""

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as triton_grpc
from prometheus_client import generate_latest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from fusedserve import models
from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings

from ..conftest import IN, OUT, _close, _serve, reference

ROWS = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -7.0], [1.0, 1.0, 1.0]], dtype=np.float32)
# Same float32 math on the same CPU, but batched rows may take another BLAS path: allow rounding.
RTOL, ATOL = 1e-5, 1e-6
Tensor = pb.ModelInferRequest.InferInputTensor


def raw_request(x: np.ndarray, model: str = "tiny", datatype: str = "FP32", **fields) -> pb.ModelInferRequest:
    return pb.ModelInferRequest(model_name=model, inputs=[Tensor(name="input", datatype=datatype, shape=x.shape)],
                                raw_input_contents=[x.tobytes()], **fields)


def typed_request(values, shape, model: str = "tiny", **contents) -> pb.ModelInferRequest:
    tensor = Tensor(name="input", datatype="FP32", shape=shape,
                    contents=pb.InferTensorContents(**(contents or {"fp32_contents": values})))
    return pb.ModelInferRequest(model_name=model, inputs=[tensor])


async def test_tritonclient_health_metadata_and_raw_infer(served, repository):
    t = served.triton
    assert await t.is_server_live() and await t.is_server_ready() and await t.is_model_ready("tiny")
    assert (await t.get_server_metadata()).name == "fusedserve"
    meta = await t.get_model_metadata("wide", model_version="1")
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [("input", "FP32", [-1, 5])], meta
    assert [(o.name, o.datatype, list(o.shape)) for o in meta.outputs] == [("output", "FP32", [-1, 4])], meta
    x = triton_grpc.InferInput("input", list(ROWS.shape), "FP32")
    x.set_data_from_numpy(ROWS)  # raw_input_contents, as tritonclient always sends
    result = await t.infer("tiny", [x], outputs=[triton_grpc.InferRequestedOutput("output")], request_id="r7")
    assert result.get_response().id == "r7"
    np.testing.assert_allclose(result.as_numpy("output"), reference(repository, "tiny", ROWS), rtol=RTOL, atol=ATOL)
    # tritonclient's message compression, inflated by the server (grpc sends a message plain where
    # compressing would not shrink it: here gzip's header does, deflate's does not).
    for algorithm in ("gzip", "deflate"):
        result = await t.infer("tiny", [x], compression_algorithm=algorithm)
        np.testing.assert_allclose(result.as_numpy("output"), reference(repository, "tiny", ROWS), rtol=RTOL,
                                   atol=ATOL, err_msg=f"{algorithm}-compressed request")


async def test_typed_contents_in_typed_out_and_raw_when_asked(served, repository):
    want = reference(repository, "tiny", ROWS)
    r = await served.stub.ModelInfer(typed_request(ROWS.ravel().tolist(), ROWS.shape))
    assert not r.raw_output_contents and list(r.outputs[0].shape) == [3, OUT], r
    got = np.array(r.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(3, OUT)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg="typed contents in, typed out")
    request = typed_request(ROWS.ravel().tolist(), ROWS.shape)
    request.parameters["binary_data_output"].bool_param = True
    r = await served.stub.ModelInfer(request)
    got = np.frombuffer(r.raw_output_contents[0], dtype=np.float32).reshape(3, OUT)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg="typed in, raw out when asked")
    ints = Tensor(name="input", datatype="INT32", shape=[1, IN],
                  contents=pb.InferTensorContents(int_contents=[1, 2, 3]))
    r = await served.stub.ModelInfer(pb.ModelInferRequest(model_name="tiny", inputs=[ints]))
    np.testing.assert_allclose(r.outputs[0].contents.fp32_contents, reference(repository, "tiny", [[1, 2, 3]])[0],
                               rtol=RTOL, atol=ATOL, err_msg="INT32 typed contents are served as float32")


def _two_inputs():
    request = raw_request(ROWS)
    request.inputs.append(Tensor(name="input", datatype="FP32", shape=ROWS.shape))
    request.raw_input_contents.append(ROWS.tobytes())
    return request


def _bad_param():
    request = raw_request(ROWS)
    request.parameters["binary_data_output"].string_param = "yes"
    return request


MISTAKES = {
    "unknown model": (raw_request(ROWS, model="nope"), "NOT_FOUND", "loaded models: ['tiny', 'wide']"),
    "unknown version": (raw_request(ROWS, model_version="2"), "NOT_FOUND", "only version '1'"),
    "wrong width": (raw_request(ROWS[:, :2].copy()), "INVALID_ARGUMENT", "expects 3"),
    "rank 3": (pb.ModelInferRequest(model_name="tiny", inputs=[Tensor(name="input", datatype="FP32", shape=[1, 1, 3])],
                                    raw_input_contents=[ROWS[:1].tobytes()]), "INVALID_ARGUMENT", "[rows, 3]"),
    "no rows": (raw_request(ROWS[:0]), "INVALID_ARGUMENT", "at least one row"),
    "bytes datatype": (raw_request(ROWS, datatype="BYTES"), "INVALID_ARGUMENT", "datatype must be one of"),
    "byte count": (pb.ModelInferRequest(model_name="tiny", inputs=[Tensor(name="input", datatype="FP32", shape=[3, 3])],
                                        raw_input_contents=[ROWS.tobytes()[:-4]]), "INVALID_ARGUMENT",
                   "has 32 bytes but shape [3, 3] of float32 needs 36"),
    "missing input": (pb.ModelInferRequest(model_name="tiny"), "INVALID_ARGUMENT", "one input 'input'"),
    "two inputs": (_two_inputs(), "INVALID_ARGUMENT", "got 2 inputs"),
    "input name": (pb.ModelInferRequest(model_name="tiny",
                                        inputs=[Tensor(name="INPUT0", datatype="FP32", shape=[3, 3])],
                                        raw_input_contents=[ROWS.tobytes()]), "INVALID_ARGUMENT", "named 'INPUT0'"),
    "ragged typed": (typed_request([1.0, 2.0, 3.0, 4.0], [2, 3]), "INVALID_ARGUMENT", "has 4 numbers but shape [2, 3]"),
    "no data": (typed_request([], [1, 3]), "INVALID_ARGUMENT", "has no data"),
    "wrong typed field": (typed_request(None, [1, 3], fp64_contents=[1.0, 2.0, 3.0]), "INVALID_ARGUMENT",
                          "go in contents.fp32_contents; got contents.fp64_contents"),
    "typed fp16": (pb.ModelInferRequest(model_name="tiny",
                                        inputs=[Tensor(name="input", datatype="FP16", shape=[1, 3])]),
                   "INVALID_ARGUMENT", "raw_input_contents"),
    "raw and typed": (pb.ModelInferRequest(model_name="tiny", inputs=[typed_request([1.0, 2.0, 3.0], [1, 3]).inputs[0]],
                                           raw_input_contents=[ROWS[:1].tobytes()]), "INVALID_ARGUMENT", "both"),
    "too many rows": (raw_request(np.ones((9, 3), np.float32)), "INVALID_ARGUMENT", "at most 8 per request"),
    "not finite": (raw_request(np.array([[1.0, np.nan, 2.0]], np.float32)), "INVALID_ARGUMENT", "inputs[0][0][1]"),
    "unknown output": (raw_request(ROWS, outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="logits")]),
                       "INVALID_ARGUMENT", "unknown output 'logits'"),
    "bad parameter": (_bad_param(), "INVALID_ARGUMENT", "must be a bool"),
    "int8 overflow": (pb.ModelInferRequest(model_name="tiny", inputs=[Tensor(
        name="input", datatype="INT8", shape=[1, 3], contents=pb.InferTensorContents(int_contents=[1, 300, 2]))]),
        "INVALID_ARGUMENT", "outside the range of INT8"),
}


@pytest.mark.parametrize("name", MISTAKES)
async def test_client_mistakes_get_their_status_and_what_to_fix(served, name):
    request, code, fragment = MISTAKES[name]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode[code], (name, caught.value.code(), caught.value.details())
    assert fragment in caught.value.details(), (name, caught.value.details())


async def test_metadata_mistakes_and_metrics_count_grpc_requests(served):
    for call in (served.triton.get_model_metadata("nope"), served.triton.is_model_ready("tiny", "2")):
        with pytest.raises(InferenceServerException) as caught:
            await call
        assert caught.value.status() == "StatusCode.NOT_FOUND", caught.value
    await served.stub.ModelInfer(raw_request(ROWS))
    with pytest.raises(grpc.aio.AioRpcError):
        await served.stub.ModelInfer(raw_request(ROWS[:, :2].copy()))
    text = generate_latest(served.state.metrics.registry).decode()
    for line in ('fusedserve_requests_total{model="tiny",outcome="ok"} 1.0',
                 'fusedserve_requests_total{model="tiny",outcome="bad_input"} 1.0',
                 'fusedserve_requests_total{model="",outcome="unknown_model"} 2.0'):
        assert line in text, f"{line!r} not in /metrics:\n{text}"
    assert served.state.stats.model_counts("tiny")["success"] == 1


async def test_not_ready_while_warming_is_unavailable(settings, held_warmup):
    served = await _serve(settings, wait_ready=False)
    try:
        while not held_warmup.started.is_set():
            await asyncio.sleep(0.005)
        t = served.triton
        assert await t.is_server_live() and not await t.is_server_ready() and not await t.is_model_ready("tiny")
        assert (await t.get_model_metadata("tiny")).name == "tiny", "metadata needs no warm model"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.ModelInfer(raw_request(ROWS))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in caught.value.details()
    finally:
        held_warmup.release.set()
        await _close(served)


async def _hold_next_batch(served) -> threading.Event:
    """Send one row and hold its batch in the runner (the worker thread) until the returned event is set."""
    runner = served.state.batchers["tiny"].runner
    entered, gate, real_run = threading.Event(), threading.Event(), runner.run
    runner.run = lambda x: (entered.set(), gate.wait(timeout=10), real_run(x))[2]
    served.held = asyncio.ensure_future(served.stub.ModelInfer(raw_request(ROWS[:1])))
    while not entered.is_set():
        await asyncio.sleep(0.005)
    return gate


async def test_full_queue_is_unavailable_and_a_passed_deadline_deadline_exceeded(settings):
    served = await _serve(settings.model_copy(update={"max_queue_rows": 8}))
    try:
        gate = await _hold_next_batch(served)
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # gRPC's own deadline
            await served.stub.ModelInfer(raw_request(ROWS), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
        x = triton_grpc.InferInput("input", [1, IN], "FP32")
        x.set_data_from_numpy(ROWS[:1])
        with pytest.raises(InferenceServerException) as caught:  # Triton's timeout parameter, microseconds
            await served.triton.infer("tiny", [x], timeout=50_000)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED" and "within 50 ms" in caught.value.message()
        while served.state.batchers["tiny"].queued_rows:  # the timed-out calls' rows leave the queue first
            await asyncio.sleep(0.005)
        queued = asyncio.ensure_future(served.stub.ModelInfer(raw_request(np.ones((8, 3), np.float32))))
        while served.state.batchers["tiny"].queued_rows < 8:
            assert not queued.done(), queued  # refused rather than queued: fail now, not at the timeout
            await asyncio.sleep(0.005)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.ModelInfer(raw_request(ROWS[:1]))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "rows queued" in caught.value.details()
        gate.set()
        assert len((await served.held).raw_output_contents[0]) == OUT * 4
        assert len((await queued).raw_output_contents[0]) == 8 * OUT * 4
    finally:
        await _close(served)


async def test_drain_answers_calls_in_flight_and_refuses_new_ones(settings):
    served = await _serve(settings)
    try:
        gate = await _hold_next_batch(served)
        queued = asyncio.ensure_future(served.stub.ModelInfer(raw_request(ROWS)))
        while served.state.batchers["tiny"].queued_rows < len(ROWS):
            await asyncio.sleep(0.005)
        served.state.start_draining()  # what SIGTERM does
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.ModelInfer(raw_request(ROWS), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert not served.held.done() and not queued.done()
        gate.set()
        assert list((await served.held).outputs[0].shape) == [1, OUT], "the call in the runner is answered"
        assert list((await queued).outputs[0].shape) == [3, OUT], "the queued call is answered"
    finally:
        await _close(served)


async def test_grpc_off(settings):
    assert Settings().grpc_port == 0, "tests run with FUSEDSERVE_GRPC_PORT=0: no test binds 8001 by default"
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        assert app.state.grpc is None, "gRPC port 0: no gRPC server started"


async def test_a_port_another_server_holds_is_an_error(served, settings):
    # gRPC's default SO_REUSEPORT would let this second server share the port, and its calls, silently.
    app = create_app(settings.model_copy(update={"grpc_port": served.port}))
    with pytest.raises(RuntimeError, match="cannot listen for gRPC.*--grpc-port 0"):
        async with app.router.lifespan_context(app):
            pass
    assert await served.triton.is_server_ready()


async def test_messages_above_the_clients_windows_go_both_ways(settings, tmp_path):
    # 8 rows of 4096 floats each way (128 KiB), above HTTP/2's default 64 KiB window: the request goes
    # through only in the window our SETTINGS open. (grpcio's client opens its own wide at once;
    # tests/service/grpc/test_h2.py holds the answer to a narrow one.)
    torch.manual_seed(0)
    models.save_model(models.MLP(models.MLPConfig(4096, (16,), 4096)), tmp_path / "big" / "wide4k")
    served = await _serve(settings.model_copy(update={"model_repository": tmp_path / "big"}))
    try:
        x = np.random.default_rng(0).standard_normal((8, 4096)).astype(np.float32)
        calls = [served.stub.ModelInfer(raw_request(x * (i + 1), model="wide4k")) for i in range(4)]
        for i, answer in enumerate(await asyncio.gather(*calls)):  # four at once on one connection
            got = np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).reshape(8, 4096)
            want = reference(tmp_path / "big", "wide4k", x * (i + 1))
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5, err_msg=f"call {i}: 128 KiB each way")
    finally:
        await _close(served)
