"""An imported ONNX model served by fusedserve against the same file in onnxruntime, at the serving
contract (float32 rows on the host in and out) and, with ``--http``, end to end over HTTP.

    python bench/onnx_peer.py [--quick] [--calls N] [--dtype float32|float16|bfloat16]
    python bench/onnx_peer.py --http [--quick] [--device cpu|cuda] [--clients 1 16 64] [--dtype ...]

Each model is a torch MLP exported with ``torch.onnx.export`` at run time, imported with
``fusedserve.models.from_onnx`` (which checks it against onnxruntime first), then served by a
``ModelRunner`` (the engine's runner: buckets, CUDA graphs, tuned kernels; each measured batch warmed
and tuned before it is timed). onnxruntime runs the same file on its CUDA execution provider where
installed, else its CPU one (the line says which, ``provider``). Per batch size the two are called
in pairs whose order flips every pair (``bench/timing.py``), ``calls`` times each; the median
wall-clock microseconds per call of each.
``--quick`` (one small model, three batches) also runs on a CPU-only machine, where fusedserve runs
its torch backend. Appends the run to ``OUT/onnx_peer.jsonl`` (``bench/runs.py``): rows
[{"model", "widths", "dtype", "batch", "fusedserve_us", "onnxruntime_us", "speedup", "max_error"}],
speedup = onnxruntime us / fusedserve us.

``--http`` serves the imported repository with ``fusedserve serve`` and the same .onnx files with the
FastAPI app a user would write instead (bench/peers/naive_fastapi.py's ``create_onnx_app`` under
uvicorn: onnxruntime inline in the handler, on CUDA where ``--device cuda`` and its CUDA provider are
there), both on loopback ports, checks they answer alike, then drives them with bench/loadgen.py as
bench/load.py does: rounds of every model x client count x server, the servers' order reversed every
other round. Its line (``"mode": "http"``) has bench/load.py's rows (req/s, mean/p50/p99 ms, CPU per
request, per run), each group's median over rounds and fusedserve's ratios over onnxruntime's as the
summary, and the answers' largest error. ``--quick``: one small model at 1 and 16 clients, 2 rounds of 1 s.
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import warnings
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import load, load_report, runs  # noqa: E402
from bench.loadgen import LoadPool, default_procs  # noqa: E402
from bench.peers.naive_fastapi import ONNX_FILE, ort_providers  # noqa: E402
from bench.servers import fusedserve_spec, naive_spec  # noqa: E402
from bench.timing import alternate  # noqa: E402
from fusedserve.models import ModelRunner, from_onnx, load_model  # noqa: E402
from fusedserve.models.importing.check import TOLERANCE  # noqa: E402

# (name, widths, hidden activation module): a tabular classifier, a wide ranking tower, a deep narrow one.
MODELS = (("tabular_64_2x256_10", (64, 256, 256, 10), nn.ReLU),
          ("tower_512_3x1024_128", (512, 1024, 1024, 1024, 128), nn.GELU),
          ("deep_128_6x512_32", (128, *(512,) * 6, 32), nn.SiLU))
QUICK_MODELS = (("quick_32_64_10", (32, 64, 10), nn.GELU),)
BATCHES, QUICK_BATCHES = (1, 8, 64, 256, 1024), (1, 8, 64)
CALLS, QUICK_CALLS = 500, 20
METHOD = ("torch MLP -> torch.onnx.export (TorchScript exporter, opset 18) -> fusedserve.models.from_onnx; "
          "host float32 rows in and out; fusedserve ModelRunner.run vs onnxruntime InferenceSession.run on the "
          "same file (intra-op spinning off), called in pairs whose order flips every pair, median us per call")
HTTP_METHOD = ("torch MLP -> torch.onnx.export (TorchScript exporter, opset 18) -> fusedserve.models.from_onnx into a "
               "model repository, the .onnx file beside it; fusedserve serve vs a FastAPI app calling onnxruntime "
               "InferenceSession.run inline (bench/peers/naive_fastapi.py create_onnx_app, uvicorn); JSON POST /infer "
               "of one row, from bench/loadgen.py's keep-alive clients; rounds alternate the servers, the order "
               "reversed every other round; medians over rounds")


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

    # Idle intra-op threads sleep instead of spinning: calls alternate with ours in this process, and
    # spinning threads starve torch's parallel host copies (milliseconds at 32k+ element batches).
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(str(path), options, providers=ort_providers("cuda"))
    return session, session.get_providers()[0]


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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs.arguments(parser)
    parser.add_argument("--quick", action="store_true", help="one small model: batches 1, 8, 64, or with --http 1 "
                        "and 16 clients, 2 rounds of 1 s (runs on a CPU)")
    parser.add_argument("--calls", type=int, default=None,
                        help=f"calls per batch (default {CALLS}, quick {QUICK_CALLS})")
    parser.add_argument("--dtype", default="float32",
                        help="fusedserve's served dtype (onnxruntime runs the float32 file)")
    http = parser.add_argument_group("end to end (--http)")
    http.add_argument("--http", action="store_true",
                      help="fusedserve serve against a FastAPI app on onnxruntime, under bench/loadgen.py's load")
    http.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both servers run the models")
    http.add_argument("--clients", type=int, nargs="+", help="client counts (default 1 16 64; quick 1 16)")
    http.add_argument("--rounds", type=int, help="rounds, each server once per model and client count (default 3; "
                      "quick 2)")
    http.add_argument("--duration", type=float, help="seconds per run (default 3; quick 1)")
    http.add_argument("--max-requests", type=int, default=2_000_000, help="request cap per run, over all clients")
    http.add_argument("--procs", type=int, default=default_procs(), help="load generator processes")
    http.add_argument("--peer-workers", type=int, default=1, help="uvicorn workers of the onnxruntime app")
    http.add_argument("--ready-timeout", type=float, default=400.0, help="seconds a server may take to warm up")
    http.add_argument("--budget-s", type=float, help="start no run after this many seconds of runs")
    args = parser.parse_args(argv)
    args.clients = args.clients or ([1, 16] if args.quick else [1, 16, 64])
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.duration = args.duration or (1.0 if args.quick else 3.0)
    return args


def contract(args) -> dict:
    """The serving contract: ModelRunner.run against InferenceSession.run, in this process."""
    import onnxruntime

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    line = runs.Run("onnx_peer", args.out, gpu=gpu, quick=args.quick, note=args.note, mode="contract",
                    method=METHOD, torch=torch.__version__, onnxruntime=onnxruntime.__version__)
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


def write_repository(specs, root: Path, dtype: str) -> dict[str, int]:
    """Each model exported and imported into ``root/<name>`` (what fusedserve serves), its .onnx file
    beside as ``model.onnx`` (what the onnxruntime app serves). Returns name -> input width."""
    widths = {}
    for name, layers, act in specs:
        path = export(name, layers, act, root.parent)
        from_onnx(path, root / name, dtype=dtype)
        shutil.copy(path, root / name / ONNX_FILE)
        widths[name] = layers[0]
    return widths


def tolerance(dtype: str, providers: dict) -> float:
    """The import check's tolerance for the served dtype; at least float16's where onnxruntime runs on
    CUDA, whose default (use_tf32) rounds float32 matmul inputs to TF32's 10 mantissa bits, as float16's."""
    cuda = any(p.startswith("CUDA") for p in providers.values())
    return max(TOLERANCE[dtype], TOLERANCE["float16"] if cuda else 0.0)


def answer_errors(ours, theirs, traffic: dict, widths: dict, limit: float) -> dict:
    """Per model, the largest error of our answers against onnxruntime's app's over 8 one-row bodies of
    the load and one of 32 rows, relative to max(1, |theirs|) as imports are checked; raises past ``limit``."""
    errors = {}
    for name, sent in traffic.items():
        worst = 0.0
        for body in [*sent.bodies[:8], load.request_traffic(name, widths[name], 32).bodies[0]]:
            a = np.array(load.post(ours.url + ours.spec.infer_path, body)["outputs"])
            b = np.array(load.post(theirs.url + theirs.spec.infer_path, body)["outputs"])
            worst = max(worst, float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max()))))
        if not worst <= limit:
            raise RuntimeError(f"{name}: fusedserve and onnxruntime answer apart by {worst:.3g} (tolerance {limit:g})")
        errors[name] = worst
    return errors


def drive(args, traffic: dict, widths: dict, work: Path) -> dict:
    """Both servers started on ``work/repo``, their answers compared, then every round under load."""
    chosen = [fusedserve_spec("fusedserve", []), naive_spec(args.peer_workers, "onnxruntime")]
    servers = load.start({s.name: s for s in chosen}, args, work / "repo", work)
    try:
        peer = servers[chosen[1].name]
        with urllib.request.urlopen(peer.url + "/providers", timeout=10) as r:
            providers = json.loads(r.read())  # model -> the execution provider that runs it
        limit = tolerance(args.dtype, providers)
        errors = answer_errors(servers["fusedserve"], peer, traffic, widths, limit)
        with LoadPool(args.procs) as pool:
            load.warm(pool, servers, traffic, args)
            measured, cut = load.rounds(pool, servers, traffic, args, time.monotonic())
        argv = {n: s.argv for n, s in servers.items()}
    finally:
        load.stop(servers)
    return dict(servers=argv, provider=sorted(set(providers.values())), cut_short=cut, runs=measured,
                answers=dict(max_error=errors, tolerance=limit, bodies_per_model=9))


def http_summary(measured: list[dict]) -> dict:
    """Each (model, clients, server) group's medians over rounds, and fusedserve's ratios over the peer
    (req/s: higher is ours faster; latencies: lower is)."""
    groups = load_report.summarize(measured)
    ratios = load_report.ratios(groups, "fusedserve")
    rps = [r["rps_ratio"] for r in ratios if r["rps_ratio"] is not None]
    return dict(groups=groups, ratios=ratios, median_rps_ratio=statistics.median(rps) if rps else None,
                min_rps_ratio=min(rps, default=None))


def http(args) -> dict:
    """End to end: ``fusedserve serve`` against the onnxruntime FastAPI app, one JSONL line."""
    import onnxruntime

    machine = load.machine(args)
    with tempfile.TemporaryDirectory(prefix="onnx-peer-http-") as tmp:
        widths = write_repository(QUICK_MODELS if args.quick else MODELS, Path(tmp) / "repo", args.dtype)
        args.models = list(widths)
        traffic = {name: load.request_traffic(name, width, 1) for name, width in widths.items()}
        result = drive(args, traffic, widths, Path(tmp))
    measured = result.pop("runs")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "note", "calls")}
    # Neither this machine's interpreter nor its checkout's path goes into the results.
    measured, summary, result = json.loads(load.portable(json.dumps([measured, http_summary(measured), result])))
    line = runs.Run("onnx_peer", args.out, gpu=machine["gpu"], quick=args.quick, note=args.note, mode="http",
                    method=HTTP_METHOD, device=args.device, dtype=args.dtype, torch=torch.__version__,
                    onnxruntime=onnxruntime.__version__, machine=machine, config=config)
    data = line.save(measured, summary, complete=True, **result)
    print_http(data)
    print(f"appended to {line.path}")
    if args.plot and not load_report.plot(summary["groups"], args.plot, f"/infer, 1 row/request, {args.device}"):
        print("no plot: matplotlib is missing")
    return data


def print_http(line: dict) -> None:
    """Per model and client count, both servers' medians and the ratios; then the answers' check."""
    groups, provider = line["summary"]["groups"], ", ".join(line["provider"])
    for r in line["summary"]["ratios"]:
        for server in ("fusedserve", r["peer"]):
            med = {f: load_report.median_of(groups, r["model"], r["clients"], server, f)
                   for f in ("rps", "mean_ms", "p50_ms", "p99_ms")}
            print(f"{r['model']} {r['clients']:4d} clients {server:22s} {med['rps']:9.0f} req/s  mean "
                  f"{med['mean_ms']} p50 {med['p50_ms']} p99 {med['p99_ms']} ms")
        print(f"  fusedserve over onnxruntime ({provider}): req/s {r['rps_ratio']}x, mean {r['mean_ms_ratio']}x, "
              f"p50 {r['p50_ms_ratio']}x, p99 {r['p99_ms_ratio']}x")
    answers = line["answers"]
    print(f"answers: max error {max(answers['max_error'].values()):.3g} (tolerance {answers['tolerance']:g}, "
          f"{answers['bodies_per_model']} bodies per model)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    return http(args) if args.http else contract(args)


if __name__ == "__main__":
    main()
