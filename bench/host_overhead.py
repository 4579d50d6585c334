"""Host time of one eager ``fused_linear`` call, next to eager torch, and where it goes.

The served path replays CUDA graphs and pays none of this; a user who calls ``kernels.fused_linear``
in eager code pays all of it on every call. Run on a CUDA GPU from the repository root:

    python bench/host_overhead.py --out bench/results/host_overhead_h200.json [--calls 2000]

For each shape (bf16, bias, ReLU; tuned before timing) it times ``calls`` back-to-back launches
with ``time.perf_counter`` around the whole loop and one synchronize at the end, for
``fused_linear`` (with and without ``static_weight``), ``torch.relu(F.linear(...))`` and
``torch._addmm_activation``. Where the host is slower than the GPU, that is the host time per call;
``gpu_us`` (CUDA events around the same loop) says which side bound it. Then one shape runs under
cProfile and the functions with the most cumulative time per call are listed.

Writes ``{"gpu", "date", "torch", "triton", "calls", "rows": [{"M", "N", "K", "impl",
"host_us", "gpu_us"}], "profile": {"M", "N", "K", "top": [{"function", "cum_us_per_call",
"calls_per_call"}]}}``.
"""

import argparse
import cProfile
import datetime
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from fusedserve.kernels import fused_linear  # noqa: E402  (needs sys.path)

SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (512, 4096, 4096), (8, 1024, 1024))
PROFILE_SHAPE = (1, 4096, 4096)
PROFILE_TOP = 25


def impls(x, w, b):
    return {
        "fusedserve": lambda: fused_linear(x, w, b, "relu"),
        "fusedserve_static_weight": lambda: fused_linear(x, w, b, "relu", static_weight=True),
        "torch_unfused": lambda: torch.relu(F.linear(x, w, b)),
        "cublaslt_fused": lambda: torch._addmm_activation(b, x, w.t()),
    }


def time_loop(fn, calls):
    """(host microseconds per call, GPU microseconds per call) over ``calls`` back-to-back calls."""
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    end_event.record()
    torch.cuda.synchronize()
    return host / calls * 1e6, start_event.elapsed_time(end_event) / calls * 1e3


def profile(fn, calls):
    """The ``PROFILE_TOP`` functions with the most cumulative time, per call of ``fn``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, ncalls, _, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}({name})", "cum_us_per_call": cumtime / calls * 1e6,
                     "calls_per_call": ncalls / calls})
    rows.sort(key=lambda r: r["cum_us_per_call"], reverse=True)
    return [{**r, "cum_us_per_call": round(r["cum_us_per_call"], 2), "calls_per_call": round(r["calls_per_call"], 2)}
            for r in rows[:PROFILE_TOP]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/host_overhead.py needs a CUDA GPU")
    if args.calls < 1:
        sys.exit(f"--calls must be at least 1, got {args.calls}")
    rows, profiled = [], None
    for M, N, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
        b = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        for name, fn in impls(x, w, b).items():
            fn()  # tunes fusedserve's bucket (not timed), warms torch's handles
            time_loop(fn, 20)
            host_us, gpu_us = time_loop(fn, args.calls)
            rows.append({"M": M, "N": N, "K": K, "impl": name, "host_us": round(host_us, 2), "gpu_us": round(gpu_us, 2)})
            print(f"M={M:4d} N={N} K={K} {name:26s} host {host_us:7.1f} us/call, GPU {gpu_us:7.1f} us/call", flush=True)
        if (M, N, K) == PROFILE_SHAPE:
            profiled = {"M": M, "N": N, "K": K, "impl": "fusedserve",
                        "top": profile(impls(x, w, b)["fusedserve"], min(args.calls, 500))}
    print(f"\ncProfile of fused_linear at M={PROFILE_SHAPE[0]} N={PROFILE_SHAPE[1]} K={PROFILE_SHAPE[2]} "
          "(cumulative us per call):")
    for r in profiled["top"]:
        print(f"  {r['cum_us_per_call']:8.2f}  x{r['calls_per_call']:<5g} {r['function']}")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "calls": args.calls,
              "rows": rows, "profile": profiled}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
