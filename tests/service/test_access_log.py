"""The access log: gRPC calls get a line with HTTP's fields, and lines leave in batches from a thread
of their own (a request only queues its record), in order, all of them by close."""

import io
import logging
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as triton_grpc
from tritonclient.utils import InferenceServerException

from fusedserve.service.logs import ACCESS_LOGGER, BatchedHandler

from .conftest import IN


class CountingStream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = 0

    def write(self, text):
        self.writes += 1
        return super().write(text)


def _logger(handler) -> logging.Logger:
    log = logging.getLogger(f"test.batched.{id(handler)}")
    log.handlers[:], log.propagate = [handler], False
    log.setLevel(logging.INFO)
    return log


def test_records_wait_for_the_batch_and_close_writes_them_in_order():
    stream = CountingStream()
    handler = BatchedHandler(stream, logging.Formatter("%(message)s"), interval_s=60, batch=10_000)
    log = _logger(handler)
    for i in range(500):
        log.info("line %d", i)
    assert stream.writes == 0, "a record was written on the request's own path"
    handler.close()
    assert stream.writes == 1
    assert stream.getvalue().splitlines() == [f"line {i}" for i in range(500)]


def test_a_lone_record_is_written_within_the_interval_and_a_full_batch_at_once():
    stream = CountingStream()
    handler = BatchedHandler(stream, logging.Formatter("%(message)s"), interval_s=0.05, batch=100)
    log = _logger(handler)
    log.info("alone")
    end = time.monotonic() + 5
    while "alone" not in stream.getvalue() and time.monotonic() < end:
        time.sleep(0.01)
    assert stream.getvalue() == "alone\n"
    handler.interval_s = 60  # from now on only a full batch wakes the writer
    time.sleep(0.1)
    for i in range(100):
        log.info("batch %d", i)
    end = time.monotonic() + 5
    while stream.getvalue().count("\n") < 101 and time.monotonic() < end:
        time.sleep(0.01)
    assert stream.getvalue().count("\n") == 101
    handler.close()


def test_threads_logging_at_once_lose_no_line():
    stream = CountingStream()
    handler = BatchedHandler(stream, logging.Formatter("%(message)s"), interval_s=0.001, batch=7)
    log = _logger(handler)

    def write(n):
        for i in range(300):
            log.info("%d %d", n, i)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handler.close()
    lines = stream.getvalue().splitlines()
    assert sorted(lines) == sorted(f"{n} {i}" for n in range(4) for i in range(300))
    for n in range(4):  # each thread's own lines in the order it wrote them
        assert [line for line in lines if line.startswith(f"{n} ")] == [f"{n} {i}" for i in range(300)]


@pytest.mark.timeout(60)
async def test_grpc_calls_get_an_access_line_with_https_fields(served, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    x = triton_grpc.InferInput("input", [2, IN], "FP32")
    x.set_data_from_numpy(np.ones((2, IN), dtype=np.float32))
    await served.triton.infer("tiny", [x], headers={"x-request-id": "req-42"})
    with pytest.raises(InferenceServerException):
        await served.triton.get_model_metadata("nope")
    lines = {r.path: r for r in caplog.records if r.name == ACCESS_LOGGER}
    infer = lines["/inference.GRPCInferenceService/ModelInfer"]
    assert (infer.method, infer.status, infer.grpc_status, infer.request_id) == ("POST", 0, "OK", "req-42")
    assert infer.duration_ms > 0 and "ModelInfer OK" in infer.getMessage(), infer.getMessage()
    missing = lines["/inference.GRPCInferenceService/ModelMetadata"]
    assert (missing.status, missing.grpc_status, missing.request_id) == (5, "NOT_FOUND", "-")
