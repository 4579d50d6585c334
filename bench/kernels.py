"""Benchmark fusedserve's fused linear kernels against torch's ways to compute relu(x @ W^T + b).

Run on a CUDA GPU from the repository root:

    python bench/kernels.py [--quick] [--ms 1,4,16 --dtypes float16,bfloat16] [--plot kernels.png]
    python bench/kernels.py --random 40 --seed 1 --budget-s 540   # shapes drawn at random
    python bench/kernels.py --merge bench/results/kernels.jsonl:12 ...   # no GPU: runs merged (merge_runs)

Appends the run to ``OUT/kernels.jsonl`` (``bench/runs.py``; OUT defaults to bench/results): rows
[{"M", "N", "K", "dtype", "impl", "median_us", "tflops", "tbps", ...}], "summary", and "torch",
"triton", "copy_tbps", "matmul_tflops", "complete", "truncated"; the line is rewritten after every
shape with "complete": false, so a killed run keeps its rows. ``--plot PNG`` draws the achieved TFLOP/s
and TB/s against the copy bandwidth and the matmul peak, both measured in the same run. Prints a
table plus the targets of issue 3. Every run also times ``fusedserve_provisional`` (the choice a
cold server starts on, before tuning); "summary" holds ours against the better peer and provisional
against tuned (issue 23). ``--random N --seed S`` times N shapes drawn from S
(``bench/kernel_random.py``) instead of the grid, and ``--plot`` adds the ratios (``..._ratios.png``);
where the full search kept the vendor's GEMM, it also times ``fusedserve_own``, our fastest family
alone, so a run shows how far behind ours were there (summary ``own_vs_vendor_won``).

Method: every impl is first checked once against an fp32/fp64 reference, then timed as CUDA-graph
replays of many calls that cycle over enough (x, W, b) sets that each call finds its weights out of
L2 (cold L2, as in serving, where other layers run in between). The reported time is the median
over repeats of (replay time / calls), so Python launch cost is not counted for anyone. The impls
of one shape are replayed in interleaved rounds (one replay of each per round), so a drift of the
GPU's clocks during the shape is shared by all of them rather than charged to whichever ran last.
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402
from bench.kernel_random import (  # noqa: E402
    OWN,
    RANDOM_DTYPES,
    VENDOR,
    describe_own,
    describe_provisional,
    draw_shapes,
    own_linear,
    peer_summary,
    plot_ratios,
    print_summaries,
    provisional_linear,
    provisional_summary,
)
from fusedserve.kernels import KERNELS, choosing, fused_linear, kernel_choice, run_kernel, tune_cache  # noqa: E402  (sys.path)
from fusedserve.kernels.device import gc_paused  # noqa: E402
from fusedserve.kernels.precision import dot_precision  # noqa: E402
from fusedserve.kernels.provisional import choosing_mode  # noqa: E402
from fusedserve.models import aot  # noqa: E402

FULL_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FULL_NK = ((4096, 4096), (8192, 8192), (1024, 1024), (11008, 4096))
QUICK_MS = (1, 4, 16, 32, 128, 512, 1024, 4096)
FP32_MS = (1, 16, 256, 4096)
# torch.compile(max-autotune) takes tens of seconds per shape: only these batch sizes, N=K=4096, 16-bit
# (--quick: bf16 at the three headline sizes). Compile time has its own budget, not the shapes'.
COMPILE_MS = (1, 16, 128, 1024, 8192)
QUICK_COMPILE_MS = (1, 16, 1024)
COMPILE_BUDGET_S = 150
QUICK_COMPILE_BUDGET_S = 90
# More than the H200's 50 MB of L2 per sweep of the sets, so every call reads its weights from HBM.
COLD_BYTES = 128 * 2**20
MAX_SETS = 64
# A graph replay should last a few hundred microseconds, so event resolution does not matter.
REPLAY_TARGET_US = 400
MAX_CALLS = 64
# Relative error (to the largest reference value) an impl may show before it is reported wrong:
# a few output roundings of that dtype; a wrong config or a missing bias/activation is far above.
CHECK_RTOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}
BASELINES = ("torch_unfused", "cublaslt_fused")
OURS = ("fusedserve", "fusedserve_static_weight")
# Beside a full search's rows, a random run times what a server's near search picks (static weights,
# its own tune cache): the same shapes, near against full.
NEAR = "fusedserve_near"


def log(*args):
    print(*args, flush=True)


def relu_linear(x, w, b):
    return torch.relu(F.linear(x, w, b))


def fixed_impls():
    return {
        "fusedserve": lambda x, w, b: fused_linear(x, w, b, "relu"),
        # As the model runner calls it: W is constant, so its first tile is read before waiting
        # on the previous call (programmatic dependent launch, sm_90+).
        "fusedserve_static_weight": lambda x, w, b: fused_linear(x, w, b, "relu", static_weight=True),
        "torch_unfused": relu_linear,
        "cublaslt_fused": lambda x, w, b: torch._addmm_activation(b, x, w.t()),
        # The choice a cold server starts on, before tuning (kernels/provisional.py).
        "fusedserve_provisional": provisional_linear,
    }


def warm_process(dtypes) -> float:
    """Seconds of this process's first ``fused_linear`` calls, one 8x64x64 layer per dtype (no drawn
    shape is that small): Triton's one-time set-up, which a server pays at start-up, so that no
    shape's ``first_call_s`` carries it."""
    start = time.perf_counter()
    for dtype in dtypes:
        x, w, b = (torch.randn(*shape, device="cuda").to(dtype) for shape in ((8, 64), (64, 64), (64, )))
        fused_linear(x, w, b, "relu")
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, 3)


def make_sets(M, N, K, dtype):
    """Enough independent (x, W, b) sets that a sweep over them exceeds L2."""
    set_bytes = (M * K + N * K + N) * dtype.itemsize
    count = max(2, min(MAX_SETS, math.ceil(COLD_BYTES / set_bytes)))
    sets = []
    for _ in range(count):
        x = torch.randn(M, K, device="cuda").to(dtype)
        w = (torch.randn(N, K, device="cuda") / math.sqrt(K)).to(dtype)
        b = torch.randn(N, device="cuda").to(dtype)
        sets.append((x, w, b))
    return sets


def check(fn, x, w, b):
    """Max error relative to the largest reference value (float64); raises if the impl is wrong."""
    acc = torch.float64
    ref = torch.relu(x.to(acc) @ w.to(acc).T + b.to(acc))
    y = fn(x, w, b)
    if y.shape != ref.shape or y.dtype != x.dtype:
        raise AssertionError(f"output {tuple(y.shape)} {y.dtype}, want {tuple(ref.shape)} {x.dtype}")
    rel = ((y.to(acc) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    if not rel <= CHECK_RTOL[x.dtype]:
        raise AssertionError(f"relative error {rel:.3g} > {CHECK_RTOL[x.dtype]}")
    return rel


def estimate_us(M, N, K, dtype):
    """Rough duration of one call (roofline at 3 TB/s and 500 TFLOP/s), to size the graph."""
    moved = (M * K + N * K + M * N) * dtype.itemsize
    return max(moved / 3e12, 2 * M * N * K / 500e12) * 1e6 + 2


def capture(fn, sets, M, N, K, dtype):
    """Warm every set (compiles and tunes outside the capture), then a CUDA graph of back-to-back
    calls cycling over the sets, replayed once; returns (graph, calls)."""
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    calls = max(len(sets), min(MAX_CALLS, math.ceil(REPLAY_TARGET_US / estimate_us(M, N, K, dtype))))
    calls = math.ceil(calls / len(sets)) * len(sets)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    return graph, calls


def time_graphs(graphs, repeats):
    """Median microseconds per call of each ``name: (graph, calls)``, the graphs' replays interleaved
    (one of each per round), so that a drift of the GPU's clocks over the run is shared by all."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {name: [] for name in graphs}
    for _ in range(repeats):
        for name, (graph, calls) in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def first_call_seconds(fn, args) -> dict:
    """Seconds of ``fn``'s first call on a new shape (the short list timed), then of the call that
    times every candidate (what ``kernels.tune`` does ahead of time)."""
    seconds = {}
    for name, mode in (("first_call_s", None), ("tune_s", "tune")):
        start = time.perf_counter()
        with choosing_mode(mode) if mode else contextlib.nullcontext():
            fn(*args)
        torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - start, 3)
    return seconds


@contextlib.contextmanager
def near_search(directory):
    """Within the block fusedserve tunes with a near search (``kernels.choosing.SEARCH_ENV``) into the
    tune cache in ``directory``, so its picks and the full search's stay apart."""
    saved = {name: os.environ.get(name) for name in (tune_cache.ENV_VAR, choosing.SEARCH_ENV)}
    os.environ.update({tune_cache.ENV_VAR: str(directory), choosing.SEARCH_ENV: "near"})
    tune_cache.device_cache.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
        tune_cache.device_cache.cache_clear()


def tune_seconds(fn, args) -> dict:
    """Seconds of a tuning call (choosing mode "tune") on a new shape: the near search's inside
    ``near_search``, else the full one."""
    start = time.perf_counter()
    with choosing_mode("tune"):
        fn(*args)
    torch.cuda.synchronize()
    return {"tune_s": round(time.perf_counter() - start, 3)}


def warm_and_time(fn, sets, M, N, K, dtype, repeats):
    """Median microseconds per call of one impl timed alone."""
    return time_graphs({"impl": capture(fn, sets, M, N, K, dtype)}, repeats)["impl"]


def measure(fn, sets, M, N, K, dtype, repeats):
    """Check once, then warm and time one impl alone: (us per call, relative error)."""
    rel = check(fn, *sets[0])
    return warm_and_time(fn, sets, M, N, K, dtype, repeats), rel


def row(M, N, K, dtype, impl, us, **extra):
    moved = (M * K + N * K + M * N + N) * dtype.itemsize
    return dict(M=M, N=N, K=K, dtype=str(dtype).removeprefix("torch."), impl=impl, median_us=round(us, 3),
                tflops=round(2 * M * N * K / us / 1e6, 2), tbps=round(moved / us / 1e6, 3), **extra)


def impls_for(M, N, K, dtype, compiled, forced, near=False):
    """The impls to time at this shape: the fixed ones, ``NEAR`` with ``near``, torch.compile where
    chosen, and (with ``forced``) each fusedserve kernel on its own, where it can run and is worth
    the time."""
    impls = fixed_impls()
    if near:
        impls[NEAR] = impls["fusedserve_static_weight"]
        impls[OWN] = own_linear  # timed only where the vendor won the full search (bench_shape)
    if compiled is not None:
        impls["torch_compile"] = compiled
    if forced:
        for name in KERNELS:
            if name == "triton_small_m" and M > 512:
                continue  # weight streaming past a few hundred rows only burns benchmark time
            if name == "triton_tiled" and (N, K) != (4096, 4096):
                continue  # the portable fallback: one shape family shows where it stands
            short = name.removeprefix("triton_").removesuffix("_wgmma")
            impls[f"fusedserve_{short}"] = lambda x, w, b, name=name: run_kernel(name, x, w, b, "relu")
    return impls


def bench_shape(M, N, K, dtype, impls, repeats, near_cache=None):
    """Check and capture every impl, then time them all in interleaved rounds (``time_graphs``);
    ``NEAR`` tunes into the tune cache in ``near_cache``."""
    rows, graphs, errors = [], {}, {}
    sets = make_sets(M, N, K, dtype)
    first_calls = {}
    for impl, fn in impls.items():
        if impl == OWN and kernel_choice(M, N, K, dtype, "cuda", static_weight=True)[0] != VENDOR:
            continue
        try:
            with near_search(near_cache) if impl == NEAR else contextlib.nullcontext():
                if impl in OURS:  # a user's first call (a short list), then the full search, each timed
                    first_calls[impl] = first_call_seconds(fn, sets[0])
                elif impl in (NEAR, OWN):
                    first_calls[impl] = tune_seconds(fn, sets[0])
                errors[impl] = check(fn, *sets[0])
                graphs[impl] = capture(fn, sets, M, N, K, dtype)
        except ValueError as e:
            if impl.startswith("fusedserve_") and str(e).startswith("name "):
                continue  # run_kernel: that kernel cannot run this shape (e.g. no Gluon off Hopper)
            log(f"  !! {impl} M={M} N={N} K={K} {dtype}: ValueError: {str(e)[:300]}")
            rows.append(dict(M=M, N=N, K=K, dtype=str(dtype).removeprefix("torch."), impl=impl, error=str(e)[:500]))
        except Exception as e:  # a failed impl is reported in the results, and the others still run
            log(f"  !! {impl} M={M} N={N} K={K} {dtype}: {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(M=M, N=N, K=K, dtype=str(dtype).removeprefix("torch."), impl=impl, error=str(e)[:500]))
    for impl, us in time_graphs(graphs, repeats).items():
        extra = dict(max_rel_err=float(f"{errors[impl]:.3g}"), **first_calls.get(impl, {}))
        if impl in OURS or impl == NEAR:
            with near_search(near_cache) if impl == NEAR else contextlib.nullcontext():
                extra["kernel"], extra["config"] = kernel_choice(M, N, K, dtype, "cuda",
                                                                 static_weight=impl != "fusedserve")
        elif impl == "fusedserve_provisional":
            extra["kernel"], extra["config"] = describe_provisional(*sets[0][:2])
        elif impl == OWN:
            extra["kernel"], extra["config"] = describe_own(*sets[0])
        if dtype == torch.float32 and impl.startswith("fusedserve"):
            extra["fp32_precision"] = dot_precision(dtype)  # "tf32x3", "ieee" or (torch allowing) "tf32"
        rows.append(row(M, N, K, dtype, impl, us, **extra))
    del graphs, sets
    torch.cuda.empty_cache()
    return rows


def copy_bandwidth_tbps():
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e12


def matmul_peak_tflops():
    """bf16 8192^3 matmul, torch's (cuBLAS) best."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


class CompileCache:
    """torch.compile(max-autotune) of relu(F.linear), one per (N, K, dtype), within a time budget
    (checked before each new shape: one compile already started runs to its end)."""

    def __init__(self, quick):
        self.ms = QUICK_COMPILE_MS if quick else COMPILE_MS
        self.dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
        self.budget = QUICK_COMPILE_BUDGET_S if quick else COMPILE_BUDGET_S
        self.spent = 0.0
        self.compiled = {}
        # Every (M, dtype) is one more compiled graph of the same function; past dynamo's limit of
        # 8 it would silently run eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)

    def get(self, M, N, K, dtype):
        if M not in self.ms or (N, K) != (4096, 4096) or dtype not in self.dtypes:
            return None
        if self.spent > self.budget:
            log(f"  torch_compile skipped at M={M}: compile budget of {self.budget} s spent")
            return None
        key = (N, K, dtype)
        if key not in self.compiled:
            self.compiled[key] = torch.compile(relu_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        fn = self.compiled[key]

        def timed(x, w, b):  # every call is charged; only the first at each shape (compiling) counts
            t0 = time.perf_counter()
            y = fn(x, w, b)
            self.spent += time.perf_counter() - t0
            return y

        return timed


def plan(quick, ms=None, dtypes=None, nk=None):
    """(M, N, K, dtype) in the order measured: the headline shape first, in case time runs out.
    ``ms``, ``dtypes`` and ``nk`` narrow the plan and combine: batch sizes (default: the quick or the
    full list), dtypes in the order given (e.g. to see whether a dtype measures differently when it
    is not the first one timed) and N x K pairs (default N=K=4096 when ``ms`` or ``dtypes`` is given,
    else every shape of the full plan, which takes ~10 s a shape on an H200: its 116 shapes do not fit
    one 10-minute GPU session, so run it in parts). fp32 rows (N=K=4096) only where neither ``ms``
    nor ``dtypes`` is given."""
    if quick and not (ms or dtypes or nk):
        shapes = [(M, 4096, 4096, dt) for dt in (torch.bfloat16, torch.float16) for M in QUICK_MS]
        shapes += [(M, 11008, 4096, torch.bfloat16) for M in (1, 16, 1024)]
        shapes += [(M, 4096, 4096, torch.float32) for M in (1, 1024)]
        return shapes
    narrowed = bool(ms or dtypes)
    shapes = []
    for N, K in nk or (((4096, 4096),) if narrowed else FULL_NK):
        shapes += [(M, N, K, dt) for dt in dtypes or (torch.bfloat16, torch.float16)
                   for M in ms or (QUICK_MS if quick else FULL_MS)]
        if not narrowed and (N, K) == (4096, 4096):
            shapes += [(M, N, K, torch.float32) for M in FP32_MS]
    return shapes


def print_table(rows):
    ok = [r for r in rows if "median_us" in r]
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    log("\nmedian us per call (cold L2); speedup = best of " + "/".join(BASELINES) + " / fusedserve")
    log(f"{'dtype':>8} {'N':>6} {'K':>6} {'M':>5} " + " ".join(f"{i[:14]:>14}" for i in impls) + "  speedup  kernel")
    by_shape = {}
    for r in ok:
        by_shape.setdefault((r["dtype"], r["N"], r["K"], r["M"]), {})[r["impl"]] = r
    for (dt, N, K, M), cells in by_shape.items():
        line = f"{dt:>8} {N:>6} {K:>6} {M:>5} " + " ".join(
            f"{cells[i]['median_us']:>14.2f}" if i in cells else f"{'-':>14}" for i in impls)
        base = [cells[b]["median_us"] for b in BASELINES if b in cells]
        if "fusedserve" in cells and base:
            line += f"  {min(base) / cells['fusedserve']['median_us']:6.2f}x  {cells['fusedserve'].get('kernel', '')}"
        log(line)


def print_targets(rows):
    """Issue 3's targets at N=K=4096, each marked met or missed."""
    cells = {}
    for r in rows:
        if "median_us" in r and r["N"] == 4096 and r["K"] == 4096:
            cells.setdefault((r["dtype"], r["M"]), {})[r["impl"]] = r["median_us"]
    for impl in OURS:
        log(f"\ntargets (N=K=4096), {impl}:")
        for (dt, M), c in sorted(cells.items()):
            if impl in c:
                _targets_at(dt, M, c, c[impl])


def _targets_at(dt, M, c, ours):
    """One shape's target: ``c`` maps impl -> median us, ``ours`` is the fusedserve impl's."""
    if dt == "float32":
        if "torch_unfused" in c:
            verdict(f"{dt} M={M}: not slower than relu(F.linear)", ours <= c["torch_unfused"],
                    f"{ours:.2f} vs {c['torch_unfused']:.2f} us")
        return
    best = min((c[b] for b in BASELINES if b in c), default=None)
    if best is None:
        return
    if M <= 16:
        verdict(f"{dt} M={M}: <= 9.9 us and >= 1.35x baselines", ours <= 9.9 and best / ours >= 1.35,
                f"{ours:.2f} us, {best / ours:.2f}x")
    elif M <= 512:
        verdict(f"{dt} M={M}: >= 1.0x baselines", best / ours >= 1.0, f"{best / ours:.2f}x")
    elif "cublaslt_fused" in c:
        verdict(f"{dt} M={M}: >= 1.0x cublaslt_fused", c["cublaslt_fused"] / ours >= 1.0,
                f"{c['cublaslt_fused'] / ours:.2f}x")


def verdict(what, met, detail):
    log(f"  {'MET ' if met else 'MISS'} {what} ({detail})")


def plot(rows, copy_tbps, peak_tflops, path, gpu):
    try:
        import matplotlib
    except ImportError:
        log(f"matplotlib is not installed: no plot written to {path} (the JSON has every number)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "median_us" in r and r["dtype"] in ("bfloat16", "float16")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    ai = [2**i for i in range(-2, 14)]
    ax.plot(ai, [min(peak_tflops, copy_tbps * a) for a in ai], "k-", label="roof (measured copy BW, bf16 peak)")
    for impl in dict.fromkeys(r["impl"] for r in ok):
        pts = [r for r in ok if r["impl"] == impl]
        ax.scatter([r["tflops"] / r["tbps"] for r in pts], [r["tflops"] for r in pts], s=12, label=impl)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte moved", ylabel="TFLOP/s",
           title="roofline, fp16/bf16, all shapes")
    ax.legend(fontsize=7)
    head = [r for r in ok if r["dtype"] == "bfloat16" and r["N"] == 4096 and r["K"] == 4096]
    for ax, key, roof, unit in ((axes[1], "tbps", copy_tbps, "TB/s"), (axes[2], "tflops", peak_tflops, "TFLOP/s")):
        for impl in dict.fromkeys(r["impl"] for r in head):
            pts = sorted((r["M"], r[key]) for r in head if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=impl)
        ax.axhline(roof, color="k", ls="--", label=f"measured {roof:.1f} {unit}")
        ax.set(xscale="log", xlabel="M (batch rows)", ylabel=unit, title=f"bf16 N=K=4096: {unit}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{gpu}: relu(x @ W^T + b), cold L2")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


PEERS = BASELINES + ("torch_compile",)


def merge_runs(runs):
    """One result from several runs' results (oldest first), for ``--merge``: each shape (M, N, K,
    dtype) keeps every row of the newest run that measured it, so ours and the peers it is compared
    with come from one run; a peer that run did not time (torch.compile, which quick runs leave
    out) is taken from the newest older run that did. Every row says which run it came from
    (``run``: that run's date); ``runs`` lists the sources."""
    gpus = {r["gpu"] for r in runs}
    if len(gpus) != 1:
        raise ValueError(f"runs from different GPUs cannot be merged: {sorted(gpus)}")
    newest, peers_from = {}, {}
    for run in runs:
        by_shape = {}
        for row in run["rows"]:
            by_shape.setdefault((row["M"], row["N"], row["K"], row["dtype"]), []).append(dict(row, run=run["date"]))
        for shape, rows in by_shape.items():
            newest[shape] = rows
            for row in rows:
                if row["impl"] in PEERS and "median_us" in row:
                    peers_from.setdefault(shape, {})[row["impl"]] = row
    rows = []
    for shape, shape_rows in newest.items():
        have = {r["impl"] for r in shape_rows if "median_us" in r}
        rows += shape_rows + [r for impl, r in peers_from.get(shape, {}).items() if impl not in have]
    last = runs[-1]
    return dict(gpu=last["gpu"], date=last["date"], torch=last["torch"], triton=last["triton"], merged=True,
                complete=all(r.get("complete", True) for r in runs),
                copy_tbps=last["copy_tbps"], matmul_tflops=last["matmul_tflops"],
                runs=[dict(date=r["date"], quick=r.get("quick"), truncated=r.get("truncated"),
                           copy_tbps=r.get("copy_tbps"), shapes=len({(x["M"], x["N"], x["K"], x["dtype"])
                                                                     for x in r["rows"]})) for r in runs],
                rows=rows)


def _nk_list(text):
    try:
        pairs = [tuple(int(v) for v in nk.split("x")) for nk in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected NxK,... (e.g. 8192x8192,1024x1024), got {text!r}")
    return pairs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer shapes and repeats, torch.compile only for bf16 M in {QUICK_COMPILE_MS}")
    parser.add_argument("--tune-cache", type=Path, default=None,
                        help="fusedserve's tune cache directory (default a fresh one: configs tuned alone on "
                             "the GPU, not under the contention of parallel test workers)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new shapes after this many seconds, torch.compile's compile "
                             "time not counted (default 140 quick, 480 full)")
    parser.add_argument("--ms", type=lambda v: [int(m) for m in v.split(",")], default=None,
                        help="only these batch sizes (comma-separated), at N=K=4096")
    parser.add_argument("--dtypes", type=lambda v: [getattr(torch, d) for d in v.split(",")], default=None,
                        help="only these dtypes, in this order (e.g. float16,bfloat16), at N=K=4096")
    parser.add_argument("--nk", type=_nk_list, default=None,
                        help="full plan at these NxK only (comma-separated, e.g. 8192x8192,1024x1024)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out (saves its compile time)")
    parser.add_argument("--random", type=int, default=None, metavar="N",
                        help="N shapes drawn at random (M 1-8192, N and K multiples of 8 in 256-16384, "
                             "bf16/fp16) instead of the grid; no per-family rows, no torch.compile")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random's shapes")
    parser.add_argument("--precompile", action="store_true",
                        help="compile every shape's tuning candidates first, in parallel processes without the "
                             "GPU (models.aot): more shapes in a budget; first_call_s then finds Triton's cache warm")
    parser.add_argument("--search", choices=choosing.SEARCHES, default="full",
                        help="how widely fusedserve's tuning searches (kernels.choosing.SEARCH_ENV): full, every "
                             "candidate, as the provisional tables are built from; near, as a server tunes")
    parser.add_argument("--merge", nargs="+", metavar="RUN",
                        help="no GPU needed: these runs (FILE.jsonl:LINE, oldest first; see merge_runs) merged, "
                             "one alone as it is: print the table, the targets and the summaries, draw --plot; "
                             "appends nothing")
    return parser.parse_args(argv)


def show_merged(args):
    picked = [runs.pick(spec) for spec in args.merge]
    merged = merge_runs(picked)
    log(f"{len(merged['rows'])} rows from {len(args.merge)} runs")
    if args.plot:
        plot(merged["rows"], merged["copy_tbps"], merged["matmul_tflops"], args.plot, merged["gpu"])
        if any(run.get("random") for run in picked):
            plot_ratios(merged["rows"], args.plot.with_name(f"{args.plot.stem}_ratios.png"), merged["gpu"], log)
    print_table(merged["rows"])
    print_targets(merged["rows"])
    print_summaries(log, summaries(merged["rows"]))


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return show_merged(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU")
    budget = args.budget_s or (140 if args.quick else 480)
    repeats = 7 if args.quick else 15
    # Read when fusedserve first tunes, which is after this line.
    os.environ[tune_cache.ENV_VAR] = str(args.tune_cache or tempfile.mkdtemp(prefix="fusedserve-tune-"))
    os.environ[choosing.SEARCH_ENV] = args.search  # here and in the precompile's processes
    near_cache = tempfile.mkdtemp(prefix="fusedserve-tune-near-")
    t0 = time.perf_counter()

    copy_tbps, peak = copy_bandwidth_tbps(), matmul_peak_tflops()
    gpu = torch.cuda.get_device_name()
    log(f"{gpu}: copy {copy_tbps:.2f} TB/s, bf16 matmul {peak:.0f} TFLOP/s")
    compile_cache = CompileCache(args.quick)
    rows, shapes, truncated = [], plan(args.quick, args.ms, args.dtypes, args.nk), False
    if args.random:
        shapes, args.no_compile = draw_shapes(args.random, args.seed, args.dtypes or RANDOM_DTYPES), True
    warm_s = warm_process(sorted({dtype for *_, dtype in shapes}, key=str))
    log(f"first fused_linear calls of this process (8x64x64, each dtype): {warm_s:.2f} s")
    run = runs.Run("kernels", args.out, gpu=gpu, quick=args.quick, seed=args.seed if args.random else None,
                   note=args.note, torch=torch.__version__, triton=triton.__version__, copy_tbps=round(copy_tbps, 3),
                   matmul_tflops=round(peak, 1), random=dict(n=args.random, seed=args.seed) if args.random else None,
                   precompiled=args.precompile or None, search=args.search, process_warm_s=warm_s)
    if args.precompile:
        start = time.perf_counter()
        launches = aot.compile_layer_candidates(aot.local_target("cuda"), shapes)
        log(f"compiled {launches} candidate launches of {len(shapes)} shapes in {time.perf_counter() - start:.0f} s")
    for i, (M, N, K, dtype) in enumerate(shapes, 1):
        if time.perf_counter() - t0 - compile_cache.spent > budget:
            log(f"time budget of {budget:.0f} s spent: stopping before shape {i}/{len(shapes)}")
            truncated = True
            break
        forced = dtype != torch.float32 and not args.random and (not args.quick or (N, K) == (4096, 4096))
        compiled = None if args.no_compile else compile_cache.get(M, N, K, dtype)
        impls = impls_for(M, N, K, dtype, compiled, forced, near=bool(args.random) and args.search == "full")
        new = bench_shape(M, N, K, dtype, impls, repeats, near_cache)
        rows += new
        cells = ", ".join(f"{r['impl']} {r['median_us']:.1f}" for r in new if "median_us" in r)
        log(f"[{i}/{len(shapes)} {time.perf_counter() - t0:5.0f}s] M={M} N={N} K={K} "
            f"{str(dtype).removeprefix('torch.')}: {cells}")
        # After every shape too, so a run killed by its caller keeps what it measured.
        run.save(rows, summaries(rows), complete=False, truncated=truncated)

    run.save(rows, summaries(rows), complete=True, truncated=truncated)
    log(f"appended the run to {run.path} ({len(rows)} rows, {time.perf_counter() - t0:.0f} s)")
    if args.plot:
        plot(rows, copy_tbps, peak, args.plot, gpu)
        if args.random:
            plot_ratios(rows, args.plot.with_name(f"{args.plot.stem}_ratios.png"), gpu, log)
    print_table(rows)
    print_targets(rows)
    print_summaries(log, summaries(rows))


def summaries(rows):
    """Issue 23's comparisons of a run's rows (None where it has no such rows)."""
    return {"ours_vs_better_peer": peer_summary(rows, "fusedserve_static_weight"),
            "ours_unmarked_vs_better_peer": peer_summary(rows, "fusedserve"),
            "provisional_vs_tuned": provisional_summary(rows),
            "near_vs_better_peer": peer_summary(rows, NEAR),
            "near_vs_full": provisional_summary(rows, provisional_impl=NEAR),
            "own_vs_vendor_won": provisional_summary(rows, provisional_impl=OWN)}


if __name__ == "__main__":
    main()
