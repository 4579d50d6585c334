"""bench/kernel_random.py: the seeded random shapes of ``kernels.py --random`` and the summaries."""

from types import SimpleNamespace

import torch

from bench import kernel_random
from bench.kernel_random import draw_shapes, peer_summary, provisional_summary
from fusedserve.kernels import choosing


def test_random_shapes_are_seeded_in_range_and_multiples_of_8():
    shapes = draw_shapes(400, seed=7)
    assert shapes == draw_shapes(400, seed=7), "the same seed draws the same shapes"
    assert shapes[:20] != draw_shapes(20, seed=8), "another seed draws other shapes"
    for M, N, K, dtype in shapes:
        assert 1 <= M <= 8192 and 256 <= N <= 16384 and 256 <= K <= 16384, (M, N, K)
        assert N % 8 == 0 and K % 8 == 0, (M, N, K)
        assert dtype in (torch.bfloat16, torch.float16)
    ms = [s[0] for s in shapes]
    # Log-uniform M: both ends of the range are drawn, not only the middle.
    assert min(ms) <= 4 and max(ms) >= 4096 and sum(m <= 64 for m in ms) > 100, sorted(ms)[:5]
    assert {s[3] for s in shapes} == {torch.bfloat16, torch.float16}


def _rows(shape, **us):
    M, N, K, dtype = shape
    return [dict(M=M, N=N, K=K, dtype=dtype, impl=impl, median_us=t) for impl, t in us.items()]


def test_summaries_name_the_shapes_that_miss():
    a, b = (3000, 3072, 3072, "bfloat16"), (16, 4096, 4096, "float16")
    rows = (_rows(a, fusedserve_static_weight=10.0, torch_unfused=8.0, cublaslt_fused=7.4, fusedserve_provisional=11.0)
            + _rows(b, fusedserve_static_weight=10.0, torch_unfused=14.0, cublaslt_fused=13.0,
                    fusedserve_provisional=10.2))
    peers = peer_summary(rows)
    assert (peers["min"], peers["median"], peers["shapes"]) == (0.74, 1.02, 2)
    assert peers["losing"] == [dict(M=3000, N=3072, K=3072, dtype="bfloat16", ratio=0.74)] and not peers["met"]
    versus = provisional_summary(rows)
    assert versus["max"] == 1.1 and [r["M"] for r in versus["slower"]] == [3000] and not versus["met"]
    assert peer_summary([r for r in rows if r["impl"] != "torch_unfused" and r["impl"] != "cublaslt_fused"]) is None


def test_random_shapes_draw_the_dtypes_asked_for():
    assert {s[3] for s in draw_shapes(50, seed=3, dtypes=(torch.float32,))} == {torch.float32}


def test_the_summary_counts_our_families_wins_errors_and_first_calls():
    a, b, c = (300, 1024, 1024, "float16"), (8, 2048, 2048, "bfloat16"), (9, 512, 512, "bfloat16")
    rows = (_rows(a, fusedserve_static_weight=10.0, torch_unfused=10.1, cublaslt_fused=10.0)
            + _rows(b, fusedserve_static_weight=5.0, torch_unfused=6.0, cublaslt_fused=6.5)
            + _rows(c, fusedserve_static_weight=5.0, torch_unfused=6.0, cublaslt_fused=6.5))
    for row in rows:
        row["max_rel_err"] = 1e-3
        if row["impl"] == "fusedserve_static_weight":
            row["kernel"] = "torch_cublas" if row["M"] == 300 else "gluon_small_m"
            row["first_call_s"] = 0.2 if row["M"] == 8 else 0.7
            row["max_rel_err"] = 3e-3 if row["M"] == 9 else 1e-3  # 3x torch's own error
    summary = peer_summary(rows)
    assert summary["own_share"] == round(2 / 3, 3) and summary["first_call_max_s"] == 0.7
    assert summary["errors_over_torch"] == [dict(M=9, N=512, K=512, dtype="bfloat16")] and not summary["met"]


def test_our_own_choice_leaves_the_vendor_out(monkeypatch):
    offered = [SimpleNamespace(name="torch_cublas"), SimpleNamespace(name="triton_tiled"),
               SimpleNamespace(name="gluon_ws")]
    monkeypatch.setattr(kernel_random.registry, "offered", lambda problem: offered)
    asked = []

    def choose(problem, x, w, b, activation, static_weight=False, families=None):
        asked.append((families, static_weight))
        return choosing.Choice("triton_tiled", {"BLOCK_M": 64}, tuned=True, source="tuned")

    monkeypatch.setattr(kernel_random.choosing, "choose", choose)
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    assert kernel_random.describe_own(x, w, b)[0] == "triton_tiled"
    assert [[f.name for f in families] for families, _ in asked] == [["triton_tiled", "gluon_ws"]]
    assert asked[0][1], "as a served layer: static weights"


def test_the_own_summary_compares_our_best_family_where_the_vendor_won():
    a, b = (3000, 3072, 3072, "bfloat16"), (700, 1024, 4096, "float16")
    rows = (_rows(a, fusedserve_static_weight=10.0, fusedserve_own=10.3)
            + _rows(b, fusedserve_static_weight=20.0, fusedserve_own=24.0))
    own = provisional_summary(rows, provisional_impl=kernel_random.OWN)
    assert (own["min"], own["max"], own["shapes"]) == (1.03, 1.2, 2)
    assert [r["M"] for r in own["slower"]] == [700] and not own["met"]
