"""Cold-start compiling in worker processes (models.precompile): when it starts them, how it splits
the buckets, and real workers on the CPU."""

import logging
import sys

import torch

from fusedserve.models import MLP, MLPConfig, ModelRunner, precompile, tune_worker


class FakeRunner:
    """What warm_up asks of a runner on CUDA; ``compile_s``: what warming its first bucket compiled."""

    device = torch.device("cuda")

    def __init__(self, name, compile_s):
        self.name, self.buckets, self.compile_s = name, [1, 2, 4, 8], compile_s
        self.startup_seconds, self.warmed = {"compile": 0.0}, []

    def needs_tuning(self, bucket):
        return bucket not in self.warmed

    def warm(self, bucket):
        self.warmed.append(bucket)
        self.startup_seconds["compile"] += self.compile_s
        return self.compile_s

    def warmup(self):
        left = [b for b in self.buckets if b not in self.warmed]
        return {b: self.warm(b) for b in left}


def test_a_cold_first_bucket_sends_the_rest_to_compile_workers(monkeypatch):
    sent = []
    monkeypatch.setattr(precompile, "precompile", lambda jobs, workers: sent.append(jobs))
    a, b = FakeRunner("a", compile_s=3.0), FakeRunner("b", compile_s=3.0)
    seconds = precompile.warm_up([a, b], max_workers=4)
    assert [(r.name, m) for r, m in sent[0]] == [("a", 2), ("a", 4), ("a", 8), ("b", 1), ("b", 2), ("b", 4), ("b", 8)]
    assert seconds == {"a": dict.fromkeys([1, 2, 4, 8], 3.0), "b": dict.fromkeys([1, 2, 4, 8], 3.0)}


def test_a_warm_triton_cache_starts_no_worker(monkeypatch):
    sent = []
    monkeypatch.setattr(precompile, "precompile", lambda jobs, workers: sent.append(jobs))
    precompile.warm_up([FakeRunner("a", compile_s=0.2)])
    precompile.warm_up([FakeRunner("a", compile_s=3.0)], parallel=False)
    assert sent == []


def test_split_deals_each_runners_buckets_over_the_workers():
    a, b = FakeRunner("a", 0), FakeRunner("b", 0)
    jobs = [(a, m) for m in (1, 2, 4, 8, 16, 32)] + [(b, m) for m in (1, 2)]
    groups = precompile.split(jobs, 4)
    assert [(r.name, ms) for r, ms in groups] == [("a", [1, 8]), ("a", [2, 16]), ("a", [4, 32]), ("b", [1, 2])]
    assert sorted((r.name, m) for r, ms in groups for m in ms) == sorted((r.name, m) for r, m in jobs)


def test_real_compile_workers_run_and_a_failed_one_is_logged(monkeypatch, caplog):
    model = MLP(MLPConfig(17, (70,), 5), name="tiny").eval()
    runner = ModelRunner(model, max_batch_size=8)
    assert precompile.precompile([(runner, 2)], 1) > 0  # a real worker, --warm, on the CPU
    assert "exited with code" not in caplog.text
    monkeypatch.setattr(tune_worker, "argv",
                        lambda runner, buckets, warm: [sys.executable, "-c", "raise SystemExit(5)"])
    with caplog.at_level(logging.WARNING):
        precompile.precompile([(runner, 4)], 1)
    assert "exited with code 5; those buckets compile here" in caplog.text
