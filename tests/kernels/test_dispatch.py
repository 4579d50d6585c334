"""The kernel dispatch rules and the on-disk tune cache, without a GPU."""

import json

import pytest
import torch

from fusedserve.kernels import autotune_cache
from fusedserve.kernels.dispatch import (GLUON, GLUON_SMALL_M, GLUON_SMALL_M_MAX, GLUON_WS, GLUON_WS_MIN_M, MID_M_MAX, SMALL_M,
                              SMALL_M_MAX, TILED, TMA_PERSISTENT, candidate_kernels)

HOPPER = (9, 0)
AMPERE = (8, 0)


def kernels_for(M, dtype=torch.bfloat16, capability=HOPPER, tma_aligned=True, gluon_ok=False, N=4096, K=4096):
    return candidate_kernels(M, N, K, dtype, capability=capability, tma_aligned=tma_aligned, gluon_ok=gluon_ok)


@pytest.mark.parametrize("M", [1, 3, 16, 17, SMALL_M_MAX])
@pytest.mark.parametrize("capability", [None, AMPERE, HOPPER])
def test_small_batches_stream_weights_everywhere(M, capability):
    assert kernels_for(M, capability=capability) == (SMALL_M,)
    assert kernels_for(M, torch.float32, capability=capability) == (SMALL_M,)


@pytest.mark.parametrize("M", [SMALL_M_MAX + 1, 100, 130, MID_M_MAX])
def test_mid_batches_time_a_tiled_kernel_against_weight_streaming(M):
    assert kernels_for(M, torch.bfloat16) == (TMA_PERSISTENT, SMALL_M)
    assert kernels_for(M, torch.float16) == (TMA_PERSISTENT, SMALL_M)
    assert kernels_for(M, torch.float32) == (TILED, SMALL_M)
    assert kernels_for(M, capability=None) == (TILED, SMALL_M)


@pytest.mark.parametrize("M", [MID_M_MAX + 1, 1000, 8192])
def test_large_batches_on_hopper_use_tma(M):
    assert kernels_for(M, torch.bfloat16) == (TMA_PERSISTENT,)
    assert kernels_for(M, torch.float16) == (TMA_PERSISTENT,)


@pytest.mark.parametrize("M", [1, 100, 4096])
def test_gluon_competes_where_it_accepts_the_shape(M):
    assert GLUON in kernels_for(M, gluon_ok=True)
    assert GLUON not in kernels_for(M, gluon_ok=False)
    assert GLUON not in kernels_for(M, gluon_ok=True, tma_aligned=False)
    assert GLUON not in kernels_for(M, torch.float32, gluon_ok=True)
    assert GLUON not in kernels_for(M, capability=AMPERE, gluon_ok=True)


@pytest.mark.parametrize("M", [1, 3, 16, 17, SMALL_M_MAX])
def test_gluon_weight_streaming_competes_at_small_batches_on_hopper(M):
    # The Triton kernel stays the default (first); the Gluon ones are timed against it.
    ws = (GLUON_WS, ) if M > GLUON_WS_MIN_M else ()
    assert kernels_for(M, gluon_ok=True) == (SMALL_M, GLUON_SMALL_M, GLUON) + ws
    assert kernels_for(M, torch.float16, gluon_ok=True) == (SMALL_M, GLUON_SMALL_M, GLUON) + ws
    assert GLUON_SMALL_M not in kernels_for(M, torch.float32, gluon_ok=True)
    assert GLUON_SMALL_M not in kernels_for(M, gluon_ok=True, tma_aligned=False)
    assert GLUON_SMALL_M not in kernels_for(M, capability=AMPERE, gluon_ok=True)
    assert kernels_for(GLUON_SMALL_M_MAX, gluon_ok=True) == (TMA_PERSISTENT, SMALL_M, GLUON_SMALL_M, GLUON, GLUON_WS)
    assert GLUON_SMALL_M not in kernels_for(GLUON_SMALL_M_MAX + 1, gluon_ok=True)


@pytest.mark.parametrize("M", [GLUON_WS_MIN_M + 1, SMALL_M_MAX, SMALL_M_MAX + 1, 256, 4096])
def test_warp_specialized_gluon_competes_past_small_batches_on_hopper(M):
    assert kernels_for(M, gluon_ok=True)[-1] == GLUON_WS
    assert kernels_for(M, torch.float16, gluon_ok=True)[-1] == GLUON_WS
    assert GLUON_WS not in kernels_for(GLUON_WS_MIN_M, gluon_ok=True)  # weight streaming's ground
    for kwargs in (dict(gluon_ok=False), dict(dtype=torch.float32, gluon_ok=True),
                   dict(gluon_ok=True, tma_aligned=False), dict(capability=AMPERE, gluon_ok=True)):
        assert GLUON_WS not in kernels_for(M, **kwargs), kwargs


@pytest.mark.parametrize("kwargs", [
    dict(dtype=torch.float32),  # fp32 stays on the portable kernel (TF32 only if torch allows it)
    dict(capability=AMPERE),  # no TMA/WGMMA before Hopper
    dict(capability=(10, 0)),  # Hopper-only paths are for 9.x only
    dict(capability=None),  # the interpreter
    dict(tma_aligned=False),  # misaligned rows or views
])
def test_everything_else_gets_the_portable_kernel(kwargs):
    assert kernels_for(1000, **kwargs) == (TILED,)


def test_tune_cache_directory_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path / "tc"))
    assert autotune_cache.cache_dir() == tmp_path / "tc"
    monkeypatch.delenv(autotune_cache.ENV_VAR)
    assert autotune_cache.cache_dir().parts[-2:] == (".cache", "fusedserve")


def test_tune_cache_survives_a_restart(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path))
    first = autotune_cache.TuneCache("NVIDIA H200 (test)")
    assert first.get("k") is None
    first.put("k", {"BLOCK_M": 64, "num_warps": 4})
    again = autotune_cache.TuneCache("NVIDIA H200 (test)")
    assert again.get("k") == {"BLOCK_M": 64, "num_warps": 4}
    assert first.path == again.path and first.path.parent == tmp_path
    assert json.loads(first.path.read_text()) == {"k": {"BLOCK_M": 64, "num_warps": 4}}
    assert list(tmp_path.glob("*.tmp")) == [], "atomic write left a temporary file"
    # Another GPU model gets its own file.
    assert autotune_cache.TuneCache("other gpu").get("k") is None


def test_corrupt_tune_cache_says_which_file(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path))
    autotune_cache.TuneCache("gpu").path.write_text("{not json")
    with pytest.raises(ValueError, match="tune cache .*gpu-triton.*delete it"):
        autotune_cache.TuneCache("gpu")


def test_config_str():
    assert autotune_cache.config_str({"BLOCK_M": 64, "num_warps": 4}) == "BLOCK_M=64,num_warps=4"


def fake_timer(fake_ms):
    """A timer whose samples come from ``fake_ms[result of the call]`` (lists are consumed in order)."""
    def timer(fn):
        key = fn()  # called eagerly first, like the real timer: a bad config raises here

        def sample(repeats):
            values = fake_ms[key]
            return [values.pop(0) if isinstance(values, list) else values for _ in range(repeats)]
        return sample
    return timer


def test_time_configs_skips_what_does_not_fit_and_warns_on_failures():
    from triton.runtime.errors import OutOfResources

    def run(option):
        if option == "b":
            raise OutOfResources(300000, 232448, "shared memory")
        if option == "c":
            raise RuntimeError("kernel c does not build here")
        return option

    timer = fake_timer({"a": 2.0, "d": 1.0})
    with pytest.warns(RuntimeWarning, match="candidate c failed.*does not build"):
        timings, best = autotune_cache.time_configs(["a", "b", "c", "d"], run, timer=timer)
    assert best == "d" and timings == [(2.0, "a"), (1.0, "d")]
    with pytest.raises(RuntimeError, match="does not build"), pytest.warns(RuntimeWarning):
        autotune_cache.time_configs(["b", "c"], run, timer=timer)


def test_graph_timing_fallback_names_the_candidate(monkeypatch):
    # Where a candidate cannot be captured into a CUDA graph it is timed with do_bench instead, and
    # the warning says which candidate (the first round and the finalists' re-timing alike).
    def graph_timer(run, calls_hint):
        if run() == "b":
            raise RuntimeError("operation not permitted when stream is capturing")
        return lambda repeats: [1.0] * repeats

    monkeypatch.setattr(autotune_cache, "graph_timer", graph_timer)
    monkeypatch.setattr(autotune_cache, "bench_timer", lambda run: (lambda repeats: [2.0] * repeats))
    with pytest.warns(RuntimeWarning, match=r"CUDA-graph timing failed for b \(RuntimeError: operation not") as caught:
        timings, best = autotune_cache.time_configs(["a", "b"], lambda o: o, timer=autotune_cache.default_timer())
    assert timings == [(1.0, "a"), (2.0, "b")] and best == "a"
    assert len(caught) == 2  # first round, then again when the finalists are re-timed
    assert autotune_cache._timing.get() is None  # nothing left named once tuning is over


def test_gc_paused_restores_the_collector_as_it_was():
    import gc

    from fusedserve.kernels.common import gc_paused

    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        assert not gc.isenabled()
        raise ValueError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled(), "a collector that was off came back on"
    finally:
        gc.enable()


def test_graph_timer_captures_with_the_collector_paused(monkeypatch):
    # A collection mid-capture that frees a dead CUDA graph breaks the capture (its teardown is not
    # allowed while a stream captures), so every call inside one must run with the collector off.
    import contextlib
    import gc

    captured = []

    class Graph:
        def capture_begin(self, **kwargs):
            captured.append("begin")

        def capture_end(self):
            captured.append("end")

        def replay(self):
            pass

    class Event:
        def __init__(self, **kwargs):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    class Stream:
        def wait_stream(self, other):
            pass

    for name, value in (("CUDAGraph", Graph), ("Event", Event), ("Stream", Stream), ("current_stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    calls = []
    sample = autotune_cache.graph_timer(lambda: calls.append((captured[-1:] == ["begin"], gc.isenabled())), 2)
    assert sample(3) and gc.isenabled()
    inside = [enabled for capturing, enabled in calls if capturing]
    assert inside and not any(inside), calls
    assert all(enabled for capturing, enabled in calls if not capturing)  # the eager warm-up calls


def test_time_configs_retimes_the_finalists_and_trusts_the_second_round():
    first, final = autotune_cache._FIRST_REPEATS, autotune_cache._FINAL_ROUNDS * autotune_cache._FINAL_REPEATS
    # "a" looked fastest in the first round by luck; the re-timing shows "b" is faster. "d" is
    # fourth in the first round, so it is not a finalist and is never sampled again.
    fake_ms = {"a": [1.0] * first + [3.0] * final, "b": [1.5] * first + [2.0] * final,
               "c": [1.6] * first + [2.5] * final, "d": [1.7] * first}
    timings, best = autotune_cache.time_configs(["a", "b", "c", "d"], lambda o: o, timer=fake_timer(fake_ms))
    assert best == "b", timings
    assert all(v == [] for v in fake_ms.values()), f"samples left unread: {fake_ms}"


def test_time_configs_with_one_candidate_times_it_once():
    fake_ms = {"a": [1.0] * autotune_cache._FIRST_REPEATS}
    assert autotune_cache.time_configs(["a"], lambda o: o, timer=fake_timer(fake_ms))[1] == "a"
    assert fake_ms["a"] == []


def test_time_configs_without_candidates_says_so():
    with pytest.raises(ValueError, match="no candidate configs"):
        autotune_cache.time_configs([], lambda o: o, timer=fake_timer({}))
