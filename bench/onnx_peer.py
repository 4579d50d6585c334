"""An imported ONNX model served by fusedserve against the same file in onnxruntime, at the serving
contract: float32 rows on the host in, float32 rows on the host out.

    python bench/onnx_peer.py [--quick] [--calls N] [--dtype float32|float16|bfloat16]

Each model is a torch MLP exported with ``torch.onnx.export`` at run time, imported with
``fusedserve.models.from_onnx`` (which checks it against onnxruntime first), then served by a
``ModelRunner`` (the engine's runner: buckets, CUDA graphs, tuned kernels; each measured batch warmed
and tuned before it is timed). onnxruntime runs the same file on its CUDA execution provider where
installed, else its CPU one (the line says which, ``provider``). Per batch size the two are called
alternately, A B A B, ``calls`` times each; the median wall-clock microseconds per call of each.
``--quick`` (one small model, three batches) also runs on a CPU-only machine, where fusedserve runs
its torch backend. Appends the run to ``OUT/onnx_peer.jsonl`` (``bench/runs.py``): rows
[{"model", "widths", "dtype", "batch", "fusedserve_us", "onnxruntime_us", "speedup", "max_error"}],
speedup = onnxruntime us / fusedserve us.
"""

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402
from fusedserve.models import ModelRunner, from_onnx, load_model  # noqa: E402

# (name, widths, hidden activation module): a tabular classifier, a wide ranking tower, a deep narrow one.
MODELS = (("tabular_64_2x256_10", (64, 256, 256, 10), nn.ReLU),
          ("tower_512_3x1024_128", (512, 1024, 1024, 1024, 128), nn.GELU),
          ("deep_128_6x512_32", (128, *(512,) * 6, 32), nn.SiLU))
QUICK_MODELS = (("quick_32_64_10", (32, 64, 10), nn.GELU),)
BATCHES, QUICK_BATCHES = (1, 8, 64, 256, 1024), (1, 8, 64)
CALLS, QUICK_CALLS = 500, 20
METHOD = ("torch MLP -> torch.onnx.export (TorchScript exporter, opset 18) -> fusedserve.models.from_onnx; "
          "host float32 rows in and out; fusedserve ModelRunner.run vs onnxruntime InferenceSession.run on the "
          "same file, called alternately, median us per call")


def export(name: str, widths, act, folder: Path) -> Path:
    torch.manual_seed(0)
    layers = []
    for i, (k, n) in enumerate(pairwise(widths)):
        layers += [nn.Linear(k, n)] + ([act()] if i < len(widths) - 2 else [])
    path = folder / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(nn.Sequential(*layers).eval(), (torch.randn(2, widths[0]),), path, dynamo=False,
                          opset_version=18, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return path


def ort_session(path: Path):
    import onnxruntime

    cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    session = onnxruntime.InferenceSession(str(path), providers=providers)
    return session, session.get_providers()[0]


def alternate(ours, theirs, calls: int) -> tuple[float, float]:
    """Median microseconds per call of each, called A B A B."""
    a, b = [], []
    for _ in range(calls):
        start = time.perf_counter()
        ours()
        middle = time.perf_counter()
        theirs()
        a.append(middle - start)
        b.append(time.perf_counter() - middle)
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6


def measure(spec, folder: Path, dtype: str, batches, calls: int, emit) -> str:
    name, widths, act = spec
    path = export(name, widths, act, folder)
    from_onnx(path, folder / "repo" / name, dtype=dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # provisional=False: the first batch of each bucket tunes it (only the buckets measured here).
    runner = ModelRunner(load_model(folder / "repo" / name, device=device, name=name), max_batch_size=max(batches),
                         provisional=False)
    session, provider = ort_session(path)
    rng = np.random.default_rng(0)
    for batch in batches:
        rows = rng.standard_normal((batch, widths[0]), dtype=np.float32)
        x = torch.from_numpy(rows)
        for _ in range(3):  # warm: the bucket's kernels tuned and its graph captured; onnxruntime's arena
            ours, theirs = runner.run(x), session.run(None, {"x": rows})[0]
        error = float(np.abs(ours.numpy() - theirs).max())
        ours_us, theirs_us = alternate(lambda x=x: runner.run(x), lambda r=rows: session.run(None, {"x": r}), calls)
        emit(dict(model=name, widths=list(widths), dtype=dtype, batch=batch, fusedserve_us=round(ours_us, 1),
                  onnxruntime_us=round(theirs_us, 1), speedup=round(theirs_us / ours_us, 3), max_error=error))
    return provider


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs.arguments(parser)
    parser.add_argument("--quick", action="store_true", help="one small model, batches 1, 8, 64 (runs on a CPU)")
    parser.add_argument("--calls", type=int, default=None,
                        help=f"calls per batch (default {CALLS}, quick {QUICK_CALLS})")
    parser.add_argument("--dtype", default="float32",
                        help="fusedserve's served dtype (onnxruntime runs the float32 file)")
    args = parser.parse_args(argv)
    import onnxruntime

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    line = runs.Run("onnx_peer", args.out, gpu=gpu, quick=args.quick, note=args.note, method=METHOD,
                    torch=torch.__version__, onnxruntime=onnxruntime.__version__)
    rows, providers = [], set()

    def emit(row):
        rows.append(row)
        print(row, flush=True)
        line.save(rows, complete=False)

    with tempfile.TemporaryDirectory(prefix="onnx-peer-") as tmp:
        for spec in QUICK_MODELS if args.quick else MODELS:
            providers.add(measure(spec, Path(tmp), args.dtype, QUICK_BATCHES if args.quick else BATCHES,
                                  args.calls or (QUICK_CALLS if args.quick else CALLS), emit))
    speedups = [r["speedup"] for r in rows]
    summary = dict(rows=len(rows), min_speedup=min(speedups), median_speedup=statistics.median(speedups))
    data = line.save(rows, summary, complete=True, provider=sorted(providers))
    print(f"fusedserve vs onnxruntime ({', '.join(sorted(providers))}) on {gpu or 'the CPU'}: median "
          f"{summary['median_speedup']}x, min {summary['min_speedup']}x; appended to {line.path}")
    return data


if __name__ == "__main__":
    main()
