"""Benchmark whole models: fusedserve's runner against torch eager, a torch CUDA graph,
torch.compile(mode="reduce-overhead") and torch.compile's kernels (max-autotune) in a plain CUDA graph,
per model and batch size; plus the cost of live timings.

Run on a CUDA GPU from the repository root:

    python bench/model.py [--quick] [--plot model.png]
    python bench/model.py --replot bench/results/model.jsonl:3 --plot model.png   # any machine
    python bench/model.py --contract [--quick] [--budget-s 500]   # the serving contract instead

``--contract`` times what the service calls, host rows in and out, against a torch CUDA graph with
pinned staging (``bench/model_contract.py``, ``OUT/model_contract.jsonl``); the rest of this file
measures the device-only side, the input already on the GPU.

Appends the run to ``OUT/model.jsonl`` (``bench/runs.py``; OUT defaults to bench/results): rows
[{"model", "batch", "impl", "median_us", ...}], "summary" (issue 4's targets missed), "failures",
"timing_overhead", the torch/triton versions and the method; rewritten after every row, with
"complete": false until the end. ``--plot PNG`` draws latency per batch, one panel per model.
Prints a table and the targets of issue 4.

Models: ``digits`` (the shipped 64-256-256-10 ReLU MLP, float32), ``mlp4x1024`` and ``mlp4x4096``
(4 linear layers of that width, ReLU between them, bfloat16, random weights). Every impl computes
the same function, input normalization included, on an input already on the GPU; copies to and
from the host are left out for everyone. fusedserve is ``ModelRunner.compute``: one CUDA-graph
replay of the path the runner chose for that bucket at warm-up (the row says which, and what
each path measured then).

Method: the measurements run in child processes (``--worker``), one item (model, batch, impl) at
a time: build, synchronize, check once against torch eager, time, release. A crash (a CUDA error
poisons its process) loses one item: the parent records it under "failures" and starts a new
child for the rest. torch.compile runs last, each mode in children of its own, so its CUDA-graph
trees never share a process with the other graphs. ``torch_compile_graph`` captures the kernels
torch.compile (max-autotune, no cudagraph trees) generates in one plain CUDA graph, the way
``torch_cuda_graph`` captures eager torch: the best of both. Timing: CUDA events around back-to-back
calls (launch overhead counts, as in serving); the median over repeats of elapsed / calls. Weights
stay wherever the previous call left them (the digits weights fit in L2; the mlp4x4096 ones, 128 MiB,
do not).

Timing overhead: ``ModelRunner.run`` (host copies included, as the service calls it) on digits at
batch 8, one runner with its timing sink set for every other call, ``OVERHEAD_CALLS`` each way;
issue 4 wants the difference of the means under 2% (here: with two standard errors of the paired
difference added). The calls with a sink are split into the timed ones and the rest, so the report
says how much each part costs.
"""

import argparse
import gc
import json
import math
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs
from fusedserve.kernels.device import gc_paused
from fusedserve.kernels.precision import dot_precision
from fusedserve.models import DEFAULT_REPOSITORY, MLP, MLPConfig, ModelRunner, load_model

MODELS = ("digits", "mlp4x1024", "mlp4x4096")
BATCHES = (1, 8, 64, 512, 4096)
IMPLS = ("fusedserve", "torch_eager", "torch_cuda_graph", "torch_compile", "torch_compile_graph")
TORCH_IMPLS = IMPLS[1:]
OVERHEAD = ("digits", 8, "timing_overhead")  # the item that measures the cost of live timings
OVERHEAD_CALLS = 50_000  # each way: ~6 s on the H200 host, for a standard error near 0.2%
# torch.compile takes tens of seconds per shape: --quick compiles these (model, batch) only.
QUICK_COMPILE = (("digits", 1), ("mlp4x1024", 64))
# Each timed repeat runs back-to-back calls for about this long.
REPEAT_TARGET_US = 2000
# Largest |impl - torch eager| allowed, relative to the largest |torch eager| output: a few
# roundings of the dtype through 3-4 layers (TF32 is off, so float32 is ieee on both sides).
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
# A child that prints nothing for this long is stopped (a hang); the parent carries on without
# that item's group. Tuning one bucket of mlp4x4096 takes tens of seconds, a compile up to a minute.
SILENCE_TIMEOUT_S = 240


def log(*args):
    print(*args, flush=True)


def target(model: str, batch: int) -> float:
    """Required speed-up of fusedserve over the best torch impl (issue 4)."""
    small = {"digits": True, "mlp4x1024": batch <= 64, "mlp4x4096": batch <= 16}[model]
    return 1.5 if small else 1.0


# -- the child process: one model pair, one item at a time ------------------------------------

def build_pair(name: str) -> tuple[MLP, MLP]:
    """(triton-backend model, torch-backend model) with equal weights, on CUDA."""
    if name == "digits":
        return (load_model(DEFAULT_REPOSITORY / "digits", device="cuda", backend="triton"),
                load_model(DEFAULT_REPOSITORY / "digits", device="cuda", backend="torch"))
    width = int(name.removeprefix("mlp4x"))
    torch.manual_seed(width)
    config = MLPConfig(width, (width, width, width), width, dtype="bfloat16")
    reference = MLP(config, backend="torch", device="cuda", name=name)
    fused = MLP(config, backend="triton", device="cuda", name=name)
    fused.load_state_dict(reference.state_dict())
    return fused.eval().requires_grad_(False), reference.eval().requires_grad_(False)


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


def fusedserve_step(model: MLP, x: torch.Tensor, info: dict):
    batch = x.shape[0]
    runner = ModelRunner(model, max_batch_size=batch, provisional=False)  # tuned, as served once tuning is done
    runner.input_buffer.copy_(x)
    runner.compute(batch)  # warms this bucket: tuning, capture, the timed path choice
    info.update(path=runner.path(batch), graphs=runner.cuda_graphs,
                path_us={p: round(s * 1e6, 2) for p, s in runner.path_seconds.get(batch, {}).items()})
    if model.config.dtype == "float32" and runner.backend == "triton":
        info["fp32_precision"] = dot_precision(torch.float32)  # how float32 layers ran their dots
    # Which kernel and config ran each layer (as /kernel-stats names them).
    info["layers"] = [f"{t['kernel']}[{t['config']}]" for t in
                      (runner.layer_fields(runner.path(batch), i, batch) for i in range(len(model.layers)))]
    log(f"    fusedserve: path={info['path']} graphs={runner.cuda_graphs} measured={info['path_us']}")
    log(f"    fusedserve layers: {info['layers']}")
    return lambda: runner.compute(batch)


def graph_step(model: MLP, x: torch.Tensor, info: dict):
    # Warm on a side stream first (cuBLAS picks its kernels), as torch's graph docs do.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out = model(x)
    return lambda: (graph.replay(), out)[1]


def compile_step(model: MLP, x: torch.Tensor, info: dict):
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

    def step():
        # Each call is a new step of cudagraph trees: earlier outputs may be overwritten.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    start = time.perf_counter()
    for _ in range(3):  # compile, then record the graph
        step()
    torch.cuda.synchronize()
    info["compile_s"] = round(time.perf_counter() - start, 1)
    log(f"    torch_compile: compiled and recorded in {info['compile_s']} s")
    return step


def compile_graph_step(model: MLP, x: torch.Tensor, info: dict):
    """torch.compile's kernels (max-autotune, without its cudagraph trees) captured in one plain CUDA
    graph: what compiling buys, without the trees' per-call bookkeeping (reduce-overhead read slower
    than eager torch in bench/results/model.jsonl:2; docs/kernels.md)."""
    compiled = torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False)
    start = time.perf_counter()
    compiled(x)
    torch.cuda.synchronize()
    info["compile_s"] = round(time.perf_counter() - start, 1)
    log(f"    torch_compile_graph: compiled in {info['compile_s']} s")
    return graph_step(compiled, x, info)


def eager_step(model: MLP, x: torch.Tensor, info: dict):
    return lambda: model(x)


BUILDERS = {"fusedserve": fusedserve_step, "torch_eager": eager_step,
            "torch_cuda_graph": graph_step, "torch_compile": compile_step, "torch_compile_graph": compile_graph_step}


def check(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` matches torch eager's ``want``, else what differs."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() or 1.0
    limit = CHECK_RTOL[want.dtype]
    if not err <= limit * scale:  # also catches NaN
        return f"max |err| {err:.3g} > {limit} * {scale:.3g}"
    return None


class CountingSink:
    """What a stats object does per timing at the least: take a lock, keep the record."""

    def __init__(self):
        self.lock = threading.Lock()
        self.timings = []

    def record_layer(self, timing):
        with self.lock:
            self.timings.append(timing)


def timing_overhead(model: MLP, batch: int, calls: int) -> dict:
    """``ModelRunner.run`` per batch with and without a timing sink, interleaved call by call.

    One runner whose sink is set for every other call: two runners would each choose their own
    path per bucket at warm-up (where the two paths are close, digits at batch 8, the choice alone
    moves ``run()`` by more than the 2% this measures), and rounds of many calls each were at the
    mercy of the host's drift between rounds (0.2% to 8% in four runs). Interleaved, both halves see
    the same host; the overhead is the difference of their means (throughput is calls over total
    time, so the mean is what counts, timed batches and jitter included), and its standard error is
    that of the mean difference within pairs (call 2i without, 2i + 1 with), so drift that both calls
    of a pair share cancels. The calls with a sink are split into those that were timed (the sink
    got their layers) and those that were not, to say where the overhead comes from."""
    sink = CountingSink()
    runner = ModelRunner(model, max_batch_size=batch, timing_sink=sink, provisional=False)
    x = torch.rand(batch, model.config.in_features) * 16
    for _ in range(200):  # warms this bucket (the first batch is timed), then settles
        runner.run(x)
    runner.flush_timings()
    sink.timings.clear()  # count only the interleaved calls' timings
    off, on, timed_on = [], [], []
    for i in range(2 * calls):
        runner.timing_sink = sink if i % 2 else None
        before = len(sink.timings)
        start = time.perf_counter()
        runner.run(x)
        us = (time.perf_counter() - start) * 1e6
        (on if i % 2 else off).append(us)
        if i % 2:
            timed_on.append(len(sink.timings) > before)
    mean_off, mean_on = statistics.fmean(off), statistics.fmean(on)
    stderr = statistics.stdev([b - a for a, b in zip(off, on, strict=True)]) / math.sqrt(calls)
    runner.timing_sink = sink
    runner.flush_timings()
    untimed = [us for us, t in zip(on, timed_on, strict=True) if not t]
    timed = [us for us, t in zip(on, timed_on, strict=True) if t]
    layers = len(model.layers)
    pct = 100 / mean_off
    result = {"model": model.name, "batch": batch, "path": runner.path(runner.buckets[-1]),
              "method": "interleaved calls, mean difference within pairs",
              "run_us_sink_off": round(mean_off, 2), "run_us_sink_on": round(mean_on, 2),
              "run_us_median_off": round(statistics.median(off), 2),
              "run_us_median_on": round(statistics.median(on), 2),
              "overhead_pct": round((mean_on - mean_off) * pct, 2),
              "overhead_stderr_pct": round(stderr * pct, 2),
              "calls_each": calls, "timed_batches": len(timed),
              # where it comes from: the calls that were timed, and the others' sampling check
              "timed_batch_us": round(statistics.fmean(timed), 2) if timed else None,
              "overhead_timed_pct": round((sum(timed) - len(timed) * mean_off) / calls * pct, 2),
              "overhead_untimed_pct": round((sum(untimed) - len(untimed) * mean_off) / calls * pct, 2)}
    log(f"    timing overhead ({result['path']} path): run() {mean_off:.1f} us without a sink, {mean_on:.1f} us "
        f"with one ({result['overhead_pct']:+.2f}% +- {result['overhead_stderr_pct']:.2f}); {len(timed)} timed "
        f"batches ({layers} layers each, {result['timed_batch_us']} us each) make "
        f"{result['overhead_timed_pct']:+.2f}%, the untimed calls {result['overhead_untimed_pct']:+.2f}%")
    return result


def worker(items: list[tuple[str, int, str]], repeats: int) -> None:
    """Measure ``items`` in order; report each as a line ``ROW {json}`` (or ``OVERHEAD {json}``)."""
    pairs, inputs = {}, {}
    for name, batch, impl in items:
        log(f"ITEM {name} {batch} {impl}")
        if name not in pairs:
            pairs[name] = build_pair(name)
            torch._dynamo.reset()  # each model compiles afresh, within dynamo's recompile limits
        fused_model, torch_model = pairs[name]
        if impl == "timing_overhead":
            log("OVERHEAD " + json.dumps(timing_overhead(fused_model, batch, calls=OVERHEAD_CALLS)))
            continue
        if (name, batch) not in inputs:
            torch.manual_seed(batch)
            x = 4 * torch.rand(batch, fused_model.config.in_features, device="cuda")
            with torch.no_grad():
                inputs[(name, batch)] = (x, torch_model(x))
        x, want = inputs[(name, batch)]
        info = {}
        with torch.no_grad():
            step = BUILDERS[impl](fused_model if impl == "fusedserve" else torch_model, x, info)
            torch.cuda.synchronize()  # a build that broke the device fails here, named
            problem = check(step(), want)
            us = time_calls(step, repeats)
        row = {"model": name, "batch": batch, "impl": impl, "median_us": round(us, 2), **info}
        if problem:
            row["mismatch"] = problem
            log(f"    MISMATCH {name} batch={batch} {impl}: {problem}")
        log(f"    {impl:17s} {us:10.1f} us")
        log("ROW " + json.dumps(row))
        del step
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- the parent: children, results file, summary ---------------------------------------------

class Results:
    """The run's line (``bench/runs.py``), rewritten after every row so a later crash or kill keeps
    what was measured."""

    def __init__(self, out: Path, repeats: int, quick: bool, note: str | None):
        self.data = {"rows": [], "failures": [], "timing_overhead": []}
        self.complete = False
        self.run = runs.Run(
            "model", out, gpu=torch.cuda.get_device_name(), quick=quick, note=note, torch=torch.__version__,
            triton=__import__("triton").__version__,
            method="CUDA events around back-to-back calls on a GPU-resident input; median over "
                   f"{repeats} repeats of elapsed/calls; host copies excluded for every impl; "
                   "each (model, batch, impl) built, checked and timed alone in a child process")

    def add(self, key: str, value: dict) -> None:
        self.data[key].append(value)
        self.write()

    def write(self) -> None:
        self.run.save(self.data["rows"], summary(self.data), complete=self.complete,
                      failures=self.data["failures"], timing_overhead=self.data["timing_overhead"])


def _pump(stream, lines: queue.Queue) -> None:
    """Copy a child's output lines into ``lines``, then None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def child_command(items, repeats: int) -> list[str]:
    spec = ",".join(f"{n}:{b}:{i}" for n, b, i in items)
    return [sys.executable, str(Path(__file__).resolve()), "--worker", spec, "--repeats", str(repeats)]


def run_children(items, repeats: int, results: Results) -> None:
    """Measure ``items`` in child processes, restarting after a crash without the item that crashed."""
    remaining = list(items)
    while remaining:
        proc = subprocess.Popen(child_command(remaining, repeats), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        current, tail = None, []
        while True:
            try:
                line = lines.get(timeout=SILENCE_TIMEOUT_S)
            except queue.Empty:
                log(f"  child {proc.pid} printed nothing for {SILENCE_TIMEOUT_S} s: stopping it")
                proc.kill()
                tail.append(f"killed after {SILENCE_TIMEOUT_S} s of silence")
                break
            if line is None:
                break
            line = line.rstrip("\n")
            tail = (tail + [line])[-30:]
            if line.startswith("ITEM "):
                name, batch, impl = line.split()[1:]
                current = (name, int(batch), impl)
            elif line.startswith("ROW "):
                results.add("rows", json.loads(line[4:]))
            elif line.startswith("OVERHEAD "):
                results.add("timing_overhead", json.loads(line[9:]))
            log(line)
            if line.startswith(("ROW ", "OVERHEAD ")):
                remaining.remove(current)
                current = None
        rc = proc.wait()
        if not remaining:
            return
        failed = current if current is not None else remaining[0]
        log(f"  FAILED {failed} (child exit code {rc}); {len(remaining) - 1} items left")
        results.add("failures", {"model": failed[0], "batch": failed[1], "impl": failed[2],
                                 "exit_code": rc, "log_tail": tail[-12:]})
        remaining.remove(failed)
        if tail and tail[-1].startswith("killed"):  # a hang would hang again: skip the rest of this group
            for name, batch, impl in remaining:
                results.add("failures", {"model": name, "batch": batch, "impl": impl, "exit_code": None,
                                         "log_tail": ["not run: an earlier item of its group hung"]})
            return


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


def _overhead_met(o: dict) -> bool:
    """Met only when the difference plus two standard errors stays under 2%."""
    return o["overhead_pct"] + 2 * o.get("overhead_stderr_pct", 0.0) < 2


def summary(data) -> dict:
    """Issue 4's targets: the (model, batch) where fusedserve misses its speed-up over the best torch
    impl, and whether the cost of live timings stays under 2%."""
    misses = [f"{model} batch={batch}: {theirs / ours:.2f}x vs best torch ({best}), target {target(model, batch)}x"
              for (model, batch), (ours, best, theirs) in speedups(data["rows"]).items()
              if theirs / ours < target(model, batch)]
    overhead = [_overhead_met(o) for o in data["timing_overhead"]]
    return {"misses": misses, "met": not misses and all(overhead), "timing_overhead_met": overhead}


def print_summary(data):
    rows = data["rows"]
    log(f"\n{'model':10s} {'batch':>5s} " + " ".join(f"{i:>17s}" for i in IMPLS) + "  path     speed-up  target")
    cells = {(r["model"], r["batch"], r["impl"]): r for r in rows}
    ordered = sorted(speedups(rows).items(), key=lambda kv: (MODELS.index(kv[0][0]), kv[0][1]))
    for (model, batch), (ours, _best, theirs) in ordered:
        medians = [cells[(model, batch, i)]["median_us"] if (model, batch, i) in cells else float("nan")
                   for i in IMPLS]
        times = " ".join(f"{us:17.1f}" for us in medians)
        ratio, want = theirs / ours, target(model, batch)
        path = cells[(model, batch, "fusedserve")].get("path", "?")
        log(f"{model:10s} {batch:5d} {times}  {path:7s} {ratio:6.2f}x   {want}x {'ok' if ratio >= want else 'MISSED'}")
    misses = summary(data)["misses"]
    log("\ntargets: " + ("all met" if not misses else f"{len(misses)} missed"))
    for miss in misses:
        log(f"  {miss}")
    for o in data["timing_overhead"]:
        verdict = "ok" if _overhead_met(o) else "NOT shown under the 2% target"
        log(f"timing overhead ({o['model']} batch={o['batch']}, run() incl. host copies): "
            f"{o['overhead_pct']:+.2f}% +- {o.get('overhead_stderr_pct', 0.0):.2f} {verdict}")
    for f in data["failures"]:
        log(f"FAILED {f['model']} batch={f['batch']} {f['impl']}: exit {f['exit_code']}; last lines:")
        for line in f["log_tail"][-5:]:
            log(f"    {line}")


def plot(rows, path, gpu):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m in MODELS if any(r["model"] == m for r in rows)]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for impl in IMPLS:
            points = sorted((r["batch"], r["median_us"]) for r in rows if r["model"] == name and r["impl"] == impl)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="median us per batch", title=name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"Model latency on {gpu} (GPU-resident input, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs.arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer repeats; torch.compile only at {QUICK_COMPILE}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    parser.add_argument("--contract", action="store_true",
                        help="time the serving contract instead (host rows in and out; bench/model_contract.py)")
    parser.add_argument("--budget-s", type=float, default=500, help="--contract: start no new model after this")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # child mode: model:batch:impl,...
    parser.add_argument("--repeats", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--replot", metavar="RUN",
                        help="only draw --plot from a stored run, FILE.jsonl:LINE of model.jsonl or "
                             "model_contract.jsonl (no GPU needed)")
    args = parser.parse_args()
    if args.replot:
        data = runs.pick(args.replot)
        if data.get("benchmark") == "model_contract":
            from bench.model_contract import plot as contract_plot

            return contract_plot(data["rows"], args.plot or Path("model_contract.png"), data["gpu"])
        return plot(data["rows"], args.plot or Path("model.png"), data["gpu"])
    if not torch.cuda.is_available():
        raise SystemExit("bench/model.py needs a CUDA GPU")
    if args.contract:
        from bench.model_contract import run

        run(args.out, args.quick, args.budget_s, args.note, args.plot)
        return
    if args.worker:
        items = [(n, int(b), i) for n, b, i in (s.split(":") for s in args.worker.split(","))]
        worker(items, args.repeats)
        return
    models = args.models.split(",")
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models must name some of {MODELS}, got {args.models!r}")
    repeats = 5 if args.quick else 15
    started = time.perf_counter()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = Results(args.out, repeats, args.quick, args.note)
    ours = [(m, b, i) for m in models for b in BATCHES for i in IMPLS[:3]]
    if OVERHEAD[0] in models:
        ours.insert((models.index(OVERHEAD[0]) + 1) * len(BATCHES) * 3, OVERHEAD)  # after its model's rows
    # Each torch.compile mode in children of its own: cudagraph trees never share a process with other graphs.
    compiled = [[(m, b, impl) for m in models for b in BATCHES if not args.quick or (m, b) in QUICK_COMPILE]
                for impl in ("torch_compile", "torch_compile_graph")]
    for group in (ours, *compiled):
        run_children(group, repeats, results)
    results.complete = True
    results.write()
    if args.plot:
        plot(results.data["rows"], args.plot, results.run.head["gpu"])
    print_summary(results.data)
    log(f"\nappended the run to {results.run.path} in {time.perf_counter() - started:.0f} s")
    problems = [f"{r['model']} batch={r['batch']} {r['impl']}: {r['mismatch']}"
                for r in results.data["rows"] if "mismatch" in r]
    if problems or results.data["failures"]:
        raise SystemExit("results differ from torch eager or items failed:\n  " + "\n  ".join(
            problems + [f"{f['model']} batch={f['batch']} {f['impl']} crashed" for f in results.data["failures"]]))


if __name__ == "__main__":
    main()
