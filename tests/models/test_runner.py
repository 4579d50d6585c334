"""ModelRunner on the CPU: buckets, padding, timings and input checks (GPU-only parts at the end)."""

import pytest
import torch

from fusedserve.models import MLP, MLPConfig, ModelRunner

CONFIG = MLPConfig(in_features=17, hidden_features=(70, 3), out_features=5)
MAX_BATCH = 100


class ListSink:
    def __init__(self):
        self.timings = []

    def record_layer(self, timing):
        self.timings.append(timing)


def make_model(backend="torch", device="cpu", config=CONFIG):
    torch.manual_seed(0)
    model = MLP(config, backend=backend, device=device, name="tiny").eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    return model


@pytest.mark.parametrize("rows", [1, 3, 17, MAX_BATCH])
def test_padded_batches_match_the_model(rows):
    model = make_model()
    runner = ModelRunner(model, max_batch_size=MAX_BATCH)
    runner.run(torch.randn(MAX_BATCH, 17) * 100)  # leaves junk in the padding rows
    x = torch.randn(rows, 17)
    got = runner.run(x)
    assert got.shape == (rows, 5) and got.dtype == torch.float32 and got.device.type == "cpu"
    # Same ops on the same rows; only the padded GEMM's shape differs, which may reorder sums.
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5, msg=lambda m: f"rows={rows}: {m}")


def test_half_precision_model_returns_float32():
    model = make_model(config=MLPConfig(17, (70,), 5, dtype="bfloat16"))
    x = torch.randn(3, 17)
    got = ModelRunner(model, max_batch_size=8).run(x)
    assert got.dtype == torch.float32
    # bfloat16 keeps 8 mantissa bits (2**-8 relative); padding to 4 rows may round differently.
    torch.testing.assert_close(got, model(x).float(), rtol=2**-7, atol=2**-7)


def test_sink_gets_one_timing_per_layer_per_batch():
    sink = ListSink()
    runner = ModelRunner(make_model(), max_batch_size=MAX_BATCH, timing_sink=sink)
    runner.run(torch.randn(3, 17))
    runner.run(torch.randn(70, 17))
    assert [(t.layer, t.rows, t.M, t.N, t.K) for t in sink.timings] == [
        ("layers.0", 3, 4, 70, 17), ("layers.1", 3, 4, 3, 70), ("layers.2", 3, 4, 5, 3),
        ("layers.0", 70, 100, 70, 17), ("layers.1", 70, 100, 3, 70), ("layers.2", 70, 100, 5, 3),
    ]
    for t in sink.timings:
        assert (t.model, t.dtype, t.backend, t.config) == ("tiny", "float32", "torch", ""), t
        assert t.seconds > 0, t
    assert [t.kernel for t in sink.timings[:3]] == ["torch.linear+relu", "torch.linear+relu", "torch.linear"]
    assert runner.pending_timings() == 0 and runner.flush_timings() == 0


def test_warmup_runs_every_bucket_and_records_nothing():
    sink = ListSink()
    runner = ModelRunner(make_model(), max_batch_size=10, timing_sink=sink)
    seconds = runner.warmup()
    assert sorted(seconds) == [1, 2, 4, 8, 10]
    assert all(s > 0 for s in seconds.values()), seconds
    assert sink.timings == []


def test_attributes():
    runner = ModelRunner(make_model(), max_batch_size=MAX_BATCH)
    assert (runner.name, runner.in_features, runner.out_features, runner.max_batch_size) == ("tiny", 17, 5, 100)
    assert (runner.device.type, runner.backend, runner.dtype, runner.cuda_graphs) == ("cpu", "torch", torch.float32,
                                                                                      False)


@pytest.mark.parametrize("x, error, message", [
    (torch.randn(3, 16), ValueError, r"shape \[M, 17\]"),
    (torch.randn(3), ValueError, r"shape \[M, 17\]"),
    (torch.randn(MAX_BATCH + 1, 17), ValueError, "1 to 100 rows"),
    (torch.randn(0, 17), ValueError, "1 to 100 rows"),
    (torch.randn(3, 17, dtype=torch.float64), TypeError, "float32"),
    ([[0.0] * 17], TypeError, "torch.Tensor"),
])
def test_bad_inputs_are_rejected(x, error, message):
    runner = ModelRunner(make_model(), max_batch_size=MAX_BATCH)
    with pytest.raises(error, match=message):
        runner.run(x)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_batch_size"):
        ModelRunner(make_model(), max_batch_size=0)
    with pytest.raises(ValueError, match="timing_sample_every"):
        ModelRunner(make_model(), max_batch_size=4, timing_sample_every=0)
    with pytest.raises(ValueError, match="timing_min_interval_s"):
        ModelRunner(make_model(), max_batch_size=4, timing_min_interval_s=-1.0)
    with pytest.raises(TypeError, match="model"):
        ModelRunner(torch.nn.Linear(2, 2), max_batch_size=4)
    with pytest.raises(ValueError, match="cuda_graphs"):
        ModelRunner(make_model(), max_batch_size=4, cuda_graphs=True)


@pytest.mark.parametrize("fused", [False, True])
def test_triton_backend_under_the_interpreter_matches_torch(fused):
    if torch.cuda.is_available():
        pytest.skip("the CUDA version of this check is in test_runner_gpu.py")
    sink = ListSink()
    reference = make_model()
    runner = ModelRunner(make_model(backend="triton"), max_batch_size=8, timing_sink=sink, fused=fused)
    assert runner.fused is fused
    x = torch.randn(3, 17)
    # float32 with ieee dots in the interpreter: only summation order differs.
    torch.testing.assert_close(runner.run(x), reference(x), rtol=1e-5, atol=1e-5)
    assert runner.path(4) == ("fused" if fused else "layers") and runner.path(8) is None
    # One timing per layer launch on either path; the fused path names its own kernel.
    assert [(t.layer, t.N, t.K) for t in sink.timings] == [("layers.0", 70, 17), ("layers.1", 3, 70),
                                                          ("layers.2", 5, 3)]
    assert all(t.backend == "triton" and t.kernel and t.config and t.M == 4 for t in sink.timings), sink.timings
    assert all((t.kernel == "triton_fused_mlp") is fused for t in sink.timings), sink.timings


def test_fused_warmup_tunes_the_chain_on_the_bucket_before_its_first_launch(monkeypatch):
    from fusedserve.kernels.triton import fused_mlp as fused_mlp_module

    calls = []
    tune_chain, fused_mlp_layer = fused_mlp_module.tune_chain, fused_mlp_module.fused_mlp_layer

    def recorded_tune_chain(x, packed, shift, scale):
        assert packed is runner._paths["fused"].packed and x.data_ptr() == runner.input_buffer.data_ptr()
        calls.append(("tune", x.shape[0]))
        return tune_chain(x, packed, shift, scale)

    def recorded_layer(h, packed, index, *args, **kwargs):
        calls.append(("layer", h.shape[0], index))
        return fused_mlp_layer(h, packed, index, *args, **kwargs)

    monkeypatch.setattr(fused_mlp_module, "tune_chain", recorded_tune_chain)
    monkeypatch.setattr(fused_mlp_module, "fused_mlp_layer", recorded_layer)
    runner = ModelRunner(make_model(backend="triton"), max_batch_size=2, fused=True)
    runner.warmup()
    # Each bucket's chain is tuned before any of its layers launches (whatever timing follows: none
    # where an earlier test in this process tuned the same widths).
    assert [c for c in calls if c[0] == "tune"] == [("tune", 1), ("tune", 2)], calls
    for bucket in (1, 2):
        launches = [i for i, c in enumerate(calls) if c[0] == "layer" and c[1] == bucket]
        assert launches and min(launches) > calls.index(("tune", bucket)), calls
        assert {calls[i][2] for i in launches} == {0, 1, 2}, calls


def test_fused_is_only_automatic_with_the_triton_backend():
    runner = ModelRunner(make_model(), max_batch_size=4)
    assert not runner.fused
    runner.warmup()
    assert [runner.path(b) for b in runner.buckets] == ["layers"] * 3 and runner.path_seconds == {}
    with pytest.raises(ValueError, match="fused=True"):
        ModelRunner(make_model(), max_batch_size=4, fused=True)
    with pytest.raises(ValueError, match="bucket"):
        runner.path(3)


def test_collect_timings_has_nothing_pending_on_the_cpu():
    sink = ListSink()
    runner = ModelRunner(make_model(), max_batch_size=4, timing_sink=sink)
    runner.run(torch.randn(1, 17))
    # perf_counter timings reach the sink during run; no events wait for collection.
    assert len(sink.timings) == 3 and runner.collect_timings() == 0 and runner.pending_timings() == 0


def test_compute_runs_a_bucket_on_the_input_buffer():
    model = make_model()
    runner = ModelRunner(model, max_batch_size=10)
    x = torch.randn(10, 17)
    runner.input_buffer.copy_(x)
    # Same ops on the same rows as the model itself: bitwise equal.
    torch.testing.assert_close(runner.compute(10), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="bucket"):
        runner.compute(3)


class _Graph:
    def replay(self):
        pass


@pytest.mark.parametrize("current_faster", [True, False])
def test_a_swap_keeps_the_provisional_graph_where_it_times_faster(monkeypatch, current_faster):
    from fusedserve.models import warming

    runner = ModelRunner(make_model(), max_batch_size=8)
    runner.warmup()
    runner.choice_states[8] = "provisional"
    runner._graphs.plain[8] = (_Graph(), None)
    monkeypatch.setattr(warming, "current_is_faster", lambda current, tuned: current_faster)
    assert runner._keeps_current(8, (_Graph(), None)) is current_faster
    assert runner.choice_states[8] == ("tuned" if current_faster else "provisional")
    assert runner._keeps_current(8, None) is False, "nothing tuned to compare with: swap"
