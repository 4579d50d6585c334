"""bench/model_contract.py without a GPU: the targets it reports."""

import functools

from bench.model_contract import summary


def test_summary_holds_launch_bound_rows_to_the_higher_target():
    rows = [dict(model="a", batch=1, ratio=1.2, launch_bound=True), dict(model="a", batch=700, ratio=1.01,
                                                                         launch_bound=False)]
    s = summary(rows)
    assert (s["rows"], s["min_ratio"], s["met"]) == (2, 1.01, False)
    assert s["misses"] == ["a batch=1: 1.20x (want 1.3x)"]
    assert summary([dict(rows[1])])["met"] and not summary([])["met"]


def test_random_models_are_seeded_and_batches_are_never_powers_of_two():
    from bench.model_contract import random_models

    drawn = random_models(9, seed=5)
    assert drawn == random_models(9, seed=5) and drawn != random_models(9, seed=6)
    assert {spec[4] for spec, _ in drawn} == {"float32", "float16", "bfloat16"}
    for (_, fan_in, hidden, out, _), batches in drawn:
        assert 1 <= len(hidden) <= 4 and all(64 <= w <= 4096 and w % 8 == 0 for w in hidden), hidden
        assert 8 <= fan_in <= 2048 and 8 <= out <= 1024
        assert batches and all(1 < b <= 1001 and b & (b - 1) for b in batches), batches


def test_issue_36s_targets_are_summarised_beside():
    rows = [dict(model="a", batch=3, ratio=0.99, launch_bound=False), dict(model="a", batch=77, ratio=1.2,
                                                                          launch_bound=False)]
    assert summary(rows)["issue36_met"] and not summary(rows[:1])["issue36_met"]


def test_a_slow_block_of_end_to_end_pairs_does_not_set_the_ratio(monkeypatch):
    import time
    from types import SimpleNamespace

    import torch

    from bench import model_contract

    def busy(us):
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass

    calls = {"run": 0}

    def run(x):  # ours: 300 us for the first block's calls, 100 us after; the peer 150 us throughout
        calls["run"] += 1
        busy(300 if calls["run"] <= 20 else 100)

    runner = SimpleNamespace(run=run, compute=lambda bucket: None)
    monkeypatch.setattr(model_contract, "device_us", lambda step: 1.0)
    monkeypatch.setattr(model_contract, "synchronized", lambda step: step)
    monkeypatch.setattr(model_contract, "RunnerAsPeer", lambda runner, batch, staging=False: lambda x: busy(100))
    monkeypatch.setattr(model_contract, "alternate", functools.partial(model_contract.alternate, warmup=0))
    class Peer:  # the torch graph: 150 us a call
        graph = SimpleNamespace(replay=lambda: None)

        def __call__(self, x):
            busy(150)

        def device_us(self):
            return 1.0

    times = model_contract.time_row(runner, Peer(), torch.zeros(8, 4), bucket=8, calls=80)
    assert len(times["ratio_blocks"]) == model_contract.E2E_BLOCKS == 4
    assert times["ratio_blocks"][0] < 0.6 and min(times["ratio_blocks"][1:]) > 1.2, times["ratio_blocks"]
    assert times["ratio"] > 1.2, "the median block counts, not the slow one"
