"""CpuThreads: each bucket runs on the thread count that timed faster at warm-up."""

import time

import pytest
import torch

from fusedserve.models import MLP, MLPConfig, ModelRunner
from fusedserve.models.threads import MARGIN, CpuThreads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def sleeper(one_s: float, many_s: float):
    """A step that takes ``one_s`` on one thread and ``many_s`` on more."""
    return lambda: time.sleep(one_s if torch.get_num_threads() == 1 else many_s)


@pytest.mark.parametrize("one_s, many_s, expected", [
    (0.002, 0.0002, 2),  # threads pay off
    (0.0002, 0.002, 1),  # threads cost more than they give
    (0.001, 0.001 * MARGIN * 1.05, 1),  # within the margin: one thread, the cores go to the front end
])
def test_choose_keeps_the_faster_count(two_threads, one_s, many_s, expected):
    threads = CpuThreads()
    assert threads.choose(8, sleeper(one_s, many_s)) == expected
    assert threads.by_bucket == {8: expected}
    torch.set_num_threads(3 - expected)  # the other count: use() must switch back
    threads.use(8)
    assert torch.get_num_threads() == expected


def test_one_thread_machine_needs_no_timing():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calls = []
        assert CpuThreads().choose(4, lambda: calls.append(1)) == 1
        assert calls == []  # nothing was timed
    finally:
        torch.set_num_threads(before)


def test_cpu_runner_chooses_every_bucket_and_runs_on_it(two_threads):
    torch.manual_seed(0)
    runner = ModelRunner(MLP(MLPConfig(16, (32,), 4)), max_batch_size=8)
    runner.warmup()
    chosen = runner._threads.by_bucket
    assert set(chosen) == set(runner.buckets) and set(chosen.values()) <= {1, 2}, chosen
    x = torch.randn(3, 16)
    torch.set_num_threads(3)  # neither choice: the run must set the bucket's own
    out = runner.run(x)
    assert torch.get_num_threads() == chosen[4]
    torch.testing.assert_close(out, runner.model(x), rtol=1e-5, atol=1e-6)  # same maths either way
