"""Which kernel families compete for a layer (the registry's order and each family's rules),
without a GPU: a problem says the compute capability, so Hopper can be asked about anywhere."""

import pytest
import torch

from fusedserve.kernels import registry
from fusedserve.kernels.rules import GLUON_SMALL_M_MAX, GLUON_WS_MIN_M, MID_M_MAX, SMALL_M_MAX, Problem

HOPPER = (9, 0)
AMPERE = (8, 0)
TILED, TMA, SMALL_M = "triton_tiled", "triton_tma_persistent", "triton_small_m"
GLUON, GLUON_SMALL_M, GLUON_WS, STREAM_K = "gluon_wgmma", "gluon_small_m", "gluon_ws", "gluon_stream_k"
VENDOR, SPLIT_K, TRITON_STREAM_K = "torch_cublas", "triton_split_k", "triton_stream_k"


def offered(M, dtype=torch.bfloat16, capability=HOPPER, tma_aligned=True, gluon=False, vendor=False, N=4096,
            K=4096, split_k=False, stream_k=False):
    """The families timed for this problem, the default first (Gluon's, the vendor's, split-K and
    both stream-K families left out unless ``gluon``, ``vendor``, ``split_k`` and ``stream_k``)."""
    names = [f.name for f in registry.offered(Problem(M, N, K, dtype, capability, tma_aligned))]
    return tuple(n for n in names if (gluon or not n.startswith("gluon")) and (vendor or n != VENDOR)
                 and (split_k or n != SPLIT_K) and (stream_k or n not in (STREAM_K, TRITON_STREAM_K)))


def test_every_family_registers_once_under_its_own_name():
    names = registry.names()
    assert set(names) == {TILED, TMA, SMALL_M, GLUON, GLUON_SMALL_M, GLUON_WS, SPLIT_K, VENDOR, STREAM_K,
                          TRITON_STREAM_K}
    assert len(names) == len(set(names))
    assert all(registry.family(n).name == n for n in names)
    with pytest.raises(ValueError, match="kernel family must be one of"):
        registry.family("no_such_kernel")


@pytest.mark.parametrize("M, N, K, capability, wanted", [
    # 72 tiles over a long K: cuBLAS won such shapes (docs/kernels.md); on Hopper's 16-bit TMA rows
    # too, where the partial sums load through TMA
    (163, 9160, 14376, HOPPER, True),
    (300, 1000, 4096, AMPERE, True),  # any GPU
    (300, 1000, 4096, None, False),  # not under the interpreter's automatic choice
    (64, 1000, 4096, HOPPER, False),  # weight streaming's rows
    (2048, 4096, 4096, HOPPER, False),  # the tiles fill the SMs
    (300, 1000, 1024, HOPPER, False),  # a short K
])
def test_split_k_competes_where_few_tiles_walk_a_long_k(M, N, K, capability, wanted):
    for dtype in (torch.bfloat16, torch.float32):
        for aligned in (True, False):
            assert (SPLIT_K in offered(M, dtype, capability=capability, N=N, K=K, split_k=True,
                                       tma_aligned=aligned)) is wanted, (dtype, aligned)


def test_split_k_loads_through_tma_only_on_hoppers_16_bit_tma_rows():
    family = registry.family(SPLIT_K)
    cases = ((torch.bfloat16, HOPPER, True, True), (torch.float16, HOPPER, False, False),
             (torch.bfloat16, AMPERE, True, False), (torch.float32, HOPPER, True, False))
    for dtype, capability, aligned, tma in cases:
        configs = family.candidates(Problem(683, 1024, 4520, dtype, capability, aligned))
        assert configs and all(c.get("TMA", False) is tma for c in configs), (dtype, capability, aligned)


@pytest.mark.parametrize("M", [1, 3, 16, 17, SMALL_M_MAX])
@pytest.mark.parametrize("capability", [None, AMPERE, HOPPER])
def test_small_batches_stream_weights_everywhere(M, capability):
    assert offered(M, capability=capability) == (SMALL_M,)
    assert offered(M, torch.float32, capability=capability) == (SMALL_M,)


@pytest.mark.parametrize("M", [SMALL_M_MAX + 1, 100, 130, MID_M_MAX])
def test_mid_batches_time_a_tiled_kernel_against_weight_streaming(M):
    assert offered(M, torch.float32) == (TILED, SMALL_M)
    assert offered(M, capability=None) == (TILED, SMALL_M)
    assert offered(M, capability=AMPERE) == (TILED, SMALL_M)
    assert offered(M, tma_aligned=False) == (TILED, SMALL_M)
    # Hopper's 16-bit TMA rows: the Gluon weight-streaming kernel's, not the Triton one's (which won
    # no tuned shape past SMALL_M_MAX there)
    assert offered(M, torch.bfloat16) == (TMA,)
    assert offered(M, torch.float16) == (TMA,)


@pytest.mark.parametrize("M", [MID_M_MAX + 1, 1000, 8192])
def test_large_batches_on_hopper_use_tma(M):
    assert offered(M, torch.bfloat16) == (TMA,)
    assert offered(M, torch.float16) == (TMA,)


@pytest.mark.parametrize("M", [1, 100, 4096])
def test_gluon_competes_where_it_accepts_the_shape(M):
    assert GLUON in offered(M, gluon=True)
    assert GLUON not in offered(M, gluon=True, tma_aligned=False)
    assert GLUON not in offered(M, torch.float32, gluon=True)
    assert GLUON not in offered(M, capability=AMPERE, gluon=True)
    assert GLUON not in offered(M, capability=None, gluon=True)


@pytest.mark.parametrize("M", [1, 3, 16, 17, SMALL_M_MAX])
def test_gluon_weight_streaming_competes_at_small_batches_on_hopper(M):
    # The Triton kernel stays the default (first); the Gluon ones are timed against it.
    ws = (GLUON_WS, ) if M > GLUON_WS_MIN_M else ()
    assert offered(M, gluon=True) == (SMALL_M, GLUON_SMALL_M, GLUON) + ws
    assert offered(M, torch.float16, gluon=True) == (SMALL_M, GLUON_SMALL_M, GLUON) + ws
    assert GLUON_SMALL_M not in offered(M, torch.float32, gluon=True)
    assert GLUON_SMALL_M not in offered(M, gluon=True, tma_aligned=False)
    assert GLUON_SMALL_M not in offered(M, capability=AMPERE, gluon=True)
    assert offered(GLUON_SMALL_M_MAX, gluon=True) == (TMA, GLUON_SMALL_M, GLUON, GLUON_WS)
    assert GLUON_SMALL_M not in offered(GLUON_SMALL_M_MAX + 1, gluon=True)


@pytest.mark.parametrize("M", [1, 17, 128])
def test_stream_k_is_an_experiment_the_tuner_does_not_time(M):
    assert STREAM_K not in offered(M, gluon=True, stream_k=True)
    assert registry.family(STREAM_K).unfit(Problem(M, 4096, 4096, torch.bfloat16, HOPPER, True)) is None


@pytest.mark.parametrize("M", [GLUON_WS_MIN_M + 1, SMALL_M_MAX, SMALL_M_MAX + 1, 256, 4096])
def test_warp_specialized_gluon_competes_past_small_batches_on_hopper(M):
    assert offered(M, gluon=True)[-1] == GLUON_WS
    assert offered(M, torch.float16, gluon=True)[-1] == GLUON_WS
    assert GLUON_WS not in offered(GLUON_WS_MIN_M, gluon=True)  # weight streaming's ground
    for kwargs in (dict(dtype=torch.float32), dict(tma_aligned=False), dict(capability=AMPERE)):
        assert GLUON_WS not in offered(M, gluon=True, **kwargs), kwargs


@pytest.mark.parametrize("kwargs", [
    dict(dtype=torch.float32),  # fp32 stays on the portable kernel (TF32 only if torch allows it)
    dict(capability=AMPERE),  # no TMA/WGMMA before Hopper
    dict(capability=(10, 0)),  # Hopper-only paths are for 9.x only
    dict(capability=None),  # the interpreter
    dict(tma_aligned=False),  # misaligned rows or views
])
def test_everything_else_gets_the_portable_kernel(kwargs):
    assert offered(1000, gluon=True, **kwargs) == (TILED,)


@pytest.mark.parametrize("name, problem, why", [
    (TMA, Problem(17, 40, 136, torch.float32, None, True), "fp16/bf16"),
    (TMA, Problem(17, 40, 130, torch.float16, HOPPER, False), "16-byte aligned"),
    (TMA, Problem(17, 40, 136, torch.float16, AMPERE, True), "Hopper GPU or the interpreter"),
    (GLUON, Problem(17, 40, 136, torch.float16, None, True), "Hopper GPU"),
    (GLUON_SMALL_M, Problem(300, 40, 136, torch.float16, HOPPER, True), "at most 256 rows"),
    (STREAM_K, Problem(129, 40, 136, torch.float16, HOPPER, True), "at most 128 rows"),
    (GLUON_WS, Problem(300, 40, 136, torch.float32, HOPPER, True), "fp16/bf16"),
])
def test_a_family_says_why_it_cannot_run_a_problem(name, problem, why):
    assert why in registry.family(name).unfit(problem)


@pytest.mark.parametrize("name", [TILED, SMALL_M])
def test_the_portable_families_run_anything(name):
    assert registry.family(name).unfit(Problem(3, 5, 7, torch.float32, None, False)) is None


@pytest.mark.parametrize("M", [1, 3, 17, SMALL_M_MAX, 70, 130, MID_M_MAX, MID_M_MAX + 1, 2503, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("capability", [AMPERE, HOPPER, (10, 0)])
@pytest.mark.parametrize("tma_aligned", [True, False])
def test_the_vendor_gemm_is_timed_last_for_every_cuda_problem(M, dtype, capability, tma_aligned):
    # Always a candidate, so a tuned layer is never slower than the library; never the default.
    names = offered(M, dtype, capability, tma_aligned, gluon=True, vendor=True, N=840, K=6376)
    assert names[-1] == VENDOR and names.count(VENDOR) == 1 and len(names) >= 2, names


def test_the_vendor_gemm_runs_anywhere_but_competes_only_on_cuda():
    # The interpreter's problems (capability None) run CPU tensors: torch computes them, run_kernel
    # reaches the family there, but there is nothing to time it against.
    assert registry.family(VENDOR).unfit(Problem(3, 5, 7, torch.float32, None, False)) is None
    assert VENDOR not in offered(1000, capability=None, vendor=True)


def test_split_k_candidates_fit_two_waves_and_give_every_split_k():
    from fusedserve.kernels.rules import SMS
    from fusedserve.kernels.triton import split_k

    shapes = ((163, 9160, 14376, torch.float16), (300, 1000, 4096, torch.float32), (70, 40, 136, torch.bfloat16))
    for M, N, K, dtype in shapes:
        configs = split_k.candidates(M, N, K, dtype)
        assert configs, (M, N, K)
        for c in configs:
            assert split_k._tiles(M, N, c) * c["SPLIT_K"] <= 2 * SMS and K >= c["SPLIT_K"] * c["BLOCK_K"], c
    assert split_k.candidates(8192, 8192, 4096, torch.bfloat16) == [], "tiles that fill the SMs need no split"
