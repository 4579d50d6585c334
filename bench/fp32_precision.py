"""float32 layers: what each ``FUSEDSERVE_FP32_PRECISION`` costs in time and in error, next to torch.

torch's float32 matmuls are exact (SGEMM on the CUDA cores) unless
``torch.backends.cuda.matmul.allow_tf32`` is set. Ours follow: "ieee" runs exact fp32 products on
the CUDA cores; "tf32x3" splits each operand into two TF32 halves and sums three tensor-core
products. This measures, per shape, each variant's time (cold L2, CUDA-graph replays, as
``bench/kernels.py`` times) and its error against a float64 reference, with torch's exact SGEMM and
torch's TF32 as the yardsticks of both.

Run on a CUDA GPU from the repository root:

    python bench/fp32_precision.py --out bench/results/fp32_precision_h200.json

Writes ``{"gpu", "date", "torch", "triton", "rows": [{"M", "N", "K", "impl", "median_us",
"max_rel_err", "mean_rel_err"}]}``; errors are the largest and the mean absolute error over the
largest reference value, on seeded inputs (x ~ N(0, 1), W ~ N(0, 1/K), b ~ N(0, 1)).
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import kernels as kbench  # noqa: E402  (needs sys.path)
from fusedserve.kernels import fused_linear  # noqa: E402
from fusedserve.kernels.precision import FP32_PRECISION_ENV  # noqa: E402

# The shipped digits model's layers (64-256-256-10) at serving batches, and square layers from
# memory-bound to compute-bound.
SHAPES = ([(M, N, K) for M in (512, 4096) for N, K in ((256, 64), (256, 256), (10, 256))]
          + [(M, 4096, 4096) for M in (16, 256, 1024, 4096)] + [(1024, 1024, 1024)])


def torch_relu_linear(tf32: bool):
    def fn(x, w, b):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        return torch.relu(F.linear(x, w, b))
    return fn


def ours(precision: str):
    def fn(x, w, b):
        os.environ[FP32_PRECISION_ENV] = precision
        torch.backends.cuda.matmul.allow_tf32 = False
        return fused_linear(x, w, b, "relu", static_weight=True)
    return fn


IMPLS = {"torch_ieee": torch_relu_linear(False), "torch_tf32": torch_relu_linear(True),
         "fusedserve_ieee": ours("ieee"), "fusedserve_tf32x3": ours("tf32x3")}


def errors(fn, x, w, b):
    ref = torch.relu(x.double() @ w.double().T + b.double())
    err = (fn(x, w, b).double() - ref).abs()
    scale = ref.abs().max().clamp_min(1e-30)
    return (err.max() / scale).item(), (err.mean() / scale).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for M, N, K in SHAPES:
        sets = kbench.make_sets(M, N, K, torch.float32)
        for impl, fn in IMPLS.items():
            # (not kbench.measure: its fp32 tolerance check fails TF32 at large K)
            max_err, mean_err = errors(fn, *sets[0])
            us = kbench.warm_and_time(fn, sets, M, N, K, torch.float32, args.repeats)
            rows.append({"M": M, "N": N, "K": K, "impl": impl, "median_us": round(us, 2),
                         "max_rel_err": max_err, "mean_rel_err": mean_err})
            print(json.dumps(rows[-1]), flush=True)
        del sets
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result = {"gpu": torch.cuda.get_device_name(), "date": date, "torch": torch.__version__,
              "triton": triton.__version__, "dtype": "float32", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'M':>5} {'N':>5} {'K':>5} " + " ".join(f"{i:>24}" for i in IMPLS))
    for M, N, K in SHAPES:
        cells = [r for r in rows if (r["M"], r["N"], r["K"]) == (M, N, K)]
        print(f"{M:>5} {N:>5} {K:>5} " + " ".join(f"{r['median_us']:>9.2f}us {r['max_rel_err']:>9.2e}   " for r in cells))


if __name__ == "__main__":
    main()
