"""Which batches a runner times (the sampling policy alone, with a stand-in clock)."""

import pytest

from fusedserve.models import timing
from fusedserve.models.timing import TimingSampler


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing.time, "monotonic", clock.monotonic)
    return clock


def test_eager_batches_are_always_timed(clock):
    sampler = TimingSampler(every=4, min_interval_s=3600)
    assert all(sampler.due(8, each_batch=True) for _ in range(10))


def test_first_batch_then_every_nth_of_each_bucket(clock):
    sampler = TimingSampler(every=3, min_interval_s=0)
    assert [sampler.due(8, each_batch=False) for _ in range(7)] == [True, False, False] * 2 + [True]
    # Buckets count apart: bucket 4's first batch is timed whatever bucket 8 did.
    assert sampler.due(4, each_batch=False)


def test_min_interval_skips_a_due_batch_and_counts_again(clock):
    sampler = TimingSampler(every=2, min_interval_s=1.0)
    assert sampler.due(1, each_batch=False)
    clock.now += 0.5
    # Batch 3 is due by count but too soon: skipped, and the clock is read again at batch 5.
    assert [sampler.due(1, each_batch=False) for _ in range(3)] == [False, False, False]
    clock.now += 1.0
    assert [sampler.due(1, each_batch=False) for _ in range(3)] == [True, False, False]


@pytest.mark.parametrize("every, interval, match", [
    (0, 0.0, "timing_sample_every"), (True, 0.0, "timing_sample_every"), (2.0, 0.0, "timing_sample_every"),
    (1, -1.0, "timing_min_interval_s"), (1, float("nan"), "timing_min_interval_s"), (1, "1", "timing_min_interval_s"),
])
def test_bad_arguments_name_the_runner_argument(every, interval, match):
    with pytest.raises(ValueError, match=match):
        TimingSampler(every, interval)
