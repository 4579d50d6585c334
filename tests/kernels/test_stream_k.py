"""The Triton stream-K family: its schedule and candidates (CPU), its sums under the interpreter
(CPU) or on a Hopper GPU against float64, its sm_90 compile (CPU, CI), and dependent launches in a
CUDA graph (Hopper GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedserve.kernels.rules import SMS, Problem
from fusedserve.kernels.triton import stream_k

from .conftest import check_against_float64, check_launch_against_float64, check_layers_in_cuda_graph, make

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IS_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9


def _steps_dealt(M, N, K, config, programs):
    """Every (tile, K step) the schedule gives out, as the kernel walks it: whole tiles first, then
    each program's run."""
    dp, per, extra, programs = stream_k.schedule(M, N, K, config, programs)
    k_tiles = -(-K // config["BLOCK_K"])
    dealt = [(tile, k) for tile in range(dp) for k in range(k_tiles)]
    for p in range(programs):
        start = p * per + min(p, extra)
        dealt += [(dp + step // k_tiles, step % k_tiles) for step in range(start, start + per + (p < extra))]
    return dealt


# ---------------------------------------------------------------- host-side rules (CPU, CI)

@pytest.mark.parametrize("M, N, K", [(2494, 328, 13936), (4383, 1168, 9936), (241, 5808, 5320), (70, 40, 136),
                                     (5, 8, 40), (8192, 8192, 1024)])
@pytest.mark.parametrize("waves", stream_k.SK_WAVES)
@pytest.mark.parametrize("programs", [3, SMS])
def test_schedule_deals_every_k_step_of_every_tile_once(M, N, K, waves, programs):
    tile = stream_k.TILES[1] if programs == SMS else stream_k.INTERPRET_CONFIG
    config = dict(tile, SK_WAVES=waves)
    tiles = -(-M // config["BLOCK_M"]) * -(-N // config["BLOCK_N"])
    dealt = _steps_dealt(M, N, K, config, programs)
    want = [(t, k) for t in range(tiles) for k in range(-(-K // config["BLOCK_K"]))]
    assert sorted(dealt) == want, "a K step missed or dealt twice"
    dp, per, extra, used = stream_k.schedule(M, N, K, config, programs)
    assert used <= programs and dp % programs == 0 and extra < used


def test_schedule_splits_only_past_the_full_waves():
    # 175 tiles of 128 x 256 on 132 SMs: 132 run whole, 43 are shared out (SK_WAVES=0); with one
    # full wave shared too, all 175 are.
    config = dict(stream_k.TILES[0], SK_WAVES=0)
    assert stream_k.schedule(4383, 1168, 9936, config, SMS)[0] == SMS
    assert stream_k.schedule(4383, 1168, 9936, dict(config, SK_WAVES=1), SMS)[0] == 0
    # 60 tiles: none whole, each shared by two or three programs.
    dp, per, extra, programs = stream_k.schedule(2494, 328, 13936, dict(stream_k.TILES[1], SK_WAVES=0), SMS)
    assert (dp, programs) == (0, SMS) and per * SMS + extra == 60 * 218


@pytest.mark.parametrize("M, N, K", [(2494, 328, 13936), (241, 5808, 5320), (4383, 1168, 9936)])
def test_an_experiment_with_candidates_the_tuner_does_not_time(M, N, K):
    assert not stream_k.FAMILY.offered(Problem(M, N, K, torch.bfloat16, (9, 0), True))
    assert stream_k.FAMILY.unfit(Problem(M, N, K, torch.float32, (9, 0), True))
    configs = stream_k.candidates(M, N, K, torch.bfloat16)
    assert configs and all(c["SK_WAVES"] in stream_k.SK_WAVES for c in configs)


# ---------------------------------------------------------------- sums (interpreter on CPU, or GPU)

# (M, N, K, SK_WAVES, programs on the interpreter): shared tiles whose first part is a run's last
# tile, a tile shared by three programs, programs with one K step or none, K past the last full step.
SUM_CASES = [(70, 40, 136, 1, 3), (70, 40, 136, 0, 3), (5, 8, 40, 0, 3), (17, 72, 200, 1, 7), (33, 104, 24, 0, 5),
             (130, 64, 264, 1, 4)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("M, N, K, waves, programs", SUM_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sums_match_float64(M, N, K, waves, programs, dtype, monkeypatch):
    monkeypatch.setattr(stream_k, "_INTERPRET_PROGRAMS", programs)
    x, w, b = make(M, N, K, dtype, device=DEVICE)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    config = dict(stream_k.INTERPRET_CONFIG if DEVICE == "cpu" else stream_k.TILES[1], SK_WAVES=waves)
    stream_k.launch(x, w, b, "relu", out, config, input_precision="ieee",
                    upcast_bf16=DEVICE == "cpu" and dtype == torch.bfloat16)
    check_against_float64(out, x, w, b, "relu", f"{config} {dtype}")


# ---------------------------------------------------------------- sm_90 compile (CPU, CI)

# One line per candidate: run in a child process, since under TRITON_INTERPRET=1 kernels are
# interpreted objects that cannot compile.
COMPILE_SM90 = """
import sys
import torch
from tools.sm90 import ptxas_usage
from tools.sm90_triton import compile_launch
from fusedserve.kernels.triton import stream_k

M, N, K = (int(v) for v in sys.argv[1:4])
for config in stream_k.candidates(M, N, K, torch.bfloat16):
    compiled, = compile_launch(stream_k, M, N, K, torch.bfloat16, config)
    ptx = compiled.asm["ptx"]
    print("wgmma", "wgmma.mma_async" in ptx, "tma", "cp.async.bulk.tensor" in ptx,
          "spills", ptxas_usage(compiled)[1], "fits", compiled.metadata.shared <= 227 * 1024)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("M, N, K", [(2494, 328, 13936), (4383, 1168, 9936)])
def test_every_candidate_compiles_to_tma_loads_and_wgmma_without_spills(M, N, K):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_SM90, str(M), str(N), str(K)], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"compile failed:\n{result.stderr[-3000:]}"
    reports = result.stdout.splitlines()
    assert len(reports) == len(stream_k.candidates(M, N, K, torch.bfloat16)) > 0
    assert all(r == "wgmma True tma True spills 0 fits True" for r in reports), reports


# ---------------------------------------------------------------- Hopper GPU

def _launch(x, w, b, activation, out, config):
    stream_k.launch(x, w, b, activation, out, config, input_precision="ieee", upcast_bf16=False)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("M, N, K", [(2494, 328, 13936), (241, 5808, 5320), (4383, 1168, 9936), (300, 1000, 1528)])
def test_every_candidate_matches_float64(M, N, K):
    for config in stream_k.candidates(M, N, K, torch.bfloat16):
        check_launch_against_float64(_launch, M, N, K, config)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
def test_same_rows_same_bits_every_run():
    # Parts are added in program order, whichever program arrives last.
    x, w, b = make(2494, 328, 13936, torch.bfloat16)
    config = stream_k.candidates(2494, 328, 13936, torch.bfloat16)[0]
    outs = [torch.empty(2494, 328, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    for out in outs:
        _launch(x, w, b, "relu", out, config)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU")
def test_dependent_launches_in_a_cuda_graph():
    def layer(i, h, w, b, activation):
        out = torch.empty(h.shape[0], w.shape[0], device="cuda", dtype=h.dtype)
        config = dict(stream_k.TILES[1], SK_WAVES=0)
        stream_k.launch(h, w, b, activation, out, config, input_precision="ieee", upcast_bf16=False, pdl=True)
        return out

    check_layers_in_cuda_graph(300, layer, lambda largest: 0.05 * max(largest, 1.0))
