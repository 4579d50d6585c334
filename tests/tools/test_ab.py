"""tools/ab.py: comparing alternated runs of two kernel versions (no GPU needed)."""

import json

import pytest

from tools.ab import compare, report, runs


def write(path, rows):
    path.write_text(json.dumps({"gpu": "test", "rows": rows}))
    return str(path)


def row(M, impl, us, dtype="bfloat16"):
    return dict(M=M, N=4096, K=4096, dtype=dtype, impl=impl, median_us=us)


def test_medians_over_each_sides_runs_and_the_peers_as_control(tmp_path):
    a = [write(tmp_path / "a1.json", [row(1, "fusedserve", 10.0), row(1, "cublaslt_fused", 14.0)]),
         write(tmp_path / "a2.json", [row(1, "fusedserve", 10.4), row(1, "cublaslt_fused", 14.2)]),
         write(tmp_path / "a3.json", [row(1, "fusedserve", 10.2), row(1, "cublaslt_fused", 14.1)])]
    b = [write(tmp_path / "b1.json", [row(1, "fusedserve", 9.0), row(1, "cublaslt_fused", 14.1),
                                      row(16, "fusedserve", 9.9)]),  # B only: not compared
         write(tmp_path / "b2.json", [row(1, "fusedserve", 9.4), row(1, "cublaslt_fused", 14.1),
                                      {"M": 1, "N": 4096, "K": 4096, "dtype": "bfloat16", "impl": "broken",
                                       "error": "no kernel"}])]  # a failed impl has no time: skipped
    rows = {r["impl"]: r for r in compare(a, b)}
    assert set(rows) == {"fusedserve", "cublaslt_fused"}
    ours, peer = rows["fusedserve"], rows["cublaslt_fused"]
    assert (ours["a_us"], ours["b_us"], ours["a_runs"], ours["b_runs"]) == (10.2, 9.2, 3, 2)
    assert ours["b_over_a"] == pytest.approx(9.2 / 10.2, abs=1e-4) and not ours["peer"]
    assert peer["peer"] and peer["b_over_a"] == pytest.approx(14.1 / 14.1)
    text = report(compare(a, b))
    assert "peers B/A 1.000-1.000" in text and "fusedserve" in text and "cublaslt_fused " not in text


def test_nothing_shared_compares_nothing(tmp_path):
    a = [write(tmp_path / "a.json", [row(1, "fusedserve", 10.0)])]
    b = [write(tmp_path / "b.json", [row(4, "fusedserve", 10.0)])]
    assert compare(a, b) == []


def test_runs_say_where_and_when(tmp_path):
    path = tmp_path / "kernels_a_1.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-12-03T16:11:50+00:00", "torch": "2.11.0",
                                "triton": "3.6.0", "rows": []}))
    assert runs([str(path)], "a") == [dict(side="a", file="kernels_a_1.json", gpu="NVIDIA H200",
                                           date="2026-12-03T16:11:50+00:00", torch="2.11.0", triton="3.6.0")]
