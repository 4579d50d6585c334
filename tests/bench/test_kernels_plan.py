"""bench/kernels.py's plan: which shapes a run measures for its flags (no GPU needed)."""

import torch

from bench.kernels import FP32_MS, FULL_MS, FULL_NK, QUICK_MS, plan

BF16, FP16 = torch.bfloat16, torch.float16


def test_full_plan_covers_every_shape_dtype_and_batch_headline_first():
    shapes = plan(quick=False)
    assert shapes[0] == (FULL_MS[0], 4096, 4096, BF16)
    assert len(shapes) == len(FULL_NK) * 2 * len(FULL_MS) + len(FP32_MS)
    assert {(N, K) for _, N, K, _ in shapes} == set(FULL_NK)


def test_nk_runs_the_full_batches_and_dtypes_at_those_shapes_only():
    shapes = plan(quick=False, nk=[(8192, 8192), (1024, 1024)])
    assert shapes == [(M, N, K, dt) for N, K in ((8192, 8192), (1024, 1024)) for dt in (BF16, FP16) for M in FULL_MS]


def test_ms_dtypes_and_nk_combine():
    # --ms and --dtypes used to override --nk silently: the run measured N=K=4096 instead.
    shapes = plan(quick=True, ms=[1, 16], dtypes=[BF16], nk=[(4096, 2048), (4096, 16384)])
    assert shapes == [(1, 4096, 2048, BF16), (16, 4096, 2048, BF16), (1, 4096, 16384, BF16), (16, 4096, 16384, BF16)]


def test_ms_alone_stays_at_the_headline_shape_in_the_order_given():
    assert plan(quick=False, ms=[16, 1]) == [(16, 4096, 4096, BF16), (1, 4096, 4096, BF16),
                                             (16, 4096, 4096, FP16), (1, 4096, 4096, FP16)]
    assert plan(quick=False, dtypes=[FP16]) == [(M, 4096, 4096, FP16) for M in FULL_MS]
    assert plan(quick=True, dtypes=[FP16]) == [(M, 4096, 4096, FP16) for M in QUICK_MS]


def test_quick_plan_includes_the_wide_layer_and_fp32():
    shapes = plan(quick=True)
    assert (1, 11008, 4096, BF16) in shapes and (1, 4096, 4096, torch.float32) in shapes
