"""ModelRunner on CUDA: CUDA graphs, asynchronous event timings, triton vs torch backends."""

import pytest
import torch

from models import MLP, MLPConfig, ModelRunner

pytestmark = pytest.mark.gpu

MAX_BATCH = 130


class ListSink:
    def __init__(self):
        self.timings = []

    def record_layer(self, timing):
        self.timings.append(timing)


def make_model(backend, dtype="float32"):
    torch.manual_seed(0)
    config = MLPConfig(in_features=100, hidden_features=(256, 70), out_features=10, dtype=dtype)
    model = MLP(config, backend=backend, device="cuda", name="gpu_tiny").eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    return model


@pytest.mark.parametrize("fused", [False, True])
def test_graphs_on_and_off_give_equal_outputs(fused):
    model = make_model("triton")
    graphed = ModelRunner(model, max_batch_size=MAX_BATCH, cuda_graphs=True, fused=fused)
    eager = ModelRunner(model, max_batch_size=MAX_BATCH, cuda_graphs=False, fused=fused)
    graphed.warmup()
    eager.warmup()
    assert graphed.cuda_graphs, "capture fell back to eager launches: see the logged warning"
    assert sorted(graphed._graphs) == graphed.buckets
    torch.manual_seed(1)
    for rows in (1, 3, 17, 100, MAX_BATCH):
        x = torch.randn(rows, 100)
        # Same kernels, same configs, same buffers: a graph replay must be bitwise equal.
        torch.testing.assert_close(graphed.run(x), eager.run(x), rtol=0, atol=0,
                                   msg=lambda m, rows=rows: f"rows={rows}: {m}")


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_timings_arrive_after_a_few_runs(cuda_graphs):
    sink = ListSink()
    runner = ModelRunner(make_model("triton"), max_batch_size=MAX_BATCH, timing_sink=sink,
                         cuda_graphs=cuda_graphs, timing_sample_every=2, fused=False)
    runner.warmup()
    for _ in range(8):
        runner.run(torch.randn(17, 100))
    # Each run resolves the previous runs' events; flush takes the last ones.
    arrived_before_flush = len(sink.timings)
    runner.flush_timings()
    batches_timed = 8 if not cuda_graphs else 4  # every 2nd batch when graphs hide the kernels
    assert len(sink.timings) == 3 * batches_timed, f"{len(sink.timings)} timings: {sink.timings}"
    assert arrived_before_flush > 0, "no timing was resolved by later runs"
    assert runner.pending_timings() == 0
    for t in sink.timings:
        assert (t.rows, t.M, t.backend) == (17, 32, "triton"), t
        assert t.kernel and t.config, f"kernel/config unknown after warm-up: {t}"
        assert 0 < t.seconds < 0.1, t
    assert [(t.N, t.K) for t in sink.timings[:3]] == [(256, 100), (70, 256), (10, 70)]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_fused_kernel_timings_arrive(cuda_graphs):
    sink = ListSink()
    runner = ModelRunner(make_model("triton"), max_batch_size=MAX_BATCH, timing_sink=sink,
                         cuda_graphs=cuda_graphs, timing_sample_every=2)
    assert runner.fused, "a 100-256-70-10 model should take the fused MLP kernel"
    runner.warmup()
    for _ in range(8):
        runner.run(torch.randn(3, 100))
    runner.flush_timings()
    assert len(sink.timings) == (4 if cuda_graphs else 8), sink.timings
    for t in sink.timings:
        assert (t.layer, t.rows, t.M, t.N, t.K, t.kernel) == ("fused_mlp", 3, 4, 10, 100, "triton_fused_mlp"), t
        assert t.config and 0 < t.seconds < 0.1, t


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype, tol", [
    # fp32 with TF32 off (torch's default): ieee dots, only summation order differs.
    ("float32", 1e-4),
    # 16-bit: outputs round to 11 (fp16) / 8 (bf16) mantissa bits at every layer; 3 layers.
    ("float16", 1e-2),
    ("bfloat16", 5e-2),
])
def test_triton_backend_matches_torch_on_gpu(dtype, tol, fused):
    fused_runner = ModelRunner(make_model("triton", dtype), max_batch_size=MAX_BATCH, fused=fused)
    reference = ModelRunner(make_model("torch", dtype), max_batch_size=MAX_BATCH)
    fused_runner.warmup()
    reference.warmup()
    torch.manual_seed(2)
    for rows in (1, 3, 17, MAX_BATCH):
        x = torch.randn(rows, 100)
        torch.testing.assert_close(fused_runner.run(x), reference.run(x), rtol=tol, atol=tol,
                                   msg=lambda m, rows=rows: f"{dtype} fused={fused} rows={rows}: {m}")


def test_compute_replays_the_graph_run_uses():
    runner = ModelRunner(make_model("triton"), max_batch_size=MAX_BATCH)
    x = torch.randn(17, 100)
    via_run = runner.run(x)
    runner.input_buffer[:17].copy_(x)
    out = runner.compute(32)
    assert out.device.type == "cuda" and out.shape == (32, 10)
    # The same captured graph on the same rows: bitwise equal.
    torch.testing.assert_close(out[:17].float().cpu(), via_run, rtol=0, atol=0)
