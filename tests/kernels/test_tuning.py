"""Choosing by timing (``tuning``) and how one candidate is timed (``timers``), with fake timers
and a fake CUDA where a GPU would be needed."""

import pytest
import torch

from fusedserve.kernels import timers, tuning


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
        timings, best = tuning.time_configs(["a", "b", "c", "d"], run, timer=timer)
    assert best == "d" and timings == [(2.0, "a"), (1.0, "d")]
    with pytest.raises(RuntimeError, match="does not build"), pytest.warns(RuntimeWarning):
        tuning.time_configs(["b", "c"], run, timer=timer)


def test_graph_timing_fallback_names_the_candidate(monkeypatch):
    # Where a candidate cannot be captured into a CUDA graph it is timed with do_bench instead, and
    # the warning says which candidate (the first round and the finalists' re-timing alike).
    def graph_timer(run, calls_hint):
        if run() == "b":
            raise RuntimeError("operation not permitted when stream is capturing")
        return lambda repeats: [1.0] * repeats

    monkeypatch.setattr(timers, "graph_timer", graph_timer)
    monkeypatch.setattr(timers, "bench_timer", lambda run: (lambda repeats: [2.0] * repeats))
    with pytest.warns(RuntimeWarning, match=r"CUDA-graph timing failed for b \(RuntimeError: operation not") as caught:
        timings, best = tuning.time_configs(["a", "b"], lambda o: o, timer=timers.default_timer())
    assert timings == [(1.0, "a"), (2.0, "b")] and best == "a"
    assert len(caught) == 2  # first round, then again when the finalists are re-timed
    assert timers.timing_candidate.get() is None  # nothing left named once tuning is over


def test_gc_paused_restores_the_collector_as_it_was():
    import gc

    from fusedserve.kernels.device import gc_paused

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
    sample = timers.graph_timer(lambda: calls.append((captured[-1:] == ["begin"], gc.isenabled())), 2)
    assert sample(3) and gc.isenabled()
    inside = [enabled for capturing, enabled in calls if capturing]
    assert inside and not any(inside), calls
    assert all(enabled for capturing, enabled in calls if not capturing)  # the eager warm-up calls


def test_time_configs_retimes_the_finalists_and_trusts_the_second_round():
    first, final = tuning._FIRST_REPEATS, tuning._FINAL_ROUNDS * tuning._FINAL_REPEATS
    # "a" looked fastest in the first round by luck; the re-timing shows "b" is faster. "d" is
    # fourth in the first round, so it is not a finalist and is never sampled again.
    fake_ms = {"a": [1.0] * first + [3.0] * final, "b": [1.5] * first + [2.0] * final,
               "c": [1.6] * first + [2.5] * final, "d": [1.7] * first}
    timings, best = tuning.time_configs(["a", "b", "c", "d"], lambda o: o, timer=fake_timer(fake_ms))
    assert best == "b", timings
    assert all(v == [] for v in fake_ms.values()), f"samples left unread: {fake_ms}"


def test_time_configs_with_one_candidate_times_it_once():
    fake_ms = {"a": [1.0] * tuning._FIRST_REPEATS}
    assert tuning.time_configs(["a"], lambda o: o, timer=fake_timer(fake_ms))[1] == "a"
    assert fake_ms["a"] == []


def test_time_configs_without_candidates_says_so():
    with pytest.raises(ValueError, match="no candidate configs"):
        tuning.time_configs([], lambda o: o, timer=fake_timer({}))


def test_tuning_yields_between_candidates_and_a_raise_there_stops_it():
    calls = []
    with tuning.yielding(lambda: calls.append(len(calls))):
        tuning.time_configs(["a", "b"], lambda o: o, timer=fake_timer({"a": 1.0, "b": 2.0}))
    assert len(calls) == 2 + tuning._FINAL_ROUNDS, "after each first-round candidate and each final round"
    tuning.time_configs(["a"], lambda o: o, timer=fake_timer({"a": 1.0}))
    assert len(calls) == 2 + tuning._FINAL_ROUNDS, "outside the block nothing is called"

    def stop():
        raise KeyboardInterrupt("stand-in for the tuner's stop")

    with tuning.yielding(stop), pytest.raises(KeyboardInterrupt):
        tuning.time_configs(["a", "b"], lambda o: o, timer=fake_timer({"a": 1.0, "b": 2.0}))


def test_long_calls_take_fewer_samples_short_ones_all_of_them():
    # A first call on a large layer: ~10 ms calls get 2 first-round samples (20 ms) and one per final
    # round; the calls of a small layer every sample (the spread of a few us is what must be beaten).
    def drawn(ms_by_name):
        taken = {name: 0 for name in ms_by_name}

        def timer(run):
            name = run()
            return lambda repeats: [taken.__setitem__(name, taken[name] + 1) or ms_by_name[name]
                                    for _ in range(repeats)]
        tuning.time_configs(list(ms_by_name), lambda o: o, timer=timer)
        return taken

    rounds = tuning._FINAL_ROUNDS
    assert drawn({"a": 10.0, "b": 10.0}) == {"a": 2 + rounds, "b": 2 + rounds}
    assert drawn({"a": 10.0, "b": 30.0})["b"] == 1 + rounds, "past the budget in one call: one sample"
    everything = tuning._FIRST_REPEATS + rounds * tuning._FINAL_REPEATS
    assert drawn({"a": 0.01, "b": 0.011}) == {"a": everything, "b": everything}
    assert drawn({"a": 0.01, "b": 50.0}) == {"a": everything, "b": 1 + everything - tuning._FIRST_REPEATS}
