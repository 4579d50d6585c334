"""The batcher alone: a real asyncio queue and a fake runner that records every batch it gets."""

import asyncio
import math
import threading
import time

import numpy as np
import pytest
import torch

from fusedserve.service.engine.batcher import REMEASURE_EVERY, Batcher
from fusedserve.service.errors import BatchFailed, ClientGone, DeadlineExceeded, QueueFull
from fusedserve.service.stats.service_stats import ServiceStats

IN, OUT = 3, 2


class FakeRunner:
    """out[i] = [sum(x[i]), rows in the batch]; optionally blocks each batch on a gate."""

    name = "fake"

    def __init__(self, fail=False, gate: threading.Event | None = None):
        self.batches: list[int] = []
        self.fail = fail
        self.gate = gate

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.gate.wait(timeout=5)
        self.batches.append(x.shape[0])
        if self.fail:
            raise RuntimeError("boom in layer 1")
        return torch.stack([x.sum(1), torch.full((x.shape[0],), float(x.shape[0]))], dim=1)


def rows(n, start=0.0):
    return np.arange(start, start + n * IN, dtype=np.float32).reshape(n, IN)


async def started(runner, **kw):
    kw = {"max_batch_size": 8, "max_delay_ms": 50.0, "max_queue_rows": 64} | kw
    stats = ServiceStats()
    b = Batcher(runner, recorders=(stats,), **kw)
    b.start()
    return b, stats


async def behind_a_held_batch(b, gate: threading.Event, n: int) -> list:
    """A lone request's batch held on ``gate`` while ``n`` one-row requests queue behind it; the
    gate is then opened and the first answered. The queued requests' futures."""
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.02)
    queued = [asyncio.ensure_future(b.submit(rows(1))) for _ in range(n)]
    gate.set()
    await first
    return queued


async def test_idle_model_runs_a_lone_request_at_once():
    runner = FakeRunner()
    b, _ = await started(runner, max_delay_ms=10_000.0)
    t0 = time.monotonic()
    out = await b.submit(rows(1))
    # A 10 s delay would be waited only when filling behind a running batch, never when idle.
    assert time.monotonic() - t0 < 2.0, "an idle batcher waited for max_delay_ms"
    np.testing.assert_array_equal(out, [[3.0, 1.0]])
    await b.stop()


async def test_requests_queued_while_busy_share_one_batch_in_order():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, stats = await started(runner)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)  # the first batch is now blocked inside the runner
    later = [asyncio.ensure_future(b.submit(rows(n, 100.0 * n))) for n in (1, 3, 2)]
    await asyncio.sleep(0.05)
    gate.set()
    outs = await asyncio.gather(first, *later)
    assert runner.batches == [1, 6], f"batches were {runner.batches}"
    for n, out in zip((1, 3, 2), outs[1:], strict=True):
        np.testing.assert_array_equal(out[:, 0], rows(n, 100.0 * n).sum(1), err_msg=f"request of {n} rows")
        assert out.shape == (n, OUT)
    hist = stats.snapshot()["models"]["fake"]["batch_size_histogram"]
    assert hist == {"1": 1, "6": 1}, hist
    await b.stop()


async def test_batch_closes_at_max_rows_and_never_splits_a_request():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner, max_batch_size=5)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)
    later = [asyncio.ensure_future(b.submit(rows(n))) for n in (3, 3, 2, 1)]
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.gather(first, *later)
    # 3 + 3 > 5: the second 3-row request waits whole (and keeps its place) for the next batch.
    assert runner.batches == [1, 3, 5, 1], f"batches {runner.batches}"
    await b.stop()


async def test_delay_holds_a_batch_behind_a_busy_model_until_the_oldest_deadline():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner, max_delay_ms=300.0)
    second, = await behind_a_held_batch(b, gate, 1)
    t0 = time.monotonic()
    await asyncio.sleep(0.1)  # within the 300 ms window: a request sent now joins the same batch
    third = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.gather(second, third)
    assert runner.batches == [1, 2], f"batches {runner.batches}"
    # Upper bound is loose (2-core CI): the point is that it did not wait forever.
    assert time.monotonic() - t0 < 2.0
    await b.stop()


async def test_quiet_rule_closes_a_filling_batch_once_requests_stop_arriving():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner, max_delay_ms=10_000.0, quiet_ms=50.0)
    queued = await behind_a_held_batch(b, gate, 2)
    t0 = time.monotonic()
    await asyncio.sleep(0.01)  # within the quiet time: joins the batch that is filling
    queued.append(asyncio.ensure_future(b.submit(rows(1))))
    await asyncio.wait_for(asyncio.gather(*queued), timeout=5)
    # The 10 s delay is not waited out: the batch closed after 50 ms without a new request.
    assert runner.batches == [1, 3] and time.monotonic() - t0 < 2.0, runner.batches
    await b.stop()


async def test_quiet_ms_must_not_be_negative():
    with pytest.raises(ValueError, match="quiet_ms"):
        Batcher(FakeRunner(), max_batch_size=8, max_delay_ms=1.0, max_queue_rows=64, quiet_ms=-1)


async def test_failed_batch_answers_every_request_and_keeps_serving():
    gate = threading.Event()
    runner = FakeRunner(fail=True, gate=gate)
    b, _ = await started(runner)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)
    later = [asyncio.ensure_future(b.submit(rows(2))) for _ in range(3)]
    await asyncio.sleep(0.05)
    gate.set()
    results = await asyncio.gather(first, *later, return_exceptions=True)
    for r in results:
        assert isinstance(r, BatchFailed), f"got {r!r}"
        assert "boom in layer 1" in r.message and "fake" in r.message
    runner.fail = False
    np.testing.assert_array_equal(await b.submit(rows(1)), [[3.0, 1.0]])
    await b.stop()


async def test_wrong_output_rows_fail_the_batch():
    class Short(FakeRunner):
        def run(self, x):
            return super().run(x)[:-1]

    b, _ = await started(Short())
    with pytest.raises(BatchFailed, match="one output row per input row"):
        await b.submit(rows(3))
    await b.stop()


async def test_queue_cap_answers_503_with_retry_after():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner, max_batch_size=4, max_queue_rows=4)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(b.submit(rows(4)))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as info:
        await b.submit(rows(1))
    assert info.value.headers["Retry-After"] == "1"
    gate.set()
    await asyncio.gather(first, waiting)
    await b.stop()


async def test_timed_out_request_is_never_computed():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)
    with pytest.raises(DeadlineExceeded, match="within 50 ms"):
        await b.submit(rows(3), timeout_s=0.05)
    gate.set()
    await first
    await b.submit(rows(2))
    assert runner.batches == [1, 2], f"the timed-out 3-row request ran: {runner.batches}"
    await b.stop()


async def test_stop_answers_queued_requests():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(b.submit(rows(2)))
    await asyncio.sleep(0.01)
    stopping = asyncio.ensure_future(b.stop())
    gate.set()
    await stopping
    assert (await queued).shape == (2, OUT)
    assert (await first).shape == (1, OUT)


async def test_timed_out_request_frees_its_queue_rows_at_once():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner, max_batch_size=4, max_queue_rows=4)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)
    with pytest.raises(DeadlineExceeded):
        await b.submit(rows(4), timeout_s=0.02)
    assert b.queued_rows == 0, f"{b.queued_rows} rows of a timed-out request still count against the cap"
    later = asyncio.ensure_future(b.submit(rows(4)))  # would be 503 if the dead rows still counted
    gate.set()
    await asyncio.gather(first, later)
    assert runner.batches == [1, 4], runner.batches
    await b.stop()


class ThreadSpy(FakeRunner):
    """Records the thread of every batch; each batch takes ``seconds``."""

    def __init__(self, seconds=0.0):
        super().__init__()
        self.seconds = seconds
        self.threads: list[str] = []

    def run(self, x):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        return super().run(x)


async def test_fast_batches_skip_the_worker_thread_once_measured():
    runner = ThreadSpy()
    b, _ = await started(runner, inline_batch_ms=50.0)
    for n in (1, 1, 3, 1, 3):
        await b.submit(rows(n))
    loop_thread = threading.current_thread().name
    # A row count not measured yet goes to the worker (1 row, then 3 rows); once measured far below
    # 50 ms (an empty fake run), the same row count runs on the event loop's thread.
    assert runner.threads[0] != loop_thread and runner.threads[2] != loop_thread, runner.threads
    assert runner.threads[1] == runner.threads[3] == runner.threads[4] == loop_thread, runner.threads
    await b.stop()


async def test_slow_batches_and_zero_threshold_stay_on_the_worker_thread():
    loop_thread = threading.current_thread().name
    for kw, seconds in (({"inline_batch_ms": 1.0}, 0.005), ({"inline_batch_ms": 0.0}, 0.0)):
        runner = ThreadSpy(seconds)
        b, _ = await started(runner, **kw)
        for _ in range(3):
            await b.submit(rows(1))
        assert loop_thread not in runner.threads, f"{kw}, {seconds} s per batch: {runner.threads}"
        await b.stop()


class SlowOffTheLoop(ThreadSpy):
    """20 ms a batch on the worker thread, nothing on the loop's: what waiting for the GIL held by a
    busy event loop looks like from the worker."""

    def __init__(self, loop_thread):
        super().__init__()
        self.loop_thread = loop_thread

    def run(self, x):
        self.seconds = 0.0 if threading.current_thread().name == self.loop_thread else 0.02
        return super().run(x)


async def test_a_row_count_sent_to_the_worker_is_measured_again_on_the_loop():
    loop_thread = threading.current_thread().name
    runner = SlowOffTheLoop(loop_thread)
    # 10 ms: far under the worker's 20 ms and far over an empty run on the loop, even on a loaded
    # 2-core CI machine (at 1 ms, a pause there once sent the loop's run back to the worker).
    b, _ = await started(runner, inline_batch_ms=10.0)
    for _ in range(REMEASURE_EVERY + 4):
        await b.submit(rows(1))
    on_loop = [i for i, name in enumerate(runner.threads) if name == loop_thread]
    # Batch 0 is unmeasured, 1..REMEASURE_EVERY-1 follow the 20 ms the worker measured; then one runs
    # on the loop, measures ~0 ms, and every later one stays there.
    assert on_loop == list(range(REMEASURE_EVERY, REMEASURE_EVERY + 4)), runner.threads
    await b.stop()


async def test_inline_batch_that_fails_answers_every_request():
    runner = ThreadSpy()
    b, _ = await started(runner, inline_batch_ms=50.0)
    await b.submit(rows(1))  # measured: the next 1-row batch runs inline
    runner.fail = True
    with pytest.raises(BatchFailed, match="boom in layer 1"):
        await b.submit(rows(1))
    assert runner.threads[-1] == threading.current_thread().name, runner.threads
    runner.fail = False
    np.testing.assert_array_equal(await b.submit(rows(1)), [[3.0, 1.0]])
    await b.stop()


async def test_abandoned_request_leaves_the_queue_and_is_never_computed():
    gate = threading.Event()
    runner = FakeRunner(gate=gate)
    b, _ = await started(runner)
    first = asyncio.ensure_future(b.submit(rows(1)))
    await asyncio.sleep(0.05)  # the first batch is blocked inside the runner
    gone = asyncio.get_running_loop().create_future()
    second = asyncio.ensure_future(b.submit(rows(3), timeout_s=10.0, abandon=gone))
    await asyncio.sleep(0.01)
    gone.set_result(None)  # e.g. the client disconnected
    with pytest.raises(ClientGone, match="disconnected"):
        await second
    assert b.queued_rows == 0, f"{b.queued_rows} rows of an abandoned request still queued"
    gate.set()
    await first
    await b.submit(rows(2))
    assert runner.batches == [1, 2], f"the abandoned 3-row request ran: {runner.batches}"
    await b.stop()


async def test_infinite_threshold_runs_every_batch_on_the_event_loop():
    runner = ThreadSpy()
    b, _ = await started(runner, inline_batch_ms=math.inf)
    for n in (1, 3):
        await b.submit(rows(n))
    loop_thread = threading.current_thread().name
    assert runner.threads == [loop_thread, loop_thread], f"not measured yet, still inline: {runner.threads}"
    await b.stop()


async def test_after_an_inline_batch_of_several_requests_the_next_batch_fills():
    # Inline, the loop cannot read requests while the model computes; they are enqueued just after
    # the batch, into an empty queue. Under load (a batch of several requests) they must still be
    # batched together, not dispatched one by one as if the model were idle.
    runner = ThreadSpy()
    b, _ = await started(runner, inline_batch_ms=math.inf, max_delay_ms=200.0)
    await b.submit(rows(1))  # a lone request on an idle model: at once
    await asyncio.gather(*(b.submit(rows(1)) for _ in range(2)))  # queued together: one batch of 2
    later = [asyncio.ensure_future(b.submit(rows(1)))]
    await asyncio.sleep(0.02)  # arrives after the batch of 2, well within max_delay_ms
    later.append(asyncio.ensure_future(b.submit(rows(1))))
    await asyncio.gather(*later)
    assert runner.batches == [1, 2, 2], f"batches {runner.batches}"
    await b.stop()


class BrokenRecorder:
    def record_batch(self, model, rows, waits, compute_s):
        raise RuntimeError("stats bug")


async def test_a_failing_stats_hook_neither_holds_answers_nor_stops_the_loop(caplog):
    b = Batcher(FakeRunner(), max_batch_size=8, max_delay_ms=1.0, max_queue_rows=64, recorders=(BrokenRecorder(),))
    b.start()
    for n in (1, 2):  # the second request proves the batch loop survived the first failure
        out = await asyncio.wait_for(b.submit(rows(n)), timeout=5)
        np.testing.assert_array_equal(out[:, 0], rows(n).sum(1))
    assert "recording a batch of model 'fake' failed" in caplog.text
    await b.stop()


@pytest.mark.parametrize("alone", [False, True])
async def test_a_lone_leader_does_not_wait_a_turn_for_others(alone):
    # Two requests read in one turn find the model idle: the first leads. Unless the caller said it
    # was alone, it waits one turn and the second joins its batch; alone, it runs at once.
    runner = FakeRunner()
    b, _ = await started(runner, inline_batch_ms=math.inf)  # quick from the first batch on
    first = asyncio.ensure_future(b.submit(rows(1), alone=alone))
    second = asyncio.ensure_future(b.submit(rows(1, start=10.0)))
    await asyncio.gather(first, second)
    assert runner.batches == ([1, 1] if alone else [2]), runner.batches
    await b.stop()
