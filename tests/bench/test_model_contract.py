"""bench/model_contract.py without a GPU: the targets it reports."""

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
