"""bench/kernels.py --merge: one result from several runs, each shape from one run (no GPU needed)."""

import pytest

from bench.kernels import merge_runs


def run(date, rows, gpu="NVIDIA H200", **extra):
    return dict(gpu=gpu, date=date, torch="2.11", triton="3.6.0", copy_tbps=4.2, matmul_tflops=690.0,
                rows=[dict(M=M, N=4096, K=4096, dtype="bfloat16", impl=impl, median_us=us) for M, impl, us in rows],
                **extra)


def test_each_shape_comes_from_the_newest_run_that_measured_it():
    old = run("d1", [(1, "fusedserve", 10.0), (1, "cublaslt_fused", 14.0), (1, "torch_compile", 16.0),
                     (2, "fusedserve", 10.5), (2, "cublaslt_fused", 14.1), (2, "fusedserve_gluon", 23.0)])
    new = run("d2", [(1, "fusedserve", 9.0), (1, "cublaslt_fused", 14.2)], complete=False)
    merged = merge_runs([old, new])
    cells = {(r["M"], r["impl"]): (r["median_us"], r["run"]) for r in merged["rows"]}
    # M=1: ours and cuBLASLt from the newer run; torch.compile, which it did not time, from the older.
    assert cells[(1, "fusedserve")] == (9.0, "d2") and cells[(1, "cublaslt_fused")] == (14.2, "d2")
    assert cells[(1, "torch_compile")] == (16.0, "d1")
    # M=2: only the older run measured it, all of it kept (ours too).
    assert cells[(2, "fusedserve")] == (10.5, "d1") and cells[(2, "fusedserve_gluon")] == (23.0, "d1")
    assert len(merged["rows"]) == 6
    assert merged["date"] == "d2" and [r["date"] for r in merged["runs"]] == ["d1", "d2"]
    assert merged["complete"] is False  # one source run was cut short


def test_an_older_run_never_replaces_our_rows():
    # Only peers are filled in from older runs: an impl of ours that the newest run of a shape
    # lacks stays absent rather than mixing two versions of our kernels in one shape.
    old = run("d1", [(1, "fusedserve", 10.0), (1, "fusedserve_tiled", 18.0), (1, "cublaslt_fused", 14.0)])
    new = run("d2", [(1, "fusedserve", 9.0), (1, "cublaslt_fused", 14.2)])
    impls = {r["impl"] for r in merge_runs([old, new])["rows"]}
    assert impls == {"fusedserve", "cublaslt_fused"}


def test_runs_of_different_gpus_are_refused():
    with pytest.raises(ValueError, match="different GPUs"):
        merge_runs([run("d1", [], gpu="NVIDIA H200"), run("d2", [], gpu="NVIDIA H100")])
