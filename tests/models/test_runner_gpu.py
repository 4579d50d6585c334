"""ModelRunner on CUDA: CUDA graphs, asynchronous event timings, the path choice, triton vs torch.

Kept fast on purpose: every bucket of every layer on the "layers" path tunes kernels.fused_linear
(seconds per shape), so those tests use max_batch_size=1 (one bucket); the fused path compiles one
kernel per tile config, so its tests afford a few buckets (padding 3 rows to 4 included).
"""

import json
import threading

import pytest
import torch

from fusedserve.models import MLP, MLPConfig, ModelRunner

pytestmark = pytest.mark.gpu

FUSED_MAX_BATCH = 5  # buckets [1, 2, 4, 5]
IN, HIDDEN, OUT = 100, 70, 10


class ListSink:
    def __init__(self):
        self.timings = []

    def record_layer(self, timing):
        self.timings.append(timing)


def make_model(backend, dtype="float32"):
    torch.manual_seed(0)
    config = MLPConfig(in_features=IN, hidden_features=(HIDDEN,), out_features=OUT, dtype=dtype)
    model = MLP(config, backend=backend, device="cuda", name="gpu_tiny").eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    return model


@pytest.mark.parametrize("fused, max_batch, rows_list, graph_copies", [
    (True, FUSED_MAX_BATCH, (1, 3, 5), False), (True, FUSED_MAX_BATCH, (1, 3, 5), True), (False, 1, (1,), False)])
def test_graphs_on_and_off_give_equal_outputs(fused, max_batch, rows_list, graph_copies):
    model = make_model("triton")
    graphed = ModelRunner(model, max_batch_size=max_batch, cuda_graphs=True, fused=fused, graph_copies=graph_copies)
    eager = ModelRunner(model, max_batch_size=max_batch, cuda_graphs=False, fused=fused)
    graphed.warmup()
    eager.warmup()
    assert graphed.cuda_graphs, "capture fell back to eager launches: see the logged warning"
    assert sorted(graphed._graphs.plain) == graphed.buckets
    # With graph_copies every bucket has its graph with copies inside, which run replays here.
    assert sorted(graphed._graphs.served) == (graphed.buckets if graph_copies else [])
    torch.manual_seed(1)
    for rows in rows_list:
        x = torch.randn(rows, IN)
        # Same kernels, same configs, same buffers: a graph replay must be bitwise equal.
        torch.testing.assert_close(graphed.run(x), eager.run(x), rtol=0, atol=0,
                                   msg=lambda m, rows=rows: f"fused={fused} rows={rows}: {m}")


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_first_batch_and_every_nth_are_timed_and_collected_without_a_later_batch(cuda_graphs):
    sink = ListSink()
    runner = ModelRunner(make_model("triton"), max_batch_size=FUSED_MAX_BATCH, timing_sink=sink,
                         cuda_graphs=cuda_graphs, timing_sample_every=3, timing_min_interval_s=0,
                         fused=True)
    runner.warmup()
    assert sink.timings == [], "warm-up must not record timings"
    runner.run(torch.randn(3, IN))
    torch.cuda.synchronize()  # the GPU is past the events; only a collection is missing (eager)
    runner.collect_timings()  # (a timed graph's timings are read as its batch ends)
    assert len(sink.timings) == 2, "the first batch of a bucket must be timed, one timing per layer"
    for _ in range(7):
        runner.run(torch.randn(3, IN))
    runner.flush_timings()
    batches_timed = 8 if not cuda_graphs else 3  # with graphs: batches 0, 3 and 6 of the bucket
    assert len(sink.timings) == 2 * batches_timed, f"{len(sink.timings)} timings: {sink.timings}"
    assert runner.pending_timings() == 0
    for t in sink.timings:
        assert (t.rows, t.M, t.backend, t.kernel) == (3, 4, "triton", "triton_fused_mlp"), t
        assert t.config and 0 < t.seconds < 0.1, t
    assert [(t.layer, t.N, t.K) for t in sink.timings[:2]] == [("layers.0", HIDDEN, IN), ("layers.1", OUT, HIDDEN)]


@pytest.mark.parametrize("fused, max_batch, rows_list", [(True, FUSED_MAX_BATCH, (1, 3, 5)), (False, 1, (1,))])
def test_timed_batches_replay_a_graph_with_events_and_match_untimed_ones(fused, max_batch, rows_list):
    model = make_model("triton")
    sink = ListSink()
    timed = ModelRunner(model, max_batch_size=max_batch, timing_sink=sink, timing_sample_every=1,
                        timing_min_interval_s=0, fused=fused)
    plain = ModelRunner(model, max_batch_size=max_batch, fused=fused)
    timed.warmup()
    plain.warmup()
    assert sorted(timed._graphs.timed) == timed.buckets, "no timed graph: see the logged warning"
    torch.manual_seed(2)
    for rows in rows_list:
        x = torch.randn(rows, IN)
        # The same kernels and configs with event nodes between them: bitwise equal outputs.
        torch.testing.assert_close(timed.run(x), plain.run(x), rtol=0, atol=0,
                                   msg=lambda m, rows=rows: f"fused={fused} rows={rows}: {m}")
    assert timed.pending_timings() == 0, "a timed graph's events are read when its batch ends"
    assert [(t.rows, t.layer) for t in sink.timings] == [(r, f"layers.{i}") for r in rows_list for i in (0, 1)]
    for t in sink.timings:
        assert 0 < t.seconds < 0.01, t  # two tiny layers: microseconds, not nothing, not a stall


def test_min_interval_caps_how_often_graph_batches_are_timed():
    sink = ListSink()
    runner = ModelRunner(make_model("triton"), max_batch_size=FUSED_MAX_BATCH, timing_sink=sink,
                         timing_sample_every=1, timing_min_interval_s=3600, fused=True)
    runner.warmup()
    for _ in range(5):
        runner.run(torch.randn(1, IN))
    runner.flush_timings()
    # Only the bucket's first batch: the next one would be due by count but not by time.
    assert len(sink.timings) == 2, sink.timings


def test_layers_path_timings_name_the_tuned_kernels():
    sink = ListSink()
    runner = ModelRunner(make_model("triton"), max_batch_size=1, timing_sink=sink, fused=False)
    runner.warmup()
    runner.run(torch.randn(1, IN))
    runner.flush_timings()
    assert [(t.layer, t.N, t.K) for t in sink.timings] == [("layers.0", HIDDEN, IN), ("layers.1", OUT, HIDDEN)]
    for t in sink.timings:
        assert t.kernel and t.kernel != "triton_fused_mlp" and t.config, f"kernel/config unknown after warm-up: {t}"


@pytest.mark.parametrize("dtype, fused, max_batch, tol", [
    # fp32 with TF32 off (torch's default): ieee dots, only summation order differs.
    ("float32", True, FUSED_MAX_BATCH, 1e-4),
    ("float32", False, 1, 1e-4),
    # 16-bit: outputs round to 11 (fp16) / 8 (bf16) mantissa bits at every layer; 2 layers.
    ("float16", True, FUSED_MAX_BATCH, 1e-2),
    ("bfloat16", True, FUSED_MAX_BATCH, 5e-2),
    ("bfloat16", None, 1, 5e-2),  # automatic: both paths timed, the faster kept
])
def test_triton_backend_matches_torch_on_gpu(dtype, fused, max_batch, tol):
    runner = ModelRunner(make_model("triton", dtype), max_batch_size=max_batch, fused=fused, provisional=False)
    reference = ModelRunner(make_model("torch", dtype), max_batch_size=max_batch)
    runner.warmup()
    reference.warmup()
    if fused is None:
        seconds = runner.path_seconds[1]
        assert sorted(seconds) == ["fused", "layers", "vendor"] and all(0 < s < 0.1 for s in seconds.values()), seconds
        assert runner.path(1) == min(seconds, key=seconds.get), (runner.path(1), seconds)
    else:
        assert runner.path_seconds == {}, "a forced path must not be timed"
        assert {runner.path(b) for b in runner.buckets} == {"fused" if fused else "layers"}
    torch.manual_seed(2)
    for rows in (1, 3, 5):
        if rows > max_batch:
            break
        x = torch.randn(rows, IN)
        torch.testing.assert_close(runner.run(x), reference.run(x), rtol=tol, atol=tol,
                                   msg=lambda m, rows=rows: f"{dtype} fused={fused} rows={rows}: {m}")


class CountedGraph:
    """A captured graph whose replays are counted."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def replay(self):
        self.replays += 1
        self.graph.replay()


@pytest.mark.parametrize("out_features, rows, copies_inside", [
    (OUT, 3, True),  # 1 padded row of 440 bytes: the graph copies the whole bucket
    (OUT, 4, True),
    (5000, 3, False),  # 1 padded row of 20 KB: the rows go around the plain graph
    (5000, 4, True),  # no padding
])
def test_run_replays_the_graph_with_copies_where_padding_is_cheap(out_features, rows, copies_inside):
    torch.manual_seed(0)
    config = MLPConfig(in_features=IN, hidden_features=(HIDDEN,), out_features=out_features)
    model = MLP(config, backend="triton", device="cuda", name="gpu_wide").eval().requires_grad_(False)
    runner = ModelRunner(model, max_batch_size=FUSED_MAX_BATCH, fused=True, graph_copies=True)
    eager = ModelRunner(model, max_batch_size=FUSED_MAX_BATCH, cuda_graphs=False, fused=True)
    runner.warm(4)
    graph, out = runner._graphs.served[4]
    counted = runner._graphs.served[4] = (CountedGraph(graph), out)
    for seed in (1, 2):  # twice: the second batch must not read the first one's rows
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed))
        # The same kernels and configs as eager launches: bitwise equal.
        torch.testing.assert_close(runner.run(x), eager.run(x), rtol=0, atol=0)
    assert counted[0].replays == (2 if copies_inside else 0)


def test_compute_replays_the_graph_run_uses():
    runner = ModelRunner(make_model("triton"), max_batch_size=FUSED_MAX_BATCH, fused=True)
    x = torch.randn(3, IN)
    via_run = runner.run(x)
    runner.input_buffer[:3].copy_(x)
    out = runner.compute(4)
    assert 4 in runner._graphs.plain and out.device.type == "cuda" and out.shape == (4, OUT)
    assert out.dtype == torch.float32  # the cast to what the host copy reads is in the graph
    # The same captured graph on the same rows: bitwise equal.
    torch.testing.assert_close(out[:3].float().cpu(), via_run, rtol=0, atol=0)


def test_fused_warmup_chain_tunes_every_layer_and_timings_name_those_configs(tmp_path, monkeypatch):
    from fusedserve.kernels.family import config_str
    from fusedserve.kernels.triton import fused_mlp
    from fusedserve.kernels.tune_cache import TuneCache

    cache = TuneCache(torch.cuda.get_device_name(), tmp_path)  # nothing tuned yet
    monkeypatch.setattr(fused_mlp, "device_cache", lambda name: cache)
    sink = ListSink()
    runner = ModelRunner(make_model("triton"), max_batch_size=FUSED_MAX_BATCH, timing_sink=sink,
                         timing_sample_every=1, timing_min_interval_s=0, fused=True, provisional=False)
    runner.warmup()
    packed = runner._paths["fused"].packed
    keys = {fused_mlp._tune_key(bucket, packed, i) for bucket in runner.buckets for i in (0, 1)}
    assert set(json.loads(cache.path.read_text())) == keys, "warm-up chain-tunes every layer of every bucket"
    for rows in (1, 3, 5):
        runner.run(torch.randn(rows, IN))
    runner.flush_timings()
    assert len(sink.timings) == 6, sink.timings
    for t in sink.timings:  # the configs the captured graphs launch: the chain-tuned ones
        index = int(t.layer.removeprefix("layers."))
        assert t.config == config_str(cache.get(fused_mlp._tune_key(t.M, packed, index))), t


def test_automatic_choice_leaves_out_a_path_that_fails(monkeypatch, caplog):
    from fusedserve.kernels.triton import fused_mlp as fused_mlp_module

    def broken(*args, **kwargs):
        raise RuntimeError("stand-in for a kernel that cannot launch here")

    monkeypatch.setattr(fused_mlp_module, "fused_mlp_layer", broken)
    runner = ModelRunner(make_model("triton"), max_batch_size=1)
    runner.warmup()
    # Left with the rule's other path and the vendor's, timed against each other.
    assert sorted(runner.path_seconds[1]) == ["layers", "vendor"], runner.path_seconds
    assert runner.path(1) == min(runner.path_seconds[1], key=runner.path_seconds[1].get)
    assert "the fused path of 'gpu_tiny' failed" in caplog.text
    reference = ModelRunner(make_model("torch"), max_batch_size=1)
    x = torch.randn(1, IN)
    # fp32, TF32 off: only summation order differs.
    torch.testing.assert_close(runner.run(x), reference.run(x), rtol=1e-4, atol=1e-4)


@pytest.fixture
def empty_tune_cache(tmp_path, monkeypatch):
    """An empty tune cache in a directory of its own, for this process and the tuning workers it
    starts, and no provisional choice remembered."""
    from fusedserve.kernels import choosing, tune_cache

    monkeypatch.setenv(tune_cache.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(choosing, "_provisional", {})
    tune_cache.device_cache.cache_clear()
    yield tmp_path
    tune_cache.device_cache.cache_clear()  # later tests read the usual directory again


def test_cold_warmup_times_nothing_then_background_tuning_swaps_under_traffic(empty_tune_cache, monkeypatch):
    from fusedserve.kernels import tuning
    from fusedserve.models.background import BackgroundTuner

    def no_timing(*args, **kwargs):
        raise AssertionError("warm-up with an empty tune cache must not time candidates")

    runner = ModelRunner(make_model("triton", "bfloat16"), max_batch_size=4, graph_copies=True)
    reference = make_model("torch", "bfloat16")
    with monkeypatch.context() as patch:
        patch.setattr(tuning, "time_configs", no_timing)
        runner.warmup()
    assert runner.provisional_buckets() == runner.buckets and runner.startup_seconds["tune"] == 0
    assert set(runner._graphs.plain) == set(runner.buckets), "provisional buckets are captured too"
    wrong, answered, stop = [], [0], threading.Event()

    def traffic():
        g = torch.Generator().manual_seed(3)
        while not stop.is_set():
            x = torch.randn(int(torch.randint(1, 5, (1,), generator=g)), IN, generator=g)
            want = reference(x.cuda()).float().cpu()
            # bf16: outputs round to 8 mantissa bits at each of the 2 layers.
            if not torch.allclose(runner.run(x), want, rtol=5e-2, atol=5e-2):
                wrong.append(x.shape[0])
            answered[0] += 1

    client = threading.Thread(target=traffic)
    client.start()
    tuner = BackgroundTuner([runner], pause_s=0)  # on CUDA: a tuning worker process, then swaps here
    tuner.start()
    tuner.join(240)
    stop.set()
    client.join(30)
    assert not tuner.running and tuner.failed == [] and runner.provisional_buckets() == []
    assert set(runner.choice_states.values()) == {"tuned"} and set(runner._graphs.plain) == set(runner.buckets)
    assert set(runner._graphs.served) == set(runner.buckets), "swaps bring the graphs with copies too"
    assert wrong == [] and answered[0] > 0
    assert list(empty_tune_cache.glob("*.json")), "the worker's choices land in the shared tune cache"
