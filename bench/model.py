"""Benchmark whole models: fusedserve's runner against torch eager, a torch CUDA graph and
torch.compile(mode="reduce-overhead"), per model and batch size.

Run on a CUDA GPU from the repository root:

    python bench/model.py [--out bench/results] [--quick]

Writes ``OUT/model_h200.json`` ({"gpu", "date", "rows": [{"model", "batch", "impl", "median_us"}],
plus the torch/triton versions and the method}) and ``OUT/model_h200.png`` (latency per batch,
one panel per model), and prints a table and the targets of issue 4.

Models: ``digits`` (the shipped 64-256-256-10 ReLU MLP, float32), ``mlp4x1024`` and ``mlp4x4096``
(4 linear layers of that width, ReLU between them, bfloat16, random weights). Every impl computes
the same function, input normalization included, on an input already on the GPU; copies to and
from the host are left out for everyone. fusedserve is ``ModelRunner.compute``: the runner's
CUDA-graph replay of its kernels (the one-launch fused MLP kernel where the model is narrow).

Method: each impl is checked once against torch eager, warmed, then timed with CUDA events around
back-to-back calls (so launch overhead counts, as it does in serving); the reported time is the
median over repeats of (elapsed / calls). Weights stay wherever the previous call left them (the
digits weights fit in L2; the mlp4x4096 weights, 128 MiB, do not).
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from models import DEFAULT_REPOSITORY, MLP, MLPConfig, ModelRunner, load_model

BATCHES = (1, 8, 64, 512, 4096)
IMPLS = ("fusedserve", "torch_eager", "torch_cuda_graph", "torch_compile")
TORCH_IMPLS = IMPLS[1:]
# torch.compile takes tens of seconds per shape: --quick compiles these batches only, within a budget.
QUICK_COMPILE_BATCHES = (1, 64)
QUICK_COMPILE_BUDGET_S = 60
# Each timed repeat runs back-to-back calls for about this long.
REPEAT_TARGET_US = 2000
# Largest |fusedserve - torch eager| allowed, relative to the largest |torch eager| output: a few
# roundings of the dtype through 3-4 layers (TF32 is off, so float32 is ieee on both sides).
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def log(*args):
    print(*args, flush=True)


def target(model: str, batch: int) -> float:
    """Required speed-up of fusedserve over the best torch impl (issue 4)."""
    small = {"digits": True, "mlp4x1024": batch <= 64, "mlp4x4096": batch <= 16}[model]
    return 1.5 if small else 1.0


def build_models() -> dict[str, tuple[MLP, MLP]]:
    """``{name: (triton-backend model, torch-backend model)}`` with equal weights, on CUDA."""
    pairs = {"digits": (load_model(DEFAULT_REPOSITORY / "digits", device="cuda", backend="triton"),
                        load_model(DEFAULT_REPOSITORY / "digits", device="cuda", backend="torch"))}
    for width in (1024, 4096):
        torch.manual_seed(width)
        config = MLPConfig(width, (width, width, width), width, dtype="bfloat16")
        reference = MLP(config, backend="torch", device="cuda", name=f"mlp4x{width}")
        fused = MLP(config, backend="triton", device="cuda", name=f"mlp4x{width}")
        fused.load_state_dict(reference.state_dict())
        pairs[reference.name] = (fused.eval().requires_grad_(False), reference.eval().requires_grad_(False))
    return pairs


def time_calls(step, repeats: int) -> float:
    """Median microseconds per call of ``step`` over repeats of back-to-back calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        step()
    end.record()
    end.synchronize()
    estimate_us = max(start.elapsed_time(end) * 1e3 / 3, 1.0)
    calls = int(min(200, max(5, REPEAT_TARGET_US / estimate_us)))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def fusedserve_step(model: MLP, x: torch.Tensor):
    runner = ModelRunner(model, max_batch_size=x.shape[0])
    runner.input_buffer.copy_(x)
    batch = x.shape[0]
    log(f"    fusedserve: fused={runner.fused}, graphs={runner.cuda_graphs}")
    return lambda: runner.compute(batch)


def graph_step(model: MLP, x: torch.Tensor):
    # Warm on a side stream first (cuBLAS picks its kernels), as torch's graph docs do.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(x)
    return lambda: (graph.replay(), out)[1]


def compile_step(model: MLP, x: torch.Tensor):
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

    def step():
        # Each call is a new step of cudagraph trees: earlier outputs may be overwritten.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    start = time.perf_counter()
    for _ in range(3):  # compile, then record the graph
        step()
    torch.cuda.synchronize()
    log(f"    torch_compile: compiled and recorded in {time.perf_counter() - start:.1f} s")
    return step


def check(name, batch, impl, got, want, problems):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() or 1.0
    limit = CHECK_RTOL[want.dtype]
    if not err <= limit * scale:  # also catches NaN
        problems.append(f"{name} batch={batch} {impl}: max |err| {err:.3g} > {limit} * {scale:.3g}")
        log(f"    MISMATCH {problems[-1]}")


def bench(pairs, quick, repeats):
    rows, problems, compile_spent = [], [], 0.0
    for name, (fused_model, torch_model) in pairs.items():
        torch._dynamo.reset()  # each model compiles afresh, within dynamo's recompile limits
        for batch in BATCHES:
            log(f"{name} batch={batch}")
            torch.manual_seed(batch)
            x = 4 * torch.rand(batch, fused_model.config.in_features, device="cuda")
            with torch.no_grad():
                want = torch_model(x)
                steps = {"fusedserve": fusedserve_step(fused_model, x),
                         "torch_eager": lambda model=torch_model, x=x: model(x),
                         "torch_cuda_graph": graph_step(torch_model, x)}
                compile_wanted = not quick or batch in QUICK_COMPILE_BATCHES
                if compile_wanted and (not quick or compile_spent < QUICK_COMPILE_BUDGET_S):
                    start = time.perf_counter()
                    steps["torch_compile"] = compile_step(torch_model, x)
                    compile_spent += time.perf_counter() - start
                else:
                    log("    torch_compile: skipped (--quick)")
                for impl, step in steps.items():
                    check(name, batch, impl, step(), want, problems)
                    us = time_calls(step, repeats)
                    rows.append({"model": name, "batch": batch, "impl": impl, "median_us": round(us, 2)})
                    log(f"    {impl:17s} {us:10.1f} us")
            del steps
            torch.cuda.empty_cache()
    return rows, problems


def speedups(rows):
    """``{(model, batch): (fusedserve us, best torch impl, its us)}``."""
    table = {}
    for r in rows:
        table.setdefault((r["model"], r["batch"]), {})[r["impl"]] = r["median_us"]
    out = {}
    for key, impls in table.items():
        torch_impls = {k: v for k, v in impls.items() if k in TORCH_IMPLS}
        if "fusedserve" in impls and torch_impls:
            best = min(torch_impls, key=torch_impls.get)
            out[key] = (impls["fusedserve"], best, torch_impls[best])
    return out


def print_summary(rows):
    log(f"\n{'model':10s} {'batch':>5s} " + " ".join(f"{i:>17s}" for i in IMPLS) + "   speed-up  target")
    cells = {(r["model"], r["batch"], r["impl"]): r["median_us"] for r in rows}
    misses = []
    for (model, batch), (ours, best, theirs) in speedups(rows).items():
        times = " ".join(f"{cells.get((model, batch, i), float('nan')):17.1f}" for i in IMPLS)
        ratio, want = theirs / ours, target(model, batch)
        verdict = "ok" if ratio >= want else "MISSED"
        if ratio < want:
            misses.append(f"{model} batch={batch}: {ratio:.2f}x vs best torch ({best}), target {want}x")
        log(f"{model:10s} {batch:5d} {times}   {ratio:6.2f}x   {want}x {verdict}")
    log("\ntargets: " + ("all met" if not misses else f"{len(misses)} missed"))
    for miss in misses:
        log(f"  {miss}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for impl in IMPLS:
            points = sorted((r["batch"], r["median_us"]) for r in rows if r["model"] == name and r["impl"] == impl)
            if points:
                ax.plot(*zip(*points), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="median us per batch", title=name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"Model latency on {torch.cuda.get_device_name()} (GPU-resident input, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer repeats; torch.compile only at batches {QUICK_COMPILE_BATCHES}")
    parser.add_argument("--tag", default="h200", help="file name suffix: model_<tag>.json/.png")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/model.py needs a CUDA GPU")
    repeats = 5 if args.quick else 15
    started = time.perf_counter()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows, problems = bench(build_models(), args.quick, repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "method": "CUDA events around back-to-back calls on a GPU-resident input; median over "
                  f"{repeats} repeats of elapsed/calls; host copies excluded for every impl",
        "rows": rows,
    }
    json_path = args.out / f"model_{args.tag}.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out / f"model_{args.tag}.png")
    print_summary(rows)
    log(f"\nwrote {json_path} and its .png in {time.perf_counter() - started:.0f} s")
    if problems:
        raise SystemExit("results differ from torch eager:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    main()
