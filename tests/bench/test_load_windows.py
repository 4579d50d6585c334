"""bench/load_windows.py and bench/h2load.py: windows labelled by when tuning finished, pooled req/s and
p99 per model and generator, and h2load's per-request log read back."""

import numpy as np
import pytest

from bench import h2load, load_windows as windowed

pytestmark = pytest.mark.timeout(30)


def window(model, generator, started, ended, requests, latencies_ms):
    return dict(model=model, generator=generator, started=started, ended=ended, requests=requests,
                seconds=ended - started, errors=0, latencies=np.asarray(latencies_ms) / 1e3)


def test_windows_are_labelled_by_when_tuning_finished():
    ws = [window("m", "h2load", 0, 3, 1, [1]), window("m", "h2load", 3, 6, 1, [1]), window("m", "h2load", 6, 9, 1, [1])]
    windowed.label(ws, tuned_at=4.0)
    assert [w["phase"] for w in ws] == ["tuning", "mixed", "steady"]
    windowed.label(ws, tuned_at=None)  # never tuned: every window ran while tuning
    assert {w["phase"] for w in ws} == {"tuning"}


def test_compare_pools_windows_and_leaves_mixed_ones_out():
    ws = [window("digits", "h2load", 0, 2, 100, [1.0] * 100),  # tuning: 50 req/s
          window("digits", "h2load", 2, 4, 900, [9.0] * 900),  # mixed: counted nowhere
          window("digits", "h2load", 4, 6, 120, [1.0] * 119 + [2.0]),  # steady: 60 req/s
          window("digits", "h2load", 6, 8, 120, [1.0] * 120)]
    windowed.label(ws, tuned_at=3.0)
    (row,) = windowed.compare(ws)
    assert row["rps_tuning"] == 50.0 and row["rps_steady"] == 60.0
    assert row["rps_ratio"] == pytest.approx(50 / 60, abs=1e-3)
    assert row["windows"] == {"tuning": 1, "mixed": 1, "steady": 2}
    assert row["p99_ms_tuning"] == 1.0 and row["p99_ratio"] == pytest.approx(1.0 / row["p99_ms_steady"], abs=1e-3)
    assert row["met"] is True  # 0.83x the steady req/s (>= 0.8) and a p99 no higher than steady's


def test_compare_misses_without_a_steady_window_and_on_a_slow_tuning_phase():
    ws = [window("bf16", "loadgen", 0, 2, 20, [5.0] * 20), window("bf16", "loadgen", 3, 5, 100, [1.0] * 100)]
    windowed.label(ws, tuned_at=None)
    assert windowed.compare(ws)[0]["rps_steady"] is None and not windowed.compare(ws)[0]["met"]
    windowed.label(ws, tuned_at=2.5)
    (row,) = windowed.compare(ws)
    assert row["rps_ratio"] == 0.2 and row["p99_ratio"] == 5.0 and not row["met"]


def test_stored_windows_drop_latencies_and_start_at_zero():
    ws = [window("m", "h2load", 10, 13, 5, [1, 2]), window("m", "loadgen", 13, 16, 5, [1])]
    windowed.label(ws, tuned_at=12.0)
    stored = windowed.stored(ws)
    assert [w["at_s"] for w in stored] == [0.0, 3.0]
    assert "latencies" not in stored[0] and stored[1]["phase"] == "steady"


def test_h2load_log_counts_statuses_and_keeps_the_200s_latencies():
    text = "1700000000000000\t200\t1500\n1700000000000100\t503\t200\n1700000000000200\t200\t2500\n" \
           "1700000000000300\t-1\t0\n\nnot a row\n"
    latencies, statuses = h2load.read_log(text)
    assert statuses == {"-1": 1, "200": 2, "503": 1}
    assert latencies.tolist() == [0.0015, 0.0025]


def test_h2load_is_found_in_a_folder_before_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert h2load.find(tmp_path) is None
    (tmp_path / "h2load").write_text("")
    assert h2load.find(tmp_path) == tmp_path / "h2load"
