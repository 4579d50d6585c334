"""Sweep ``kernels/triton/fused_mlp.py``'s tile configs layer by layer on the benchmark models: the data behind
``fused_mlp_config``.

Run on a CUDA GPU from the repository root (stops starting new configs after --budget-s):

    python bench/fused_mlp_sweep.py --out DIR/fused_mlp_sweep_h200.jsonl [--budget-s 150] [--only digits:512 ...]

Each line is one timing: {"model", "batch", "layer", "M", "N", "K", "dtype", "cfg", "default", "us"}
(or "err"): microseconds per launch of that one layer, CUDA events around back-to-back launches
captured in one CUDA graph (as the runner replays them, programmatic dependent launch included;
weights stay in L2 as in ``bench/model.py``). "default" marks ``fused_mlp_config``'s pick; the
tuner's own candidates (``fused_mlp_candidates``, FMA tiles included) come first, then a wider set of
tensor-core tiles. Layers with equal (N, K, role) are timed once.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.json_lines import JsonLines  # noqa: E402  (needs sys.path)
from bench.model import build_pair  # noqa: E402
from fusedserve.kernels.triton import fused_mlp  # noqa: E402
from fusedserve.kernels.device import gc_paused  # noqa: E402

# (model, batch), most telling first (the issue-4 points that miss), in case the budget runs out.
PLAN = (("digits", 8), ("mlp4x1024", 8), ("mlp4x1024", 64), ("mlp4x4096", 8), ("digits", 64),
        ("mlp4x4096", 1), ("mlp4x1024", 1), ("digits", 1), ("digits", 512), ("mlp4x4096", 64))
CALLS = 20


def candidates(M, dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tiles worth trying at this batch."""
    block_ms = (16,) if M <= 16 else (16, 32, 64)
    block_ks = (32, 64, 128) if M > 16 else (64, 128, 256)
    tiles = []
    for bm in block_ms:
        for bn in (16, 32, 64):
            for bk in block_ks:
                if dtype == torch.float32 and bm * bk > 64 * 64:
                    continue  # fp32 input tiles that large spill
                for warps, stages in ((4, 3), (8, 3)) if M > 16 else ((2, 3), (4, 3), (4, 4), (8, 3)):
                    tiles.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                                      FMA=False))
    return tiles


def time_layer(packed, index, h, shift, scale, config):
    """Microseconds per launch of layer ``index`` (graph of CALLS back-to-back launches, best of 5)."""
    step = lambda: fused_mlp.fused_mlp_layer(h, packed, index, shift, scale, config=config)  # noqa: E731
    step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        for _ in range(CALLS):
            step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    return best


def sweep(name, batch, emit, deadline):
    model, _ = build_pair(name)
    packed = fused_mlp.pack_mlp([l.weight.detach() for l in model.layers],
                                [l.bias.detach() for l in model.layers], model.config.activation)
    dtype = packed.weights.dtype
    widths = packed.widths
    seen = set()
    for index in range(packed.num_layers):
        K, N = widths[index], widths[index + 1]
        role = "first" if index == 0 else ("last" if index == packed.num_layers - 1 else "hidden")
        if (N, K, role) in seen:
            continue
        seen.add((N, K, role))
        h = (torch.rand(batch, K, device="cuda") * 16 if index == 0
             else torch.rand(batch, K, device="cuda").to(dtype))
        default = fused_mlp.fused_mlp_config(batch, N, dtype, fused_mlp.sm_count("cuda"))
        tiles = fused_mlp.fused_mlp_candidates(batch, N, K, dtype, fused_mlp.sm_count("cuda"))
        tiles += [t for t in candidates(batch, dtype) if t not in tiles]
        for config in tiles:
            if time.monotonic() > deadline:
                return
            row = dict(model=name, batch=batch, layer=index, M=batch, N=N, K=K,
                       dtype=str(dtype).removeprefix("torch."), cfg=config, default=config == default)
            try:
                row["us"] = round(time_layer(packed, index, h, model.input_shift, model.input_scale, config), 3)
            except Exception as e:  # a tile that does not fit is recorded, and the sweep goes on
                row["us"], row["err"] = None, f"{type(e).__name__}: {str(e)[:150]}"
            emit(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON-lines file to write")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no new config after this")
    parser.add_argument("--only", nargs="+", metavar="MODEL:BATCH",
                        help="sweep these (model, batch) points instead of the default plan, e.g. digits:512")
    args = parser.parse_args()
    plan = PLAN if not args.only else [(p.split(":")[0], int(p.split(":")[1])) for p in args.only]
    if not torch.cuda.is_available():
        sys.exit("fused_mlp_sweep.py needs a CUDA GPU")
    deadline = time.monotonic() + args.budget_s
    with JsonLines(args.out) as out:
        for name, batch in plan:
            if time.monotonic() > deadline:
                print(f"budget of {args.budget_s} s spent before {name} batch {batch}")
                break
            sweep(name, batch, out.emit, deadline)
            here = [r for r in out.rows if (r["model"], r["batch"]) == (name, batch) and r["us"] is not None]
            for layer in sorted({r["layer"] for r in here}):
                mine = sorted((r for r in here if r["layer"] == layer), key=lambda r: r["us"])
                default = next((r["us"] for r in mine if r["default"]), None)
                best = mine[0]
                print(f"{name} b{batch} layer {layer} (N={best['N']} K={best['K']}): default {default} us, "
                      f"best {best['us']} us {best['cfg']}; next: "
                      + "; ".join(f"{r['us']} {tuple(r['cfg'].values())}" for r in mine[1:4]))


if __name__ == "__main__":
    main()
