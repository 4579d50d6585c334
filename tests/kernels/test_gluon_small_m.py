"""The Gluon swap-AB weight-streaming kernel: sm_90 compile checks and host-side rules (CPU, CI),
numerics, determinism and dependent launches in a CUDA graph (Hopper GPU).

Gluon never runs under TRITON_INTERPRET, so on the CPU the kernel is compiled for sm_90 and its PTX,
shared memory and registers are checked; the numbers are checked only on a Hopper GPU.
"""

from itertools import pairwise

import pytest
import torch

from fusedserve.kernels.gluon import small_m as gluon_small_m

from .conftest import (
    CHAIN_WIDTHS,
    check_against_float64,
    check_launch_against_float64,
    check_layers_in_cuda_graph,
    make,
)

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# Shared memory per block on sm_90 with the opt-in carve-out.
SM90_SMEM_BYTES = 227 * 1024


# ---------------------------------------------------------------- host-side rules (CPU, CI)

@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (5, 1000, 136), (16, 11008, 4096), (64, 1024, 1024),
                                     (17, 8192, 8192), (200, 4096, 4096)])
def test_candidates_fit_and_split_sensibly(M, N, K):
    configs = gluon_small_m.candidates(M, N, K, torch.bfloat16)
    assert configs, f"M={M} N={N} K={K}: no candidates"
    for c in configs:
        assert 8 <= c["BLOCK_M"] <= 128, f"{c}: wgmma's n side must be 8 to 128 rows here"
        programs = -(-N // c["BLOCK_N"]) * -(-M // c["BLOCK_M"]) * c["SPLIT_K"]
        assert c["BLOCK_M"] == gluon_small_m.block_m(M) or programs <= gluon_small_m._MAX_PROGRAMS, \
            f"{c}: split M into {programs} programs"
        ring = c["STAGES"] * (c["BLOCK_N"] + c["BLOCK_M"]) * c["BLOCK_K"] * 2
        assert ring <= gluon_small_m._SMEM_BUDGET, f"{c}: a {ring}-byte ring overflows shared memory"
        assert c["STAGES"] >= 3, f"{c}: too shallow a ring to keep loads in flight"
        k_tiles = -(-K // c["BLOCK_K"])
        # Every split gets at least two K tiles (one would leave nothing to overlap).
        assert c["SPLIT_K"] == 1 or k_tiles >= 2 * c["SPLIT_K"], f"{c}: {k_tiles} K tiles"


def test_wider_w_tiles_come_with_the_tallest_x_tile_from_their_rows(monkeypatch):
    monkeypatch.setattr(gluon_small_m, "_WIDE_TILES", ((128, 8, 17), ))
    monkeypatch.setattr(gluon_small_m, "_SPLITS", (1, 2, 4))
    wide = [c for c in gluon_small_m.candidates(40, 4856, 3976, torch.bfloat16) if c["BLOCK_N"] == 128]
    assert wide and all((c["BLOCK_M"], c["num_warps"]) == (64, 8) for c in wide), wide
    assert {c["SPLIT_K"] for c in wide} == {1, 2, 4}, wide
    for c in wide:  # the ring sized for the wider tile
        assert 3 <= c["STAGES"] and c["STAGES"] * (128 + 64) * c["BLOCK_K"] * 2 <= gluon_small_m._SMEM_BUDGET, c
    assert all(c["BLOCK_N"] == 64 for c in gluon_small_m.candidates(16, 4856, 3976, torch.bfloat16))


@pytest.mark.parametrize("M, expected", [(1, 8), (7, 8), (8, 8), (9, 16), (16, 16), (17, 32), (64, 64), (100, 128),
                                         (200, 128)])
def test_x_tile_rows(M, expected):
    assert gluon_small_m.block_m(M) == expected


def test_narrow_layers_and_large_batches_split_m():
    # N = 1024 at M = 64: 16 W tiles, so shorter X tiles give 32 to 128 programs.
    heights = {c["BLOCK_M"] for c in gluon_small_m.candidates(64, 1024, 1024, torch.bfloat16)}
    assert heights == {64, 32, 16, 8}, heights
    # M = 256 at N = 4096: 128-row tiles (128 programs) and 64-row ones (256), never one 256-row tile.
    heights = {c["BLOCK_M"] for c in gluon_small_m.candidates(256, 4096, 4096, torch.bfloat16)}
    assert heights == {128, 64}, heights
    # One row: nothing to split.
    assert {c["BLOCK_M"] for c in gluon_small_m.candidates(1, 4096, 4096, torch.bfloat16)} == {8}


@pytest.mark.parametrize("M", [1, 16, 64])
def test_grids_past_one_wave_get_both_ring_depths(M):
    # N = 11008: 172 W tiles of 64 rows for 132 SMs. Each tile and split is offered with a ring that
    # lets two programs share an SM and with the deepest one that a program alone can have.
    def ring(c):
        return (64 + c["BLOCK_M"]) * c["BLOCK_K"] * 2 * c["STAGES"]

    configs = gluon_small_m.candidates(M, 11008, 4096, torch.bfloat16)
    for block_k in (128, 256):
        rings = sorted(ring(c) for c in configs
                       if c["BLOCK_K"] == block_k and c["SPLIT_K"] == 1 and c["BLOCK_M"] == gluon_small_m.block_m(M))
        if block_k == 128:  # (256 deep: a shared ring would be under three stages)
            assert rings[0] <= gluon_small_m._SMEM_BUDGET // 2, (block_k, rings)
        assert rings[-1] > gluon_small_m._SMEM_BUDGET // 2, (block_k, rings)
    # One wave (N = 4096, the whole batch in one X tile, unsplit: 64 programs) gets only the deep ring.
    assert all(ring(c) > gluon_small_m._SMEM_BUDGET // 2
               for c in gluon_small_m.candidates(M, 4096, 4096, torch.bfloat16)
               if c["SPLIT_K"] == 1 and c["BLOCK_K"] == 128 and c["STAGES"] != 4
               and c["BLOCK_M"] == gluon_small_m.block_m(M))


def test_launch_rejects_what_it_cannot_run():
    w = torch.zeros(256, 128, dtype=torch.bfloat16)
    config = gluon_small_m.candidates(1, 256, 128, torch.bfloat16)[0]
    too_many = gluon_small_m.MAX_M + 1
    out = torch.empty(too_many, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        gluon_small_m.launch(torch.zeros(too_many, 128, dtype=torch.bfloat16), w, None, "relu", out, config)
    with pytest.raises(TypeError, match="bf16"):
        gluon_small_m.launch(torch.zeros(3, 128), w.float(), None, "relu", out[:3].float(), config)


# ---------------------------------------------------------------- sm_90 compile checks (CPU, CI)

@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (16, 4096, 4096), (64, 1000, 136), (128, 4096, 4096),
                                     (256, 4096, 4096), (16, 11008, 4096), (64, 11008, 4096)])
@pytest.mark.parametrize("pdl", [False, True], ids=["", "pdl"])
def test_every_candidate_compiles_for_sm90(M, N, K, pdl):
    from tools.sm90 import ptxas_usage
    from tools.sm90_gluon import compile_small_m as compile_small_m_sm90

    for config in gluon_small_m.candidates(M, N, K, torch.bfloat16):
        compiled = compile_small_m_sm90(M, N, K, torch.bfloat16, config, "relu", True, pdl=pdl)
        ptx = compiled.asm["ptx"]
        where = f"M={M} N={N} K={K} {config} pdl={pdl}"
        assert "wgmma.mma_async" in ptx, f"{where}: no async wgmma in the PTX"
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, f"{where}: no TMA load"
        assert "wgmma.wait_group.sync.aligned 1;" in ptx, f"{where}: wgmma is not pipelined"
        assert ("griddepcontrol.wait" in ptx) == pdl, f"{where}: griddepcontrol.wait present={not pdl}"
        assert (config["SPLIT_K"] > 1) == ("atom.global" in ptx), f"{where}: split-K counter mismatch"
        assert compiled.metadata.shared <= SM90_SMEM_BYTES, f"{where}: {compiled.metadata.shared} B shared"
        registers, spill_bytes = ptxas_usage(compiled)
        assert spill_bytes == 0, f"{where}: {spill_bytes} bytes spilled ({registers} registers)"


@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (16, 1000, 136)])
def test_weight_prefetch_is_issued_before_the_wait(M, N, K):
    # With prefetch_weight the first W tile's TMA copy goes out before griddepcontrol.wait; the
    # X copies, which read what the previous kernel wrote, only after it.
    from tools.sm90_gluon import compile_small_m as compile_small_m_sm90

    for config in gluon_small_m.candidates(M, N, K, torch.bfloat16):
        where = f"M={M} N={N} K={K} {config}"
        ptx = compile_small_m_sm90(M, N, K, torch.bfloat16, config, "relu", True, pdl=True,
                                   prefetch_weight=True).asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        copies = [i for i in range(len(ptx)) if ptx.startswith("cp.async.bulk.tensor", i)]
        assert sum(i < wait for i in copies) == 1, f"{where}: not exactly one TMA copy before the wait"
        plain = compile_small_m_sm90(M, N, K, torch.bfloat16, config, "relu", True, pdl=True).asm["ptx"]
        assert plain.index("cp.async.bulk.tensor") > plain.index("griddepcontrol.wait"), where


# ---------------------------------------------------------------- numerics (Hopper GPU)

def _cases():
    cases = []
    for M, N, K in [(1, 4096, 4096), (3, 1000, 136), (9, 136, 1000), (16, 11008, 4096), (17, 1000, 520),
                    (64, 1024, 1024), (100, 1000, 1000), (128, 4096, 4096), (200, 1000, 520),
                    (256, 4096, 4096)]:
        for i, config in enumerate(gluon_small_m.candidates(M, N, K, torch.bfloat16)):
            cases.append(pytest.param(M, N, K, config, id=f"{M}x{N}x{K}-{i}"))
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M, N, K, config", _cases())
def test_every_candidate_matches_float64(M, N, K, config):
    check_launch_against_float64(gluon_small_m.launch, M, N, K, config)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M, block_m", [(5, 8), (100, 32)])  # the second splits M too: a counter per tile
def test_split_k_is_deterministic(M, block_m):
    x, w, b = make(M, 4096, 4096, torch.bfloat16)
    config = dict(BLOCK_N=64, BLOCK_M=block_m, BLOCK_K=128, SPLIT_K=4, STAGES=8, num_warps=4)
    outs = []
    for _ in range(4):
        out = torch.full((M, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs.append(gluon_small_m.launch(x, w, b, "relu", out, config))
    check_against_float64(outs[0], x, w, b, "relu", f"{config} M={M}")
    for i, out in enumerate(outs[1:], 1):
        assert torch.equal(out, outs[0]), f"run {i} differs from run 0 (split-K order not fixed)"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M", [1, 6, 40, 128, 250])
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_dependent_launches_in_a_cuda_graph(M, prefetch):
    # Each layer lets the next start launching before it ends: a layer that read X before waiting
    # for the previous one would see stale values. The first (eager) run also makes the split-K
    # counters.
    outs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in CHAIN_WIDTHS[1:]]
    configs = [gluon_small_m.candidates(M, n, k, torch.bfloat16)[-1] for k, n in pairwise(CHAIN_WIDTHS)]
    check_layers_in_cuda_graph(
        M, lambda i, h, w, b, act: gluon_small_m.launch(h, w, b, act, outs[i], configs[i], pdl=True,
                                                        prefetch_weight=prefetch),
        tol=lambda largest: 0.05 * largest)
