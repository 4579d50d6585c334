"""bench/model_contract.py without a GPU: the targets it reports."""

from bench.model_contract import summary


def test_summary_holds_launch_bound_rows_to_the_higher_target():
    rows = [dict(model="a", batch=1, ratio=1.2, launch_bound=True), dict(model="a", batch=700, ratio=1.01,
                                                                         launch_bound=False)]
    s = summary(rows)
    assert (s["rows"], s["min_ratio"], s["met"]) == (2, 1.01, False)
    assert s["misses"] == ["a batch=1: 1.20x (want 1.3x)"]
    assert summary([dict(rows[1])])["met"] and not summary([])["met"]
