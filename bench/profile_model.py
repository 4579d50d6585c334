"""Where one model's batch spends its time: GPU time per kernel of each path, and the host's cost
of a batch timed for ``/kernel-stats``. A diagnosis to run before changing the runner or kernels.

Run on a CUDA GPU from the repository root:

    python bench/profile_model.py --out DIR [--model digits] [--batch 8]

Writes ``DIR/profile_<model>_b<batch>.json``:
- "paths": for the "fused" and "layers" paths (each forced, CUDA graphs as served): microseconds
  per ``compute()`` (CUDA events around back-to-back replays), and every kernel the profiler saw
  in those replays with its count and mean GPU microseconds per call;
- "host": ``run()`` (host copies included) per batch with CUDA graphs and no timing sink, and with
  every batch timed (eager launches with CUDA events), plus the functions that took the most time in
  the timed batches (cProfile, cumulative).
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import site
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench.model import CountingSink, build_pair  # noqa: E402  (needs sys.path)
from fusedserve.models import ModelRunner  # noqa: E402

CALLS = 200


def per_call_us(step, calls=CALLS):
    """Mean microseconds per call of ``step`` over ``calls`` back-to-back calls (GPU time)."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def kernels_of(step, calls=50):
    """{kernel name: {"count", "mean_us"}} over ``calls`` calls of ``step``, from the profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    table = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count:
            table[event.key] = {"count": event.count // calls,
                                "mean_us": round(event.device_time_total / event.count, 2)}
    return table


def profile_paths(model, batch):
    result = {}
    for path in ("fused", "layers"):
        runner = ModelRunner(model, max_batch_size=batch, fused=path == "fused", provisional=False)
        runner.warmup()
        runner.input_buffer.uniform_(0, 16)
        result[path] = {"compute_us": round(per_call_us(lambda: runner.compute(batch)), 2),
                        "kernels": kernels_of(lambda: runner.compute(batch))}
    return result


def host_costs(model, batch):
    x = torch.rand(batch, model.config.in_features) * 16
    plain = ModelRunner(model, max_batch_size=batch, provisional=False)  # tuned, as served once tuning is done
    timed = ModelRunner(model, max_batch_size=batch, timing_sink=CountingSink(), timing_sample_every=1,
                        timing_min_interval_s=0.0, provisional=False)
    costs = {}
    for name, runner in (("graph_untimed", plain), ("every_batch_timed", timed)):
        runner.run(x)
        start = time.perf_counter()
        for _ in range(CALLS):
            runner.run(x)
        costs[f"{name}_run_us"] = round((time.perf_counter() - start) / CALLS * 1e6, 2)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        timed.run(x)
    profiler.disable()
    timed.flush_timings()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    # File names relative to the repository and to site-packages: the report is committed.
    report = text.getvalue().replace(str(ROOT) + os.sep, "")
    for packages in site.getsitepackages():
        report = report.replace(packages + os.sep, "site-packages/")
    costs["timed_batches_cprofile"] = report
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the JSON")
    parser.add_argument("--model", default="digits", help="digits, mlp4x1024 or mlp4x4096")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_model.py needs a CUDA GPU")
    model, _ = build_pair(args.model)
    report = {"gpu": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch,
              "paths": profile_paths(model, args.batch), "host": host_costs(model, args.batch)}
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / f"profile_{args.model}_b{args.batch}.json"
    dest.write_text(json.dumps(report, indent=1))
    for path, info in report["paths"].items():
        print(f"{path}: {info['compute_us']} us per compute()")
        for name, k in sorted(info["kernels"].items(), key=lambda kv: -kv[1]["mean_us"] * kv[1]["count"]):
            print(f"    {k['count']} x {k['mean_us']:8.2f} us  {name[:100]}")
    print({k: v for k, v in report["host"].items() if k.endswith("_us")})
    print(report["host"]["timed_batches_cprofile"])
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
