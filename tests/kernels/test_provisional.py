"""Provisional choices: the shipped table, its nearest-shape lookup, the rules' fallback, and
``choosing.choose`` taking them without timing where it must not time."""

from dataclasses import replace

import pytest
import torch

from fusedserve.kernels import choosing, provisional, registry, tune_cache
from fusedserve.kernels.provisional import Entry, closest_config, provisional_choice
from fusedserve.kernels.rules import Problem, tuning_rows

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"


def hopper(M, N=4096, K=4096, dtype=torch.bfloat16):
    return Problem(M, N, K, dtype, (9, 0), True)


def test_the_shipped_h200_table_names_current_candidates():
    entries = provisional.table(H200, "3.6.0")
    assert len(entries) > 100, "the table is built from every H200 kernel run (tools/provisional_table.py)"
    exact = 0
    for e in entries:
        problem = Problem(e.M, e.N, e.K, getattr(torch, e.dtype), (9, 0), True)
        family = registry.family(e.kernel)
        exact += e.config in family.candidates(replace(problem, M=tuning_rows(e.M)))
    # A table whose configs are no longer candidates was measured on older kernels: rebuild it.
    assert exact >= 0.95 * len(entries), f"only {exact}/{len(entries)} table configs are current candidates"


def test_a_grid_shape_takes_the_measured_winner():
    entry = next(e for e in provisional.table(H200, "3.6.0")
                 if (e.M, e.N, e.K, e.dtype, e.static_weight) == (16, 4096, 4096, "bfloat16", True))
    problem = hopper(16)
    kernel, config, source = provisional_choice(problem, registry.offered(problem), provisional.table(H200, "3.6.0"),
                                                static_weight=True)
    assert (kernel, config, source) == (entry.kernel, entry.config, "table")


def test_an_unmeasured_shape_takes_the_nearest_measured_family():
    # (16-bit past 64 rows the library comes first: tests/kernels/test_vendor_cublas.py)
    entries = (Entry("bfloat16", 1, 4096, 4096, True, "triton_small_m", {"no": "such config"}),
               Entry("bfloat16", 64, 4096, 4096, True, "gluon_small_m", {}))
    for M, want in ((2, "triton_small_m"), (48, "gluon_small_m")):
        problem = hopper(M, N=3072, K=3072)
        families = registry.offered(problem)
        kernel, config, source = provisional_choice(problem, families, entries, static_weight=True)
        assert (kernel, source) == (want, "table"), f"M={M}"
        assert config in registry.family(kernel).candidates(replace(problem, M=tuning_rows(M))), \
            "a config that is no candidate is only a hint: one of the family's own runs"


def test_a_shape_measured_at_few_rows_names_no_family_past_them():
    # fp32 at 94 rows ran the 64-row shape's weight-streaming winner 21.6x slower than tuned.
    fp32 = lambda M: Problem(M, 1256, 496, torch.float32, (9, 0), False)  # noqa: E731
    entries = (Entry("float32", 64, 976, 640, True, "triton_small_m", {}),
               Entry("float32", 512, 4096, 4096, True, "triton_tiled", {}))
    for M, want in ((48, "triton_small_m"), (94, "triton_tiled"), (65, "triton_tiled")):
        kernel, _, source = provisional_choice(fp32(M), registry.offered(fp32(M)), entries, static_weight=True)
        assert (kernel, source) == (want, "table"), f"M={M}"
    assert [kernel for kernel, _ in provisional.near_candidates(fp32(94), registry.offered(fp32(94)), entries,
                                                                 static_weight=True)] == ["triton_tiled"]


@pytest.mark.parametrize("gpu", [H200, "NVIDIA H100 80GB HBM3"])
@pytest.mark.parametrize("N, K", [(840, 11328), (320, 4104), (4096, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_sixteen_bit_row_starts_on_the_gemv(gpu, N, K, dtype):
    # Rule: with static weights the GEMV won every tuned one-row 16-bit shape (H100 and H200), while
    # the nearest table shape sometimes named the Gluon kernel, up to 1.55x slower there.
    problem = hopper(1, N, K, dtype)
    kernel, config, source = provisional_choice(problem, registry.offered(problem), provisional.table(gpu),
                                                static_weight=True)
    assert (kernel, source, config.get("GEMV")) == ("triton_small_m", "rules", True)
    # 1024 deep; 8 wide where that gives each of 132 SMs a program, else 4 (tuned H100 GEMVs).
    assert (config["BLOCK_K"], config["BLOCK_N"]) == (1024, 8 if N >= 8 * 132 else 4), config


@pytest.mark.parametrize("gpu", [H200, "NVIDIA H100 80GB HBM3"])
@pytest.mark.parametrize("N, K", [(8192, 256), (12912, 368), (11152, 1016)])
def test_one_short_and_wide_row_starts_on_the_gluon_kernel_with_short_k_tiles(gpu, N, K):
    # Rule: on the H100 the Gluon kernel with 128-wide K tiles beat the GEMV 1.25-1.75x on one row of
    # K < 1024 over >= 66 W tiles (kernels.jsonl:36-37); elsewhere the GEMV keeps its claim.
    problem = hopper(1, N, K, torch.float16)
    kernel, config, source = provisional_choice(problem, registry.offered(problem), provisional.table(gpu),
                                                static_weight=True)
    assert (kernel, source, config["BLOCK_K"], config["SPLIT_K"]) == ("gluon_small_m", "rules", 128, 1)
    assert config in registry.family(kernel).candidates(problem)
    off_hopper = Problem(1, N, K, torch.float16, (8, 0), True)
    kernel, config, _ = provisional_choice(off_hopper, registry.offered(off_hopper), provisional.table(gpu))
    assert (kernel, config.get("GEMV")) == ("triton_small_m", True), "no Gluon off Hopper: the GEMV's"


@pytest.mark.parametrize("N, K, split", [(1208, 13536, 2), (496, 5016, 2), (1208, 2048, 1), (2408, 10384, 1)])
def test_the_gluon_kernel_starts_split_where_few_programs_stream_a_long_k(N, K, split):
    # Rule: 63 of the 64 tuned H100 Gluon shapes split K in two exactly where fewer than 32 programs
    # stream a K of 3072 or more (M=3 N=1208 K=13536: unsplit ran 1.19x slower, kernels.jsonl:37).
    problem = hopper(4, N, K)
    family = registry.family("gluon_small_m")
    measured = {"BLOCK_N": 64, "BLOCK_M": 8, "BLOCK_K": 256, "SPLIT_K": 1, "STAGES": 5, "num_warps": 4}
    config = provisional.start_config(family, problem, family.candidates(problem), measured)
    assert (config["SPLIT_K"], config["BLOCK_K"]) == (split, 256), "the measured K tile kept"
    assert config in family.candidates(problem)


@pytest.mark.parametrize("M", [2, 4, 5, 8])
@pytest.mark.parametrize("N, K", [(8160, 5336), (1472, 10808), (3256, 2864), (2272, 1056)])
def test_the_gluon_kernel_starts_256_deep_in_a_5_stage_ring_at_a_few_rows_of_long_k(M, N, K):
    # Rule: at 2-8 rows with K >= 1024, 5 of 6 H100 shapes started 128 deep and 4 stages (their
    # nearest measured config) tuned to 256 deep and 5 stages; the start ran 1.07-1.14x slower.
    problem = hopper(tuning_rows(M), N, K)
    family = registry.family("gluon_small_m")
    measured = {"BLOCK_N": 64, "BLOCK_M": 8, "BLOCK_K": 128, "SPLIT_K": 1, "STAGES": 4, "num_warps": 4}
    config = provisional.start_config(family, problem, family.candidates(problem), measured)
    assert (config["BLOCK_K"], config["STAGES"]) == (256, 5), config
    assert config in family.candidates(problem)


@pytest.mark.parametrize("M, N, K", [(1, 2272, 1056), (16, 2272, 1056), (4, 1472, 1016), (4, 12688, 304)])
def test_one_row_sixteen_or_short_k_keep_the_measured_depth(M, N, K):
    problem = hopper(M, N, K)
    family = registry.family("gluon_small_m")
    measured = {"BLOCK_N": 64, "BLOCK_M": 8, "BLOCK_K": 128, "SPLIT_K": 1, "STAGES": 4, "num_warps": 4}
    config = provisional.start_config(family, problem, family.candidates(problem), measured)
    assert (config["BLOCK_K"], config["STAGES"]) != (256, 5), config


def test_a_family_without_its_own_rule_starts_on_the_closest_or_first_candidate():
    family = registry.family("triton_tiled")
    assert family.provisional_config is None
    problem = hopper(300, 1024, 1024)
    candidates = family.candidates(problem)
    assert provisional.start_config(family, problem, candidates, {}) == candidates[0]
    assert provisional.start_config(family, problem, candidates, candidates[2]) == candidates[2]


def test_a_claiming_family_takes_its_nearest_measured_config():
    problem = hopper(1, 4096, 4096)
    candidates = registry.family("triton_small_m").candidates(problem)
    # The GEMV's tiles its rule keeps for one 16-bit row of N=4096: 8 wide, 1024 deep.
    ruled = [c for c in candidates if c.get("GEMV") and (c["BLOCK_N"], c["BLOCK_K"]) == (8, 1024)]
    measured = ruled[-1]
    assert len(ruled) > 1 and measured != ruled[0]
    entries = (Entry("bfloat16", 1, 4096, 4096, True, "gluon_small_m", {}),
               Entry("bfloat16", 1, 1024, 1024, True, "triton_small_m", measured))
    kernel, config, source = provisional_choice(problem, registry.offered(problem), entries, static_weight=True)
    assert (kernel, config, source) == ("triton_small_m", measured, "rules")
    kernel, config, _ = provisional_choice(problem, registry.offered(problem), entries[:1], static_weight=True)
    assert (kernel, config) == ("triton_small_m", ruled[0]), "no entry of its own: the rule's first tile"


def test_no_table_falls_back_to_the_rules():
    assert provisional.table("Some Future GPU") == ()
    problem = Problem(40, 1000, 24, torch.float16, (8, 0), True)
    families = registry.offered(problem)
    kernel, config, source = provisional_choice(problem, families, ())
    assert source == "rules"
    assert (kernel, config) == (families[0].name, families[0].candidates(replace(problem, M=tuning_rows(40)))[0])


def test_closest_config_prefers_the_exact_one_then_the_most_shared_values():
    candidates = [{"A": 1, "B": 2, "C": 3}, {"A": 1, "B": 5, "C": 6}, {"A": 9, "B": 5, "C": 6}]
    assert closest_config(candidates, {"A": 9, "B": 5, "C": 6}) == candidates[2]
    assert closest_config(candidates, {"A": 1, "B": 5, "C": 0}) == candidates[1]


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """``choose`` as on an H200 with an empty tune cache, on CPU tensors, with the tuner replaced."""
    monkeypatch.setattr(choosing, "interpreting", lambda: False)
    monkeypatch.setattr(choosing, "cuda_name", lambda device: H200)
    cache = tune_cache.TuneCache(H200, directory=tmp_path)
    monkeypatch.setattr(choosing, "device_cache", lambda name: cache)
    monkeypatch.setattr(choosing, "_provisional", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    tuned = []

    def fake_tune(pairs, x2d, *args, **kwargs):
        tuned.append(x2d.shape[0])
        return pairs[-1][0], {"timed": True}

    monkeypatch.setattr(choosing, "_tune", fake_tune)
    return tuned


def test_choose_takes_the_provisional_choice_without_timing_until_told_to_tune(fake_gpu):
    problem = hopper(48)
    x, w = torch.empty(48, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
    with provisional.choosing_mode("provisional"):
        first = choosing.choose(problem, x, w, None, "relu", static_weight=True)
    assert not first.tuned and first.source == "table" and fake_gpu == []
    # A serving thread (no mode) keeps the provisional choice: it never times.
    assert choosing.choose(problem, x, w, None, "relu", static_weight=True) is first
    assert choosing.current(problem, "cuda", static_weight=True) is first and fake_gpu == []
    with provisional.choosing_mode("tune"):
        tuned = choosing.choose(problem, x, w, None, "relu", static_weight=True)
    assert tuned.tuned and tuned.config == {"timed": True} and fake_gpu == [48]
    assert choosing.choose(problem, x, w, None, "relu", static_weight=True).config == {"timed": True}, \
        "the tuned choice is kept in the tune cache"


def test_choose_still_times_a_key_never_chosen_provisionally_on_a_short_list(fake_gpu):
    problem = hopper(300)
    x, w = torch.empty(300, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
    choice = choosing.choose(problem, x, w, None, "relu")
    assert choice.tuned and choice.source == "quick" and fake_gpu == [300]


def test_choosing_mode_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode must be"):
        with provisional.choosing_mode("fast"):
            pass


def test_near_candidates_take_the_nearest_winners_once_each_among_offered_families():
    problem = hopper(200, N=3000, K=3000)
    timed = replace(problem, M=tuning_rows(200))
    tma = registry.family("triton_tma_persistent").candidates(timed)
    entries = (Entry("bfloat16", 256, 3072, 3072, True, "triton_tma_persistent", tma[1]),
               Entry("bfloat16", 256, 2048, 3072, True, "triton_tma_persistent", tma[1]),
               Entry("bfloat16", 128, 3072, 3072, True, "torch_cublas", {"op": "addmm_act"}),
               Entry("bfloat16", 256, 4096, 4096, True, "no_such_family", {}),
               Entry("float16", 256, 3072, 3072, True, "triton_tma_persistent", tma[2]),
               Entry("bfloat16", 4096, 8192, 8192, True, "triton_tma_persistent", tma[3]))
    pairs = provisional.near_candidates(problem, registry.offered(problem), entries, True, count=3)
    assert pairs[0] == ("triton_tma_persistent", tma[1]), "nearest first, a repeat kept once"
    assert [kernel for kernel, _ in pairs] == ["triton_tma_persistent", "torch_cublas"], \
        "other dtypes, unknown families and entries past the count are left out"
    assert provisional.near_candidates(hopper(200, dtype=torch.float32), registry.offered(problem), entries) == []


def test_a_near_search_times_a_few_candidates_and_a_full_one_redoes_it(fake_gpu, monkeypatch):
    timed_pairs = []
    monkeypatch.setattr(choosing, "_tune", lambda pairs, *args, **kwargs: timed_pairs.append(pairs) or pairs[-1])
    problem = hopper(300)
    x, w = torch.empty(300, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
    every = choosing.every_candidate(registry.offered(problem), problem)
    monkeypatch.delenv(choosing.SEARCH_ENV, raising=False)
    with provisional.choosing_mode("tune"):
        near = choosing.choose(problem, x, w, None, "relu", static_weight=True)
        assert near.source == "near" and len(timed_pairs[0]) < len(every) / 2
        assert choosing.choose(problem, x, w, None, "relu", static_weight=True) == near, "settled: not timed again"
    provisional_pick = choosing.provisional_choice(problem, "cuda", True)
    assert timed_pairs[0][0] == (provisional_pick.kernel, provisional_pick.config), "never slower than provisional"
    assert {kernel for kernel, _ in timed_pairs[0]} >= {"torch_cublas"}, "the vendor always competes"
    assert choosing.cached(problem, "cuda", static_weight=True) == near
    monkeypatch.setenv(choosing.SEARCH_ENV, "full")
    assert choosing.cached(problem, "cuda", static_weight=True) is None, "a full search still has to run"
    with provisional.choosing_mode("tune"):
        full = choosing.choose(problem, x, w, None, "relu", static_weight=True)
    assert full.source == "tuned" and timed_pairs[1] == every
    monkeypatch.setenv(choosing.SEARCH_ENV, "near")
    assert choosing.cached(problem, "cuda", static_weight=True) == full, "a full search settles a near one too"


def test_a_search_of_an_unknown_breadth_is_refused(monkeypatch):
    monkeypatch.setenv(choosing.SEARCH_ENV, "wide")
    with pytest.raises(ValueError, match="FUSEDSERVE_TUNING_SEARCH must be one of near, full"):
        choosing.search()


@pytest.mark.parametrize("M, whole_family", [(3, True), (8, True), (9, False), (40, False)])
def test_a_near_search_at_a_few_rows_times_every_config_of_the_provisional_family(M, whole_family):
    problem = hopper(M, N=3000, K=3000)
    families, entries = registry.offered(problem), provisional.table(H200, "3.6.0")
    pairs, mark = choosing.search_list(problem, families, entries, True)
    kernel, _, _ = provisional_choice(problem, families, entries, True)
    family = choosing.every_candidate([f for f in families if f.name == kernel], problem)
    assert mark == "near" and len(pairs) < len(choosing.every_candidate(families, problem))
    assert all(pair in pairs for pair in family) == whole_family, (kernel, len(family))


def _split_k_search(problem, entries):
    """Every split-K candidate for ``problem``, and what a near search over ``entries`` times."""
    families = registry.offered(problem)
    split = [pair for pair in choosing.every_candidate(families, problem) if pair[0] == "triton_split_k"]
    assert split, "split-K is offered here"
    pairs, mark = choosing.search_list(problem, families, entries)
    assert mark == choosing.NEAR
    return split, pairs


def test_a_near_search_times_every_split_k_candidate_off_hoppers_16_bit_rows():
    # fp32 few tiles over a long K: split-K wins there, whatever the nearest shapes ran.
    split, pairs = _split_k_search(hopper(683, N=1024, K=4520, dtype=torch.float32), provisional.table(H100, "3.6.0"))
    assert all(pair in pairs for pair in split)
    wide = hopper(4096, dtype=torch.float32)
    assert not any(k == "triton_split_k" for k, _ in choosing.search_list(wide, registry.offered(wide),
                                                                           provisional.table(H100, "3.6.0"))[0])


def test_on_hoppers_16_bit_rows_a_near_search_times_split_k_only_where_it_won_nearby():
    problem, entries = hopper(683, N=1024, K=4520), provisional.table(H100, "3.6.0")
    split, pairs = _split_k_search(problem, entries)
    assert not any(pair in pairs for pair in split)
    won = Entry("bfloat16", 683, 1024, 4520, False, "triton_split_k", split[1][1])
    _, pairs = _split_k_search(problem, (won, *entries))
    assert split[1] in pairs and split[0] not in pairs
