"""tools/ab.py: comparing alternated runs of two kernel versions (no GPU needed)."""

import json

import pytest

from bench.runs import read
from tools.ab import compare, main, report, runs


def write(path, rows, **head):
    """One run's line, as bench/kernels.py appends it, in a kernels.jsonl of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": "test", "rows": rows, **head}) + "\n")
    return str(path)


def row(M, impl, us, dtype="bfloat16"):
    return dict(M=M, N=4096, K=4096, dtype=dtype, impl=impl, median_us=us)


def sides(tmp_path):
    a = [write(tmp_path / "a1" / "kernels.jsonl", [row(1, "fusedserve", 10.0), row(1, "cublaslt_fused", 14.0)]),
         write(tmp_path / "a2" / "kernels.jsonl", [row(1, "fusedserve", 10.4), row(1, "cublaslt_fused", 14.2)]),
         write(tmp_path / "a3" / "kernels.jsonl", [row(1, "fusedserve", 10.2), row(1, "cublaslt_fused", 14.1)])]
    b = [write(tmp_path / "b1" / "kernels.jsonl", [row(1, "fusedserve", 9.0), row(1, "cublaslt_fused", 14.1),
                                                   row(16, "fusedserve", 9.9)]),  # B only: not compared
         write(tmp_path / "b2" / "kernels.jsonl", [row(1, "fusedserve", 9.4), row(1, "cublaslt_fused", 14.1),
                                                   {"M": 1, "N": 4096, "K": 4096, "dtype": "bfloat16",
                                                    "impl": "broken", "error": "no kernel"}])]  # no time: skipped
    return a, b


def test_medians_over_each_sides_runs_and_the_peers_as_control(tmp_path):
    a, b = sides(tmp_path)
    rows = {r["impl"]: r for r in compare(a, b)}
    assert set(rows) == {"fusedserve", "cublaslt_fused"}
    ours, peer = rows["fusedserve"], rows["cublaslt_fused"]
    assert (ours["a_us"], ours["b_us"], ours["a_runs"], ours["b_runs"]) == (10.2, 9.2, 3, 2)
    assert ours["b_over_a"] == pytest.approx(9.2 / 10.2, abs=1e-4) and not ours["peer"]
    assert peer["peer"] and peer["b_over_a"] == pytest.approx(14.1 / 14.1)
    text = report(compare(a, b))
    assert "peers B/A 1.000-1.000" in text and "fusedserve" in text and "cublaslt_fused " not in text


def test_nothing_shared_compares_nothing(tmp_path):
    a = [write(tmp_path / "a.jsonl", [row(1, "fusedserve", 10.0)])]
    b = [write(tmp_path / "b.jsonl", [row(4, "fusedserve", 10.0)])]
    assert compare(a, b) == []


def test_runs_say_where_and_when_and_a_line_names_one_run(tmp_path):
    path = tmp_path / "kernels.jsonl"
    write(path, [], date="2026-12-03T16:11:50+00:00", torch="2.11.0", triton="3.6.0", commit="abc1234")
    with open(path, "a") as f:
        f.write(json.dumps({"gpu": "NVIDIA H200", "date": "later", "rows": []}) + "\n")
    assert runs([f"{path}:1"], "a") == [dict(side="a", run=f"{path}:1", gpu="test", commit="abc1234",
                                             date="2026-12-03T16:11:50+00:00", torch="2.11.0", triton="3.6.0")]
    assert runs([str(path)], "b")[0]["date"] == "later"  # a file alone: its last run


def test_the_comparison_is_appended_as_a_line(tmp_path, monkeypatch, capsys):
    a, b = sides(tmp_path)
    monkeypatch.setattr("sys.argv", ["ab.py", "--a", *a, "--b", *b, "--out", str(tmp_path), "--names", "main", "x"])
    main()
    (line,) = read(tmp_path / "ab.jsonl")
    assert (line["benchmark"], line["a"], line["b"], len(line["runs"])) == ("ab", "main", "x", 5)
    assert line["summary"]["peers_b_over_a"] == [1.0, 1.0] and len(line["rows"]) == 2
    assert "appended" in capsys.readouterr().out
