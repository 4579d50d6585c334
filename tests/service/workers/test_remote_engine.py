"""``RemoteEngine`` against the engine process's server (``EngineServer``) on a Unix socket, both in
this event loop: a failed batch answers every request over the wire with its error; a request
withdrawn by the front end, or whose front end left, leaves the engine's queue before its batch
runs; the engine answers a queued request's deadline itself; requests sent in one turn travel
and queue as one group, each answered with its own rows; an engine that stops reading is found by
the heartbeat, a busy one is not."""

import asyncio
import itertools
import threading
from contextlib import asynccontextmanager

import numpy as np
import pytest
import torch

from fusedserve.service.engine.batcher import Batcher
from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.errors import BatchFailed, ClientGone, DeadlineExceeded, NotReady
from fusedserve.service.settings import Settings
from fusedserve.service.workers import remote as remote_module
from fusedserve.service.workers.engine_process import Connection, EngineServer
from fusedserve.service.workers.remote import RemoteEngine

ROW = np.array([[0.5, -1.0, 2.0]], dtype=np.float32)


class GatedRunner:
    """Blocks each batch on ``gate`` (in the batcher's worker thread), then fails it or echoes it."""

    name = "m"
    device = torch.device("cpu")

    def __init__(self, fail: bool):
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = fail

    def run(self, x: torch.Tensor) -> torch.Tensor:
        self.started.set()
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("the kernel exploded")
        return x[:, :2].clone()


class HeldConnection(Connection):
    """The engine's side of a connection, whose reading a test can pause as a stopped engine's."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        super().connection_made(transport)


@asynccontextmanager
async def serving(tmp_path, runner: GatedRunner, **settings):
    """A ``RemoteEngine`` connected to an ``EngineServer`` serving model "m" on ``runner``; yields
    it, the batcher and the engine's side of each connection."""
    settings = Settings(device="cpu", grpc_port=0, workers=1, gc_freeze=False, max_batch_size=8, **settings)
    state = ServiceState.fresh(settings)
    state.models["m"] = ModelInfo("m", 3, 2, "float32", "torch", "cpu")
    batcher = Batcher(runner, max_batch_size=8, max_delay_ms=1.0, max_queue_rows=64, inline_batch_ms=0.0)
    batcher.start()
    state.batchers["m"], state.serving = batcher, True
    server, origins, connections = EngineServer(state), itertools.count(1), []

    def connect() -> HeldConnection:
        connections.append(HeldConnection(server, next(origins)))
        return connections[-1]

    path = str(tmp_path / "engine.sock")
    listener = await asyncio.get_running_loop().create_unix_server(connect, path)
    remote = RemoteEngine(path, ServiceState.fresh(settings))
    await remote.start()
    assert remote.ready(), remote.reason()
    try:
        yield remote, batcher, connections
    finally:
        runner.gate.set()
        await remote.close()
        listener.close()
        await batcher.stop()


@pytest.fixture
async def engines(tmp_path, request):
    runner = GatedRunner(fail=request.param)
    async with serving(tmp_path, runner) as (remote, batcher, _):
        yield remote, runner, batcher


@pytest.mark.parametrize("engines", [True], indirect=True)
async def test_a_failed_batch_answers_every_request_over_the_wire(engines):
    remote, runner, _ = engines
    calls = [asyncio.create_task(remote.infer("m", ROW, 10.0)) for _ in range(3)]
    await asyncio.to_thread(runner.started.wait, 5)
    runner.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert all(isinstance(r, BatchFailed) and "the kernel exploded" in r.message for r in results), results
    assert all(r.status == 500 for r in results)


@pytest.mark.parametrize("engines", [False], indirect=True)
async def test_a_withdrawn_request_leaves_the_engine_queue(engines):
    remote, runner, batcher = engines
    first = await _hold_the_model(remote, runner)  # the model is busy with the first request
    leave = asyncio.get_running_loop().create_future()
    second = asyncio.create_task(remote.infer("m", ROW, 10.0, abandon=leave))
    for _ in range(200):
        if batcher.queued_rows == 1:
            break
        await asyncio.sleep(0.01)
    assert batcher.queued_rows == 1, "the second request never reached the engine's queue"
    leave.set_result(None)  # the client went away
    with pytest.raises(ClientGone):
        await second
    # the cancel frame withdraws it in the engine, before any batch takes it
    assert await _queue_empties(batcher), "the withdrawn request stayed queued in the engine"
    runner.gate.set()
    np.testing.assert_array_equal(await asyncio.wait_for(first, 10), ROW[:, :2])


@pytest.mark.parametrize("engines", [False], indirect=True)
async def test_a_front_end_that_leaves_takes_its_queued_requests(engines):
    remote, runner, batcher = engines
    first = await _hold_the_model(remote, runner)
    second = asyncio.create_task(remote.infer("m", ROW, 10.0))
    await _queue_fills(batcher)
    await remote.close()  # the front end's process is gone: nobody is left to answer
    assert await _queue_empties(batcher), "the engine kept a gone front end's request queued"
    runner.gate.set()
    await asyncio.gather(first, second, return_exceptions=True)


@pytest.mark.parametrize("engines", [False], indirect=True)
async def test_the_engine_answers_a_queued_requests_deadline(engines, monkeypatch):
    remote, runner, batcher = engines
    monkeypatch.setattr(remote_module, "DEADLINE_SLACK_S", 30.0)  # the front end's own timer stays out of it
    first = await _hold_the_model(remote, runner)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded, match="within 200 ms"):
        await asyncio.wait_for(remote.infer("m", ROW, 0.2), 10)
    assert loop.time() - t0 < 5.0
    assert batcher.queued_rows == 0, "the expired request stayed queued"
    runner.gate.set()
    np.testing.assert_array_equal(await asyncio.wait_for(first, 10), ROW[:, :2])


@pytest.mark.parametrize("engines", [False], indirect=True)
async def test_requests_of_one_turn_queue_as_one_group_and_get_their_own_rows(engines):
    remote, runner, batcher = engines
    first = await _hold_the_model(remote, runner)
    rows = [np.array([[i, -i, 0.5]], dtype=np.float32) for i in range(1, 4)]
    leave = asyncio.get_running_loop().create_future()
    calls = [asyncio.create_task(remote.infer("m", x, 10.0, abandon=leave if i == 1 else None))
             for i, x in enumerate(rows)]  # created in one turn: they run, and are sent, in the next
    await _queue_fills(batcher)
    assert (len(batcher._queue), batcher.queued_rows) == (1, 3), "one turn's requests were not one group"
    leave.set_result(None)  # one of the group leaves: the others are still computed and answered
    with pytest.raises(ClientGone):
        await calls[1]
    assert batcher.queued_rows == 3
    runner.gate.set()
    for call, x in zip((calls[0], calls[2]), (rows[0], rows[2]), strict=True):
        np.testing.assert_array_equal(await asyncio.wait_for(call, 10), x[:, :2])
    await first


@pytest.mark.parametrize("engines", [False], indirect=True)
async def test_a_group_whose_requests_all_leave_leaves_the_queue(engines):
    remote, runner, batcher = engines
    first = await _hold_the_model(remote, runner)
    leave = asyncio.get_running_loop().create_future()
    calls = [asyncio.create_task(remote.infer("m", ROW, 10.0, abandon=leave)) for _ in range(3)]
    await _queue_fills(batcher)
    leave.set_result(None)
    assert all(isinstance(r, ClientGone) for r in await asyncio.gather(*calls, return_exceptions=True))
    assert await _queue_empties(batcher), "a group nobody waits for stayed queued"
    runner.gate.set()
    await first


@pytest.mark.parametrize("engines", [False], indirect=True)
async def test_a_group_never_outgrows_a_batch(engines):
    # 5 requests of 3 rows in one turn, batches of at most 8 rows: one 15-row group would never run.
    remote, runner, batcher = engines
    runner.gate.set()
    rows = [np.full((3, 3), i, dtype=np.float32) for i in range(5)]
    outs = await asyncio.wait_for(asyncio.gather(*(remote.infer("m", x, 10.0) for x in rows)), 10)
    for out, x in zip(outs, rows, strict=True):
        np.testing.assert_array_equal(out, x[:, :2])


async def _hold_the_model(remote, runner) -> asyncio.Task:
    """A first request, its batch held in the runner until ``runner.gate`` is set."""
    first = asyncio.create_task(remote.infer("m", ROW, 10.0))
    await asyncio.to_thread(runner.started.wait, 5)
    return first


async def _queue_fills(batcher) -> None:
    for _ in range(200):
        if batcher.queued_rows:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never reached the engine's queue")


async def _queue_empties(batcher) -> bool:
    for _ in range(200):
        if batcher.queued_rows == 0:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.timeout(30)
async def test_a_silent_engine_is_unready_and_its_requests_answered_a_busy_one_is_not(tmp_path):
    # Heartbeat timeout 1 s. A batch held 2.5 s in the worker thread is a busy engine: its event loop
    # still answers PINGs. An engine that reads nothing is a stopped one: 503 and unready, until it
    # reads again.
    runner = GatedRunner(fail=False)
    async with serving(tmp_path, runner, engine_heartbeat_timeout_s=1.0) as (remote, _, connections):
        loop = asyncio.get_running_loop()
        first = await _hold_the_model(remote, runner)
        end = loop.time() + 2.5
        while loop.time() < end:
            assert remote.ready(), f"a busy engine was taken for a stopped one: {remote.reason()}"
            await asyncio.sleep(0.1)
        runner.gate.set()
        np.testing.assert_array_equal(await asyncio.wait_for(first, 5), ROW[:, :2])

        connections[0].transport.pause_reading()  # the engine process stops: nothing it is sent is read
        t0 = loop.time()
        held = asyncio.create_task(remote.infer("m", ROW, 20.0))
        with pytest.raises(NotReady, match="stopped answering") as caught:
            await asyncio.wait_for(held, 5)
        assert 1.0 <= loop.time() - t0 < 3.0, f"answered after {loop.time() - t0:.1f} s"
        assert caught.value.headers == {"Retry-After": "1"}
        assert not remote.ready() and "stopped answering" in remote.reason()
        assert remote.live(), "the front end itself is fine: only readiness says no"
        with pytest.raises(NotReady, match="stopped answering"):
            await asyncio.wait_for(remote.infer("m", ROW, 20.0), 1)  # new requests: at once

        connections[0].transport.resume_reading()  # it answers the next PING: serving again
        for _ in range(50):
            if remote.ready():
                break
            await asyncio.sleep(0.1)
        assert remote.ready(), remote.reason()
        np.testing.assert_array_equal(await asyncio.wait_for(remote.infer("m", ROW, 5.0), 5), ROW[:, :2])
