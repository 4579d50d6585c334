"""The warp-specialized Gluon kernel: its configs and sm_90 compiles (CPU, CI); numerics against
float64 and dependent launches in a CUDA graph (Hopper GPU).

Gluon never runs under TRITON_INTERPRET, so on the CPU the kernel is only compiled for sm_90 and its
PTX, shared memory and registers are checked.
"""

from itertools import pairwise

import pytest
import torch

from fusedserve.kernels.gluon import ws as gluon_ws

from .conftest import (
    CHAIN_WIDTHS,
    LAUNCH_CASES,
    check_launch_against_float64,
    check_layers_in_cuda_graph,
    make,
)

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SM90_SMEM_BYTES = 227 * 1024  # per block, with the opt-in carve-out


# ---------------------------------------------------------------- configs (CPU, CI)

@pytest.mark.parametrize("M, N, K", [(65, 4096, 4096), (256, 11008, 4096), (512, 4096, 4096), (4096, 8192, 8192),
                                     (100, 136, 72)])
def test_candidates_fit_an_sm(M, N, K):
    configs = gluon_ws.candidates(M, N, K, torch.bfloat16)
    assert configs, "no config at all"
    for c in configs:
        assert c["CONSUMERS"] in (1, 2) and c["num_warps"] == 4, c
        rows = gluon_ws.consumer_rows(c)
        assert rows in (64, 128), f"{c}: a consumer warpgroup takes 64 or 128 rows"
        assert not c["PINGPONG"] or c["CONSUMERS"] == 2, c
        assert 3 <= c["STAGES"] <= 6, c
        assert gluon_ws.smem_bytes(c) <= gluon_ws.SMEM_BUDGET, c
        # Every consumer's accumulator fits its registers: at most 128 fp32 values a thread.
        assert rows * c["BLOCK_N"] // 128 <= 128, c


def test_both_schedules_of_two_consumers_are_offered():
    configs = gluon_ws.candidates(2048, 4096, 4096, torch.bfloat16)
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in configs if c["PINGPONG"]} == {(128, 128)}
    assert gluon_ws.consumer_rows(next(c for c in configs if c["PINGPONG"])) == 128  # whole tiles
    assert gluon_ws.consumer_rows(configs[0]) == 64  # cooperative 128 x 256: half the rows each
    # Storing 128 x 256 in two column halves frees the shared memory of a fourth stage.
    wide = {c["EPI_SPLIT"]: c["STAGES"] for c in configs if (c["BLOCK_M"], c["BLOCK_N"]) == (128, 256)}
    assert wide == {1: 3, 2: 4}


def test_wide_tiles_are_left_out_where_they_would_idle_half_the_sms():
    # M=512, N=4096: 64 tiles of 128 x 256 or 256 x 128 for 132 SMs; 128 x 128 makes 128.
    tiles = {(c["BLOCK_M"], c["BLOCK_N"]) for c in gluon_ws.candidates(512, 4096, 4096, torch.bfloat16)}
    assert tiles == {(128, 128)}
    tiles = {(c["BLOCK_M"], c["BLOCK_N"]) for c in gluon_ws.candidates(4096, 4096, 4096, torch.bfloat16)}
    assert tiles == {(128, 256), (256, 128), (128, 128)}


def test_a_tile_width_is_a_power_of_two_plus_a_power_of_two():
    assert [gluon_ws.n_parts(n) for n in (64, 128, 192, 256, 320)] == [(64, 0), (128, 0), (128, 64), (256, 0),
                                                                       (256, 64)]
    with pytest.raises(ValueError, match="BLOCK_N=224"):
        gluon_ws.n_parts(224)


def test_wave_efficiency_counts_idle_sms_and_columns_past_n():
    assert gluon_ws.wave_efficiency(256, 4096, 128, 128, 64) == 1.0  # 64 tiles, one full wave
    assert gluon_ws.wave_efficiency(256, 4096, 128, 128, 132) == pytest.approx(64 / 132)
    # N=11008, M=256: 43 x 2 tiles of 128 x 256 in one wave of 132 SMs; 58 x 2 of 128 x 192, the
    # last column of tiles a third full.
    assert gluon_ws.wave_efficiency(256, 11008, 128, 256, 132) == pytest.approx(86 / 132)
    assert gluon_ws.wave_efficiency(256, 11008, 128, 192, 132) == pytest.approx(2 * 11008 / 192 / 132)


@pytest.mark.parametrize("M, N, offered", [(256, 11008, {128, 64}), (128, 11008, {64}), (512, 11008, {128}),
                                           (1024, 11008, set()), (512, 4096, set()), (256, 8192, set())])
def test_192_wide_tiles_only_where_they_fill_the_waves_better(M, N, offered):
    configs = gluon_ws.candidates(M, N, 4096, torch.bfloat16)
    assert {c["BLOCK_M"] for c in configs if c["BLOCK_N"] == 192} == offered


@pytest.mark.parametrize("M, N, tiles", [(64, 11008, {(64, 96), (64, 64), (64, 128)}), (33, 8192, {(64, 96), (64, 64)}),
                                         (64, 4096, set()),
                                         (128, 11008, {(64, 96), (64, 192), (64, 64), (64, 128), (128, 128),
                                                       (256, 128)})])
def test_a_few_rows_get_only_64_row_tiles_where_they_fill_the_sms(M, N, tiles):
    # N=11008, M=64: 115 tiles of 64 x 96 (a 64- and a 32-wide accumulator) for 132 SMs, where the
    # weight-streaming kernels' 64 W rows make 172 (1.3 waves) and 128 make 86. N=4096, M=64: 64 tiles
    # of 64 x 64 leave half the SMs idle.
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in gluon_ws.candidates(M, N, 4096, torch.bfloat16)} == tiles


@pytest.mark.parametrize("M, narrow", [(128, True), (256, True), (257, False), (512, False)])
def test_narrow_tiles_only_for_a_few_hundred_rows(M, narrow):
    configs = gluon_ws.candidates(M, 8192, 4096, torch.bfloat16)
    offered = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in configs if c["BLOCK_N"] in (64, 128)
               and c["BLOCK_M"] == 64}
    assert offered == ({(64, 64, 64), (64, 64, 128), (64, 128, 64), (64, 128, 128)} if narrow else set())


@pytest.mark.parametrize("M, N, twins", [(128, 11008, True), (256, 11008, True), (4096, 4096, False)])
def test_configs_that_leave_sms_idle_are_also_offered_without_dependent_launch(M, N, twins):
    configs = gluon_ws.candidates(M, N, 4096, torch.bfloat16)
    plain = [c for c in configs if "PDL" not in c]
    without = [c for c in configs if c.get("PDL") is False]
    idle = [c for c in plain if -(-M // c["BLOCK_M"]) * -(-N // c["BLOCK_N"]) < 132]
    assert [dict(c, PDL=False) for c in idle] == without
    assert bool(without) == twins


@pytest.mark.parametrize("consumers, cap", [(1, 256), (2, 168)])
def test_register_cap_fits_every_warp_in_one_sm(consumers, cap):
    config = dict(CONSUMERS=consumers)
    assert gluon_ws.max_registers(config) == cap
    assert gluon_ws.max_registers(config) * 32 * 4 * (consumers + 1) <= 65536


def test_launch_rejects_mixed_dtypes():
    config = gluon_ws.candidates(256, 256, 128, torch.bfloat16)[0]
    x = torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="one dtype"):
        gluon_ws.launch(x, torch.zeros(256, 128, dtype=torch.float16), None, "relu",
                        torch.empty(256, 256, dtype=torch.bfloat16), config)


# ---------------------------------------------------------------- the barrier protocol (CPU, CI)

class _Barrier:
    """An mbarrier as the hardware keeps it: a phase counter that completes after ``count``
    arrivals; waiting with parity P blocks while the current phase's parity is P."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def ready(self, parity):
        return self.phase & 1 != parity

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count


def _run_protocol(tiles, k_tiles, stages, consumers, pingpong, turns, seed):
    """The kernel's loader and consumers of one program as coroutines, stepped in a random order;
    each wait yields until its barrier lets it through. Checks every slice a consumer reads is the
    one it expects and every slot the loader fills has been released by whoever reads it."""
    import random

    rng = random.Random(seed)
    ready = [_Barrier(1) for _ in range(stages)]
    empty = [_Barrier(1 if pingpong else consumers) for _ in range(stages)]
    turn = [_Barrier(1) for _ in range(2)]
    slots = [None] * stages  # the k-slice (global index) each slot holds
    consumed = []

    def loader():
        it = 0
        for _ in range(tiles):
            for _ in range(k_tiles):
                slot = it % stages
                while not empty[slot].ready(((it // stages) & 1) ^ 1):
                    yield
                assert slots[slot] is None or slots[slot] < it, "slot refilled out of order"
                slots[slot] = it
                ready[slot].arrive()  # (expect + the TMA bytes landing, taken as one event)
                it += 1

    def consumer(cid):
        stride, first = (consumers, cid) if pingpong else (1, 0)
        it, n = first * k_tiles, 0
        for _ in range(first, tiles, stride):
            if pingpong and turns:
                while not turn[cid].ready((n & 1) ^ (1 - cid)):
                    yield
            for ki in range(k_tiles):
                slot = it % stages
                while not ready[slot].ready((it // stages) & 1):
                    yield
                assert slots[slot] == it, f"consumer {cid} read slice {slots[slot]} as slice {it}"
                consumed.append((cid, it))
                if ki > 0:
                    empty[(it + stages - 1) % stages].arrive()
                it += 1
                yield
            empty[(it + stages - 1) % stages].arrive()
            if pingpong and turns:
                turn[1 - cid].arrive()
            it += (stride - 1) * k_tiles
            n += 1

    actors = [loader()] + [consumer(c) for c in range(consumers)]
    for _ in range(200_000):  # each step moves one actor on, or lets it find its wait unmet again
        if not actors:
            break
        actor = rng.choice(actors)
        try:
            next(actor)
        except StopIteration:
            actors.remove(actor)
    assert not actors, "deadlock: the actors left all wait on barriers nobody will arrive at"
    return consumed


@pytest.mark.parametrize("consumers, pingpong", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("tiles, k_tiles, stages", [(1, 1, 3), (3, 5, 4), (4, 2, 5), (5, 64, 5), (2, 7, 6)])
def test_barrier_protocol_hands_every_slice_to_its_consumer(consumers, pingpong, tiles, k_tiles, stages):
    for seed in range(20):
        consumed = _run_protocol(tiles, k_tiles, stages, consumers, pingpong, turns=True, seed=seed)
        expected = tiles * k_tiles * (1 if pingpong else consumers)
        assert len(consumed) == expected, f"seed {seed}: {len(consumed)} of {expected} slices consumed"


def test_pingpong_without_turns_would_read_stale_slices():
    # The turn barriers are what keeps the second consumer from waiting on a slot two passes ahead
    # of its ready barrier (whose parity then reads as done): without them the model catches it.
    with pytest.raises(AssertionError, match="read slice"):
        for seed in range(50):
            _run_protocol(4, 64, 5, 2, pingpong=True, turns=False, seed=seed)


# ---------------------------------------------------------------- sm_90 compiles (CPU, CI)

def _compile(M, N, K, config, pdl, activation="relu", has_bias=True, dtype=torch.bfloat16):
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import MockTensor

    from tools.sm90 import compile_sm90

    x, w, y, b = (MockTensor(dtype, s) for s in ([M, K], [N, K], [M, N], [N]))
    meta = gluon_ws.kernel_meta(config, has_bias, activation, pdl)
    args = (*gluon_ws.descriptors(x, w, y, config), b if has_bias else y, M, N, K)
    return compile_sm90(gluon_ws.gluon_ws_kernel, args, meta, source=GluonASTSource)


@pytest.mark.parametrize("M, N, K", [(256, 11008, 4096), (128, 11008, 4096), (64, 11008, 4096), (512, 4096, 4096),
                                     (4096, 4096, 4096), (100, 136, 72)])
@pytest.mark.parametrize("pdl", [False, True], ids=["", "pdl"])
def test_every_candidate_compiles_for_sm90(M, N, K, pdl):
    from tools.sm90 import ptxas_usage

    for config in gluon_ws.candidates(M, N, K, torch.bfloat16):
        if config.get("PDL") is False:
            continue  # the same kernel as its twin's without pdl
        compiled = _compile(M, N, K, config, pdl)
        ptx = compiled.asm["ptx"]
        where = f"M={M} N={N} K={K} {config} pdl={pdl}"
        assert "setmaxnreg" in ptx, f"{where}: no register reallocation between the partitions"
        # One k-slice's wgmma in flight while the next is issued: one group, or two for a split tile.
        in_flight = 2 if gluon_ws.n_parts(config["BLOCK_N"])[1] else 1
        assert f"wgmma.wait_group.sync.aligned {in_flight};" in ptx, f"{where}: wgmma not pipelined"
        assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx, f"{where}: no TMA load"
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, f"{where}: no TMA store"
        assert ("griddepcontrol.wait" in ptx) == pdl, f"{where}: griddepcontrol.wait present={not pdl}"
        assert compiled.metadata.shared <= SM90_SMEM_BYTES, f"{where}: {compiled.metadata.shared} B shared"
        registers, spill_bytes = ptxas_usage(compiled)
        assert spill_bytes == 0, f"{where}: {spill_bytes} bytes spilled ({registers} registers)"


@pytest.mark.parametrize("activation", ["none", "gelu", "silu"])
def test_other_epilogues_compile_for_sm90(activation):
    config = gluon_ws.candidates(4096, 4096, 4096, torch.float16)[0]
    ptx = _compile(4096, 4096, 4096, config, False, activation, has_bias=False, dtype=torch.float16).asm["ptx"]
    assert "wgmma.mma_async" in ptx


# ---------------------------------------------------------------- numerics (Hopper GPU)

def _cases():
    cases = []
    # Awkward sizes: tails in M, N and K, one tile, more tiles than SMs, M not a multiple of a
    # consumer's rows, and the plan's shapes; 192-wide tiles whose last column has its second part
    # wholly past N (5640) or partly (3400).
    for M, N, K in [(65, 136, 72), (130, 1000, 520), (300, 4096, 1000), (1000, 1000, 4096), (256, 11008, 4096),
                    (2048, 4096, 4096), (4100, 1032, 264), (130, 5640, 520), (300, 3400, 1000), (64, 11008, 4096),
                    (40, 8200, 264)]:
        for i, config in enumerate(gluon_ws.candidates(M, N, K, torch.bfloat16)):
            cases.append(pytest.param(M, N, K, config, id=f"{M}x{N}x{K}-{i}"))
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M, N, K, config", _cases())
def test_every_candidate_matches_float64(M, N, K, config):
    check_launch_against_float64(gluon_ws.launch, M, N, K, config,
                                 LAUNCH_CASES + ((torch.float16, True, "gelu"), (torch.bfloat16, True, "silu")))


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
@pytest.mark.parametrize("M", [100, 512, 3000])
@pytest.mark.parametrize("schedule", ["one consumer", "ping-pong", "cooperative"])
def test_dependent_launches_in_a_cuda_graph(M, schedule):
    # A loader that read X before the previous layer finished would see the NaN poison or the
    # previous replay's values.
    outs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in CHAIN_WIDTHS[1:]]

    def pick(configs):  # the 128 x 128 config of this schedule
        square = [c for c in configs if (c["BLOCK_M"], c["BLOCK_N"]) == (128, 128)]
        return next(c for c in square if {"one consumer": c["CONSUMERS"] == 1, "ping-pong": c["PINGPONG"],
                                          "cooperative": c["CONSUMERS"] == 2 and not c["PINGPONG"]}[schedule])

    configs = [pick(gluon_ws.candidates(M, n, k, torch.bfloat16)) for k, n in pairwise(CHAIN_WIDTHS)]
    # Three bf16 layers: a few bf16 roundings of the largest value.
    check_layers_in_cuda_graph(
        M, lambda i, h, w, b, act: gluon_ws.launch(h, w, b, act, outs[i], configs[i], pdl=True),
        tol=lambda largest: 8 * 2**-8 * max(largest, 1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a compute-capability 9.x GPU")
def test_forcing_it_onto_a_shape_it_has_no_tile_for_is_a_clear_error():
    from fusedserve.kernels.fused_linear import run_kernel

    assert not gluon_ws.candidates(16, 4096, 4096, torch.bfloat16)  # a few rows: weight streaming's ground
    with pytest.raises(ValueError, match="name 'gluon_ws' has no config for M=16"):
        run_kernel("gluon_ws", *make(16, 4096, 4096, torch.bfloat16))
