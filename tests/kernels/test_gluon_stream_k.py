"""The Gluon stream-K weight-streaming kernel: its candidates and sm_90 compile checks (CPU, CI);
numerics, determinism and dependent launches in a CUDA graph (Hopper GPU)."""

from itertools import pairwise

import pytest
import torch

from fusedserve.kernels.gluon import stream_k

from .conftest import (
    CHAIN_WIDTHS,
    check_against_float64,
    check_launch_against_float64,
    check_layers_in_cuda_graph,
    make,
)

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SM90_SMEM_BYTES = 227 * 1024


def _runs(N, K, config, sms):
    """Each program's run of K steps, as the kernel deals them out: [first, last + 1)."""
    steps = -(-N // config["BLOCK_N"]) * -(-K // config["BLOCK_K"])
    programs = stream_k.programs(N, K, config, sms)
    return [(p * steps // programs, (p + 1) * steps // programs) for p in range(programs)]


# ---------------------------------------------------------------- host-side rules (CPU, CI)

@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (33, 3752, 10224), (74, 6832, 1568), (128, 4944, 3632),
                                     (8, 1000, 136)])
def test_candidates_fit_one_or_two_programs_per_sm(M, N, K):
    configs = stream_k.candidates(M, N, K, torch.bfloat16)
    assert configs and {c["PER_SM"] for c in configs} <= {1, 2}
    for c in configs:
        ring = c["STAGES"] * (c["BLOCK_N"] + c["BLOCK_M"]) * c["BLOCK_K"] * 2
        assert 3 <= c["STAGES"] and ring * c["PER_SM"] <= stream_k._SMEM_BUDGET, c
        assert c["BLOCK_M"] >= M, f"{c}: one X tile must hold every row"


@pytest.mark.parametrize("N, K", [(3752, 10224), (136, 1000), (9464, 712), (64, 128)])
def test_every_k_step_is_dealt_once_and_evenly(N, K):
    config = dict(BLOCK_N=64, BLOCK_M=64, BLOCK_K=128, PER_SM=2, STAGES=3, num_warps=4)
    runs = _runs(N, K, config, sms=132)
    assert runs[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(runs))
    assert runs[-1][1] == -(-N // 64) * -(-K // 128)
    lengths = [b - a for a, b in runs]
    assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1, lengths


def test_launch_rejects_what_it_cannot_run():
    config = stream_k.candidates(16, 1024, 1024, torch.bfloat16)[0]
    x, w = torch.zeros(200, 1024, dtype=torch.bfloat16), torch.zeros(1024, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes 1 to 16 rows"):
        stream_k.launch(x, w, None, "relu", torch.empty(200, 1024, dtype=torch.bfloat16), config)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        stream_k.launch(x[:16].float(), w.float(), None, "relu", torch.empty(16, 1024), config)


# ---------------------------------------------------------------- sm_90 compile checks (CPU, CI)

@pytest.mark.parametrize("M, N, K, pdl", [(33, 3752, 10224, True), (128, 4944, 3632, False), (8, 1000, 136, True)])
def test_every_candidate_compiles_for_sm90(M, N, K, pdl):
    from tools.sm90 import ptxas_usage
    from tools.sm90_gluon import compile_stream_k

    for config in stream_k.candidates(M, N, K, torch.bfloat16):
        compiled = compile_stream_k(M, N, K, torch.bfloat16, config, "relu", True, pdl=pdl)
        ptx, where = compiled.asm["ptx"], f"M={M} N={N} K={K} {config} pdl={pdl}"
        assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx, where
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, f"{where}: no TMA load"
        assert "atom.global" in ptx, f"{where}: no tile counter"
        assert ("griddepcontrol.wait" in ptx) == pdl, where
        assert compiled.metadata.shared <= SM90_SMEM_BYTES, f"{where}: {compiled.metadata.shared} B shared"
        registers, spill_bytes = ptxas_usage(compiled)
        assert spill_bytes == 0, f"{where}: {spill_bytes} bytes spilled ({registers} registers)"


# ---------------------------------------------------------------- numerics (Hopper GPU)

def _cases():
    cases = []
    for M, N, K in [(1, 4096, 4096), (3, 1000, 136), (9, 136, 1000), (17, 1000, 520), (33, 3752, 10224),
                    (64, 1024, 1024), (100, 1000, 1000), (128, 4944, 3632), (20, 9464, 712), (40, 64, 8192)]:
        for i, config in enumerate(stream_k.candidates(M, N, K, torch.bfloat16)):
            cases.append(pytest.param(M, N, K, config, id=f"{M}x{N}x{K}-{i}"))
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M, N, K, config", _cases())
def test_every_candidate_matches_float64(M, N, K, config):
    check_launch_against_float64(stream_k.launch, M, N, K, config)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("N, K", [(4096, 4096), (136, 1000)])  # the second: many programs share each tile
def test_shared_tiles_sum_in_a_fixed_order(N, K):
    x, w, b = make(40, N, K, torch.bfloat16)
    config = stream_k.candidates(40, N, K, torch.bfloat16)[-1]
    outs = []
    for _ in range(4):
        out = torch.full((40, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs.append(stream_k.launch(x, w, b, "relu", out, config))
    check_against_float64(outs[0], x, w, b, "relu", f"{config}")
    for i, out in enumerate(outs[1:], 1):
        assert torch.equal(out, outs[0]), f"run {i} differs from run 0 (partial sums added out of order)"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M", [1, 40, 128])
def test_dependent_launches_in_a_cuda_graph(M):
    # Each layer may start before the previous ends; one that read X (or a tile counter) before
    # waiting would see the poison or the previous replay's values.
    outs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in CHAIN_WIDTHS[1:]]
    configs = [stream_k.candidates(M, n, k, torch.bfloat16)[-1] for k, n in pairwise(CHAIN_WIDTHS)]
    check_layers_in_cuda_graph(
        M, lambda i, h, w, b, act: stream_k.launch(h, w, b, act, outs[i], configs[i], pdl=True),
        tol=lambda largest: 0.05 * largest)
