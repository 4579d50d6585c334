"""The serving contract, timed: ``ModelRunner.run`` as the service calls it (float32 rows on the
host in, float32 rows on the host out) against the best torch runtime for the same contract, a
CUDA graph of the same model with pinned staging buffers and the casts inside the graph.

Run on a CUDA GPU from the repository root (``bench/model.py --contract`` runs the same):

    python bench/model_contract.py [--budget-s 500] [--quick] [--plot model_contract.png]
    python bench/model_contract.py --random 6 --seed S [--at-ready]   # models nobody tuned for
    python bench/model_contract.py ... --staged   # runners that copy around their graphs (no graph_copies)

Appends the run to ``OUT/model_contract.jsonl`` (``bench/runs.py``; OUT defaults to bench/results):
rows [{"model", "dtype", "widths", "batch", "bucket", "fusedserve_us", "torch_graph_us", "ratio",
"torch_graph_device_us", "fusedserve_device_us", "fusedserve_replay_us", "torch_graph_replay_us",
"fusedserve_peer_style_us", "host_path_extra_us", "staging_extra_us", "order_penalty_us", "ratio_blocks",
"graph", "path", "choices", "kernels", "mismatch"?}]
(replay: a replay's wall time with its synchronize, no copies; peer_style: our replay inside the
peer's own call sequence, alternated with ``run``; host_path_extra: ``run`` minus that, the cost of
the runner's host work in the same pass; staging_extra: the same replay between the runner's own
copies in and out, minus the peer's sequence, alternated: the share of host_path_extra its
staging accounts for),
"summary", "method", "complete", "skipped"; rewritten after every row. Prints the targets of issue 23
(ratio = torch us / fusedserve us: >= 1.0 everywhere, >= 1.3 where launch-bound).

Peer, per batch size (exact, no padding): the torch-backend ``MLP`` (the same weights and input
normalization) captured once in a CUDA graph as ``static_out = model(static_in).float()``; a call
copies the rows into a pinned buffer, then host-to-device without blocking, replays, copies the
output device-to-host into a pinned buffer, synchronizes and returns a copy of it (the staging
buffer is the next call's). fusedserve: a runner per model (``max_batch_size`` the largest batch;
each measured bucket tuned before it is timed, as a server's are once background tuning is done;
tune cache in a fresh folder unless ``FUSEDSERVE_TUNE_CACHE`` says otherwise),
``runner.run(rows)``. Timing: the two are called in pairs whose order flips every pair
(``bench/timing.py``), ``calls`` times each in ``E2E_BLOCKS`` blocks spread over the row's other timings, wall clock per
call (``time.perf_counter``); in a block, each one's medians as first and as second of a pair,
averaged; the row takes each one's median block (``ratio_blocks``: each block's ratio). Host-side
work counts, as in serving.
``order_penalty_us``: ``run`` against itself in fixed pairs, what the first of a pair pays (what fixed
A B pairs would charge to whichever goes first).
"""

import argparse
import functools
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402
from bench.timing import alternate, order_penalty  # noqa: E402
from fusedserve.kernels import choosing, tune_cache  # noqa: E402
from fusedserve.kernels.device import gc_paused  # noqa: E402
from fusedserve.kernels.rules import bucket as bucket_of  # noqa: E402
from fusedserve.models import DEFAULT_REPOSITORY, MLP, MLPConfig, ModelRunner, load_model  # noqa: E402

# (name, in, hidden, out, dtype): issue 23's two models, the shipped digits, and other widths and
# depths in each dtype.
MODELS = (
    ("digits", None, None, None, "float32"),
    ("m256_3x1024_128_bf16", 256, (1024, 1024, 1024), 128, "bfloat16"),
    ("m512_2x2048_512_fp16", 512, (2048, 2048), 512, "float16"),
    ("m4x2048_bf16", 2048, (2048, 2048, 2048), 2048, "bfloat16"),
    ("m64_8x256_10_fp16", 64, (256,) * 8, 10, "float16"),
    ("m1024_2x1024_64_fp32", 1024, (1024, 1024), 64, "float32"),
)
BATCHES = (1, 8, 24, 64, 200, 700)
QUICK_BATCHES = (1, 24, 200)
CALLS, QUICK_CALLS = 2000, 300
# A row's end-to-end pairs (``calls`` in all) run in this many blocks spread over its other timings.
E2E_BLOCKS = 4
# Where the model is launch-bound (issue 23 wants >= 1.3x there): its torch graph replay, device
# only, takes under this many microseconds per layer.
LAUNCH_BOUND_US_PER_LAYER = 8.0
ISSUE36_MIN, ISSUE36_MEDIAN = 0.98, 1.05
CHECK_RTOL = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 6e-2}
METHOD = ("host float32 rows in and out; fusedserve ModelRunner.run vs a torch CUDA graph of the same model "
          "(pinned staging, casts inside the graph), called in pairs whose order flips every pair; median "
          "wall-clock us per call")


def log(*args):
    print(*args, flush=True)


def random_models(n: int, seed: int) -> list[tuple[tuple, tuple[int, ...]]]:
    """``n`` (spec, batches) drawn from ``seed``: widths 64-4096 (in 8-2048, out 8-1024), log-uniform
    multiples of 8, one to four hidden layers, the dtypes in turn; four batches 1-1000 each,
    log-uniform and never a power of two (a power of two is a bucket's own size)."""
    rng = random.Random(seed)

    def width(low, high):
        return max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))) / 8) * 8)

    def batch():
        b = round(math.exp(rng.uniform(0, math.log(1000))))
        while b & (b - 1) == 0:  # 1, 2 and every power of two move up to the next batch that is none
            b += 1
        return b

    drawn = []
    for i in range(n):
        spec = (f"r{seed}_{i}", width(8, 2048), tuple(width(64, 4096) for _ in range(rng.randint(1, 4))),
                width(8, 1024), ("float32", "float16", "bfloat16")[i % 3])
        drawn.append((spec, tuple(sorted({batch() for _ in range(4)}))))
    return drawn


def build(spec):
    """(triton-backend model, torch-backend model) with equal weights, on CUDA."""
    name, fan_in, hidden, out, dtype = spec
    if name == "digits":
        return (load_model(DEFAULT_REPOSITORY / "digits", device="cuda", backend="triton"),
                load_model(DEFAULT_REPOSITORY / "digits", device="cuda", backend="torch"))
    torch.manual_seed(fan_in + len(hidden))
    config = MLPConfig(fan_in, hidden, out, dtype=dtype)
    reference = MLP(config, backend="torch", device="cuda", name=name)
    fused = MLP(config, backend="triton", device="cuda", name=name)
    fused.load_state_dict(reference.state_dict())
    return fused.eval().requires_grad_(False), reference.eval().requires_grad_(False)


class TorchGraphContract:
    """The torch peer of one batch size: pinned staging, casts and model inside one CUDA graph."""

    def __init__(self, model: MLP, batch: int):
        self.host_in = torch.empty(batch, model.config.in_features, pin_memory=True)
        self.host_out = torch.empty(batch, model.config.out_features, pin_memory=True)
        self.static_in = torch.zeros(batch, model.config.in_features, device="cuda")
        side = torch.cuda.Stream()  # warm on a side stream first (cuBLAS picks its kernels)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                model(self.static_in).float()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), gc_paused(), torch.cuda.graph(self.graph):
            self.static_out = model(self.static_in).float()  # [batch, out] float32, the cast inside

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.host_in.copy_(x)
        self.static_in.copy_(self.host_in, non_blocking=True)
        self.graph.replay()
        self.host_out.copy_(self.static_out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return self.host_out.clone()

    def device_us(self) -> float:
        """Microseconds per replay, device only (to tell a launch-bound model)."""
        return device_us(self.graph.replay)


class RunnerAsPeer:
    """The runner's graph for ``batch`` driven as ``TorchGraphContract`` drives its own (the same
    pinned copies, no checks or locks of ``run``): against ``run``, the cost of the runner's host
    path; against the peer, what the graph and its buffers cost."""

    def __init__(self, runner: ModelRunner, batch: int, staging: bool = False):
        self.runner, self.batch = runner, batch
        self.bucket = bucket_of(batch, runner.max_batch_size)
        # The runner's own copies in and out (its Staging) around the same replay: against the
        # peer's sequence, what the staging costs; against ``run``, what the rest of ``run`` does.
        self.staging = runner._staging if staging else None
        if self.staging is None:
            self.host_in = torch.empty(batch, runner.in_features, pin_memory=True)
            self.host_out = torch.empty(batch, runner.out_features, pin_memory=True)
            self.device_in = runner.input_buffer[:batch]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.staging is not None:
            self.staging.copy_in(x, self.batch)
            return self.staging.copy_out(self.runner.compute(self.bucket), self.batch)
        self.host_in.copy_(x)
        self.device_in.copy_(self.host_in, non_blocking=True)
        out = self.runner.compute(self.bucket)
        self.host_out.copy_(out[:self.batch], non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return self.host_out.clone()


def device_us(step, calls: int = 200) -> float:
    """Microseconds per call of ``step`` on the device: CUDA events around ``calls`` back-to-back
    calls (for the runner, ``compute``: what the GPU spends of a contract call, the rest being host
    work and copies)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def layer_kernels(runner: ModelRunner, bucket: int) -> list[str]:
    """Each layer's kernel family and config at ``bucket``, as ``/kernel-stats`` names them."""
    path = runner.path(bucket)
    fields = [runner.layer_fields(path, i, bucket) for i in range(len(runner.model.layers))]
    return [f"{f['kernel']} {f['config']}" for f in fields]


def synchronized(step):
    """``step`` then a wait for the GPU, as one call."""
    def call():
        step()
        torch.cuda.current_stream().synchronize()
    return call


def time_row(runner: ModelRunner, peer: TorchGraphContract, x: torch.Tensor, bucket: int, calls: int) -> dict:
    """Every timing of one row. The end-to-end pairs run in ``E2E_BLOCKS`` blocks spread between the
    other timings, and each side's median block counts: a host-side transient of a few hundred ms
    (one block of ``run`` at 53.7 us, later ones at 42.1, model_contract.jsonl:13) cannot set the ratio."""
    batch = x.shape[0]
    run, call_peer = functools.partial(runner.run, x), functools.partial(peer, x)
    blocks = []

    def e2e_block():
        blocks.append(alternate(run, call_peer, calls // E2E_BLOCKS))

    e2e_block()
    times = dict(torch_graph_device_us=peer.device_us(),
                 fusedserve_device_us=device_us(functools.partial(runner.compute, bucket)))
    e2e_block()
    # One replay and its synchronize alone, alternated: the rest of a call is host work and copies.
    times["fusedserve_replay_us"], times["torch_graph_replay_us"] = alternate(
        synchronized(functools.partial(runner.compute, bucket)), synchronized(peer.graph.replay), calls // 4)
    e2e_block()
    # The runner's host path against the peer's call sequence around the same graph, alternated.
    as_peer = functools.partial(RunnerAsPeer(runner, batch), x)
    run_again_us, times["fusedserve_peer_style_us"] = alternate(run, as_peer, calls // 4)
    times["host_path_extra_us"] = run_again_us - times["fusedserve_peer_style_us"]
    staged_us, peer_style_again_us = alternate(functools.partial(RunnerAsPeer(runner, batch, staging=True), x),
                                               as_peer, calls // 4)
    times["staging_extra_us"] = staged_us - peer_style_again_us
    e2e_block()
    times["order_penalty_us"] = order_penalty(run, calls // 4)
    times["fusedserve_us"] = statistics.median(ours for ours, _ in blocks)
    times["torch_graph_us"] = statistics.median(theirs for _, theirs in blocks)
    times = {name: round(us, 2) for name, us in times.items()}
    times["ratio"] = round(times["torch_graph_us"] / times["fusedserve_us"], 3)
    times["ratio_blocks"] = [round(theirs / ours, 3) for ours, theirs in blocks]
    return times


def measure_model(spec, batches, calls: int, emit, at_ready: bool = False, graph_copies: bool = True) -> None:
    """Every batch of one model: check both against each other, time them, ``emit`` a row each.
    ``at_ready``: on provisional choices, as a server answers before background tuning;
    ``graph_copies``: runners whose graphs copy the rows in and out (off with --staged)."""
    fused, reference = build(spec)
    # provisional=False: the first batch of each bucket tunes it (only the buckets measured here).
    runner = ModelRunner(fused, max_batch_size=max(batches), provisional=at_ready, graph_copies=graph_copies)
    dtype, layers = fused.config.dtype, len(fused.layers)
    for batch in batches:
        peer = TorchGraphContract(reference, batch)
        torch.manual_seed(batch)
        x = 4 * torch.rand(batch, fused.config.in_features)
        got, want = runner.run(x), peer(x)
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        bucket = bucket_of(batch, runner.max_batch_size)
        row = dict(model=spec[0], dtype=dtype, widths=list(fused.config.widths), batch=batch, bucket=bucket,
                   **time_row(runner, peer, x, bucket, calls))
        row.update(launch_bound=row["torch_graph_device_us"] / layers < LAUNCH_BOUND_US_PER_LAYER,
                   graph=runner.graphed(bucket), path=runner.path(bucket),
                   choices=runner.choice_states.get(bucket), kernels=layer_kernels(runner, bucket))
        if not err <= CHECK_RTOL[dtype]:
            row["mismatch"] = f"max relative error {err:.3g} > {CHECK_RTOL[dtype]}"
        emit(row)
        log_row(spec[0], row)
        del peer
    del runner, fused, reference
    torch.cuda.empty_cache()


def log_row(name: str, row: dict) -> None:
    log(f"  {name:22s} batch {row['batch']:4d}: fusedserve {row['fusedserve_us']:8.1f} us, torch graph "
        f"{row['torch_graph_us']:8.1f} us ({row['ratio']:.2f}x; blocks {row['ratio_blocks']}); device "
        f"{row['fusedserve_device_us']:.1f} vs {row['torch_graph_device_us']:.1f} us, replay+sync "
        f"{row['fusedserve_replay_us']:.1f} vs {row['torch_graph_replay_us']:.1f} us, ours called as the peer "
        f"{row['fusedserve_peer_style_us']:.1f} us (run() {row['host_path_extra_us']:+.1f} us, its staging "
        f"{row['staging_extra_us']:+.1f} us), "
        f"first of a fixed pair {row['order_penalty_us']:+.1f} us"
        f"{'' if row['graph'] else ', EAGER'}{' MISMATCH ' + row['mismatch'] if 'mismatch' in row else ''}")
    log(f"    {' | '.join(row['kernels'])}")


def summary(rows) -> dict:
    """Issue 23's targets: ratio >= 1.0 at every row, >= 1.3 at launch-bound rows; issue 36's
    (``issue36_met``): min >= 0.98, median >= 1.05."""
    misses = [r for r in rows if r["ratio"] < (1.3 if r["launch_bound"] else 1.0)]
    ratios = [r["ratio"] for r in rows]
    median = statistics.median(ratios) if ratios else None
    return dict(rows=len(rows), min_ratio=min(ratios, default=None), median_ratio=median,
                met=not misses and bool(rows),
                issue36_met=bool(rows) and min(ratios) >= ISSUE36_MIN and median >= ISSUE36_MEDIAN,
                misses=[f"{r['model']} batch={r['batch']}: {r['ratio']:.2f}x (want "
                        f"{1.3 if r['launch_bound'] else 1.0}x)" for r in misses])


def plot(rows, path, gpu):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["model"] for r in rows):
        points = sorted((r["batch"], r["ratio"]) for r in rows if r["model"] == name)
        ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.axhline(1.0, color="k", ls="--")
    ax.set(xscale="log", xlabel="batch (rows)", ylabel="torch graph us / fusedserve us",
           title=f"{gpu}: host rows in and out (higher is better for fusedserve)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: Path, quick: bool, budget_s: float, note: str | None = None, png: Path | None = None,
        random_n: int | None = None, seed: int = 0, at_ready: bool = False, graph_copies: bool = True) -> dict:
    # Read when the first bucket tunes.
    os.environ.setdefault(tune_cache.ENV_VAR, tempfile.mkdtemp(prefix="fusedserve-tune-"))
    gpu = torch.cuda.get_device_name()
    line = runs.Run("model_contract", out, gpu=gpu, quick=quick, note=note, torch=torch.__version__,
                    triton=__import__("triton").__version__, method=METHOD, seed=seed if random_n else None,
                    random=dict(n=random_n, seed=seed) if random_n else None, at_ready=at_ready,
                    graph_copies=graph_copies,
                    search=None if at_ready else choosing.search())
    plan = random_models(random_n, seed) if random_n else [(spec, QUICK_BATCHES if quick else BATCHES)
                                                            for spec in MODELS]
    rows, skipped = [], []

    def emit(row):
        rows.append(row)
        line.save(rows, summary(rows), complete=False, skipped=skipped)

    started = time.perf_counter()
    for spec, batches in plan:
        if time.perf_counter() - started > budget_s:
            skipped.append(spec[0])
            log(f"budget of {budget_s:.0f} s spent: {spec[0]} not measured")
            continue
        measure_model(spec, batches, QUICK_CALLS if quick else CALLS, emit, at_ready, graph_copies)
    data = line.save(rows, summary(rows), complete=not skipped, skipped=skipped)
    if png:
        plot(rows, png, gpu)
    s = data["summary"]
    log(f"\nserving contract: min {s['min_ratio']}x, median {s['median_ratio']}x over {s['rows']} rows: "
        + ("MET" if s["met"] else f"{len(s['misses'])} MISSED"))
    for miss in s["misses"]:
        log(f"  {miss}")
    log(f"appended the run to {line.path} in {time.perf_counter() - started:.0f} s")
    return data


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs.arguments(parser)
    parser.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, {QUICK_CALLS} calls each")
    parser.add_argument("--budget-s", type=float, default=500, help="start no new model after this many seconds")
    parser.add_argument("--random", type=int, metavar="N", help="N models of random widths, depths and dtypes "
                        "(random_models) instead of the fixed list")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random's models and batches")
    parser.add_argument("--at-ready", action="store_true", help="provisional choices, nothing tuned (a server "
                        "before background tuning)")
    parser.add_argument("--staged", action="store_true", help="runners that copy the rows in and out around "
                        "their graphs (ModelRunner's graph_copies off)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/model_contract.py needs a CUDA GPU")
    run(args.out, args.quick, args.budget_s, args.note, args.plot, args.random, args.seed, args.at_ready,
        not args.staged)


if __name__ == "__main__":
    main()
