"""Provisional warm-up and background tuning on the CPU: the runner's real retune and swap, with
the torch backend standing in for kernels whose tune cache is empty."""

import logging
import threading
import time

import pytest
import torch

from fusedserve.kernels import tuning
from fusedserve.models import MLP, MLPConfig, ModelRunner
from fusedserve.models.background import BackgroundTuner

CONFIG = MLPConfig(in_features=17, hidden_features=(70, 3), out_features=5)
BUCKETS = [1, 2, 4, 8]


def make_model():
    torch.manual_seed(0)
    model = MLP(CONFIG, backend="torch", name="tiny").eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    return model


def provisional_runner(model=None):
    """A runner whose layers count as untuned, as on a GPU with an empty tune cache, warmed up."""
    runner = ModelRunner(model or make_model(), max_batch_size=8)
    runner._paths["layers"].tuned = lambda bucket: False
    runner.warmup()
    return runner


def test_warmup_is_provisional_where_nothing_is_tuned_and_splits_its_time():
    runner = provisional_runner()
    assert runner.choice_states == dict.fromkeys(BUCKETS, "provisional")
    assert runner.provisional_buckets() == BUCKETS
    assert runner.startup_seconds["compile"] > 0 and runner.startup_seconds["tune"] == 0, runner.startup_seconds


def test_a_runner_with_nothing_to_tune_is_fixed():
    runner = ModelRunner(make_model(), max_batch_size=8)
    runner.warmup()
    assert runner.choice_states == dict.fromkeys(BUCKETS, "fixed") and runner.provisional_buckets() == []


def test_a_swap_waits_for_the_batch_in_flight():
    runner = provisional_runner()
    with runner._lock:  # what a batch holds for its whole run
        swapper = threading.Thread(target=runner.retune, args=(4,))
        swapper.start()
        swapper.join(0.3)
        assert swapper.is_alive() and runner.choice_states[4] == "provisional", "swapped under a running batch"
    swapper.join(5)
    assert runner.choice_states[4] == "tuned" and runner.provisional_buckets() == [1, 2, 8]


def test_background_tuning_under_traffic_answers_every_request_and_never_swaps_mid_batch():
    model = make_model()
    runner = provisional_runner(model)
    real_forward, changed_mid_batch = runner._forward, []

    def slow_forward(bucket, path, hook=None):  # a batch long enough for a swap to try to land in it
        before = runner.choice_states[bucket]
        time.sleep(0.001)
        out = real_forward(bucket, path, hook)
        if runner.choice_states[bucket] != before:
            changed_mid_batch.append(bucket)
        return out

    runner._forward = slow_forward
    wrong, answered, stop = [], [], threading.Event()

    def traffic():
        g = torch.Generator().manual_seed(1)
        while not stop.is_set() or len(answered) < 50:
            x = torch.randn(int(torch.randint(1, 9, (1,), generator=g)), 17, generator=g)
            if not torch.allclose(runner.run(x), model(x), rtol=1e-5, atol=1e-5):
                wrong.append(x.shape[0])
            answered.append(x.shape[0])

    client = threading.Thread(target=traffic)
    client.start()
    tuner = BackgroundTuner([runner], pause_s=0)
    tuner.start()
    tuner.join(30)
    stop.set()
    client.join(30)
    assert not tuner.running and sorted(b for _, b, _ in tuner.tuned) == BUCKETS and tuner.failed == []
    assert runner.choice_states == dict.fromkeys(BUCKETS, "tuned")
    assert wrong == [] and changed_mid_batch == [] and len(answered) >= 50


class FakeRunner:
    """What the tuner asks of a runner; retune times candidates (``tuning._pause`` between them)."""

    name = "fake"
    device = torch.device("cpu")

    def __init__(self, fail=()):
        self.fail, self.retuned = fail, []

    def provisional_buckets(self):
        return [1, 2, 4]

    def retune(self, bucket):
        if bucket in self.fail:
            raise RuntimeError("stand-in for a kernel that does not build")
        for _ in range(3):
            tuning._pause()
        self.retuned.append(bucket)
        return "layers"


def test_a_failed_bucket_keeps_its_choice_and_tuning_goes_on(caplog):
    runner = FakeRunner(fail=(2,))
    tuner = BackgroundTuner([runner], pause_s=0)
    tuner.start()
    tuner.join(10)
    assert runner.retuned == [1, 4] and tuner.failed == [("fake", 2)]
    assert "tuning of 'fake' at M=2 failed" in caplog.text


def test_stop_ends_tuning_at_the_next_candidate():
    runner = FakeRunner()
    tuner = BackgroundTuner([runner], pause_s=60)
    tuner.start()
    time.sleep(0.1)
    start = time.perf_counter()
    tuner.stop(timeout=10)
    assert not tuner.running and time.perf_counter() - start < 5
    assert runner.retuned == [] and tuner.tuned == []


def test_isolated_tuning_runs_a_worker_process_and_swaps_what_it_reports(caplog):
    caplog.set_level(logging.INFO, logger="fusedserve.models.background")
    runner = provisional_runner()
    tuner = BackgroundTuner([runner], pause_s=0, isolate=True)  # a real tune_worker, on the CPU
    tuner.start()
    tuner.join(120)
    assert not tuner.running and sorted(b for _, b, _ in tuner.tuned) == BUCKETS and tuner.failed == []
    assert runner.choice_states == dict.fromkeys(BUCKETS, "tuned")
    assert caplog.text.count("tuning worker of 'tiny'") == len(BUCKETS), caplog.text


def test_what_a_failed_worker_left_is_tuned_in_this_process(monkeypatch, caplog):
    import sys

    from fusedserve.models import tune_worker

    # A worker that reports bucket 2 done, then dies.
    monkeypatch.setattr(tune_worker, "argv", lambda runner, buckets, **_: [
        sys.executable, "-c", "import sys; print('TUNED 2', flush=True); sys.exit(3)"])
    runner = provisional_runner()
    tuner = BackgroundTuner([runner], pause_s=0, isolate=True)
    tuner.start()
    tuner.join(60)
    assert [b for _, b, _ in tuner.tuned] == [2, 1, 4, 8] and runner.provisional_buckets() == []
    assert "exited with code 3" in caplog.text and "left M=1,4,8 untuned" in caplog.text


def test_a_worker_gate_waits_while_the_server_is_busy_and_always_progresses():
    import os

    from fusedserve.models.tune_worker import BusyGate

    read, write = os.pipe()
    gate = BusyGate(read, max_wait_s=0.3, poll_s=0.01)
    try:
        for state, low, high in ((b"1", 0.28, 2.0), (b"0", 0.0, 0.1), (b"101", 0.28, 2.0)):
            os.write(write, state)  # the last byte written is the state
            start = time.perf_counter()
            gate()
            assert low <= time.perf_counter() - start < high, state
        os.close(write)  # the server is gone: nothing to yield to
        write = None
        start = time.perf_counter()
        gate()
        assert time.perf_counter() - start < 0.1 and not gate.busy
    finally:
        os.close(read)
        if write is not None:
            os.close(write)


def test_tuning_in_process_waits_between_candidates_while_busy(monkeypatch):
    from fusedserve.models import tune_worker

    monkeypatch.setattr(tune_worker, "BUSY_WAIT_S", 0.3)
    busy = [True]
    tuner = BackgroundTuner([FakeRunner()], pause_s=0.001, busy=lambda: busy[0])
    start = time.perf_counter()
    tuner._between()
    assert 0.28 <= time.perf_counter() - start < 2.0
    busy[0] = False
    start = time.perf_counter()
    tuner._between()
    assert time.perf_counter() - start < 0.1


def test_an_isolated_worker_hears_the_servers_busy_state(caplog):
    caplog.set_level(logging.INFO, logger="fusedserve.models.background")
    runner = provisional_runner()
    tuner = BackgroundTuner([runner], pause_s=0, isolate=True, busy=lambda: True)  # a real worker, --busy-fd
    tuner.start()
    tuner.join(120)
    assert not tuner.running and sorted(b for _, b, _ in tuner.tuned) == BUCKETS and tuner.failed == []


@pytest.mark.timeout(240)
def test_a_cuda_models_candidates_compile_ahead_for_its_worker_to_wait_on(tmp_path, monkeypatch, caplog):
    # The CUDA branch without a GPU: the compile processes work on a virtual H100 from the model's
    # config alone, mark each bucket, and the worker's command line points at their marks.
    from fusedserve.models import aot, tune_worker

    caplog.set_level(logging.INFO, logger="fusedserve.models.background")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(aot, "local_target", lambda device: aot.targets("9.0", ["NVIDIA H100 80GB HBM3"])[0])
    runner = provisional_runner()
    (tmp_path / "marks").mkdir()
    progress = BackgroundTuner([runner])._compile_candidates(runner, [1], str(tmp_path / "marks"))
    deadline = time.monotonic() + 100
    while not (tmp_path / "marks" / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    marks = sorted(p.name for p in (tmp_path / "marks").iterdir())
    assert marks == [f"1.{share}" for share in range(progress.shares)] + ["done"], marks
    assert "--compiled" in tune_worker.argv(runner, [1], compiled=progress)
    deadline = time.monotonic() + 10  # (the log line follows the mark, from the compile's thread)
    while "candidate launches of 'tiny' compiled in" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "candidate launches of 'tiny' compiled in" in caplog.text, caplog.text
