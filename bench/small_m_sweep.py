"""Sweep the weight-streaming kernel's configs with and without programmatic dependent launch
(PDL) and the weight prefetch, next to cuBLAS, at small M: the data behind ``kernels/triton/small_m.py``'s
candidate lists. For M > 64 it sweeps the TMA persistent kernel's candidates instead. With
``--kernel gluon`` it sweeps ``kernels/gluon/small_m.py`` (Hopper) at M <= 64 instead; with ``--kernel
ws`` (past M=64) the warp-specialized ``kernels/gluon/ws.py`` next to the TMA persistent kernel.

Run on a CUDA GPU from the repository root (stops starting new configs after --budget-s):

    python bench/small_m_sweep.py --out bench/results/small_m_sweep_h200.jsonl [--budget-s 280] [--kernel gluon|ws]
                                  [--shapes 256x4096x4096,512x4096x4096]

Each line of the output is one timing: {"M", "N", "K", "impl", "cfg", "pdl", "pre", "us"} (or
"err"), bf16, timed as ``bench/kernels.py`` times (cold L2, CUDA-graph replays). Every config runs
first with PDL and the prefetch (PDL alone for the TMA kernel past M=64, which has no prefetch);
the best three are then re-timed without PDL and with PDL alone, so each variant's worth is
measured on the same configs.

``bench/results/small_m_sweep_h200.jsonl`` (H200, 2026-12-02) came from this sweep's first draft:
the same plan, configs and timing; it also re-timed the TMA configs with the prefetch flag on,
which that kernel ignores.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import kernels as kbench  # noqa: E402  (needs sys.path)
from bench.json_lines import JsonLines  # noqa: E402
from fusedserve.kernels.gluon import small_m as gluon_small_m, ws as gluon_ws  # noqa: E402
from fusedserve.kernels.rules import SMS  # noqa: E402
from fusedserve.kernels.triton import small_m, tma_persistent  # noqa: E402

# (M, N, K), most telling first, in case the budget runs out.
PLAN = ((1, 4096, 4096), (16, 4096, 4096), (4, 4096, 4096), (1, 1024, 1024), (8, 1024, 1024),
        (64, 4096, 4096), (32, 4096, 4096), (1, 11008, 4096), (16, 8192, 8192), (512, 4096, 4096),
        (128, 4096, 4096), (1024, 4096, 4096), (64, 1024, 1024))
# Tensor-core tiles (BLOCK_N, BLOCK_K, num_stages, num_warps) and GEMV tiles (BLOCK_N, BLOCK_K,
# num_warps, num_stages), wider than kernels/triton/small_m.py's candidate lists, which come from this sweep.
TC_TILES = ((16, 256, 4, 4), (16, 512, 3, 4), (32, 256, 4, 4), (32, 128, 6, 4), (64, 128, 5, 4), (64, 256, 3, 4))
GEMV_TILES = ((16, 512, 4, 3), (8, 512, 4, 3), (32, 256, 4, 3), (16, 256, 4, 4), (8, 1024, 4, 2),
              (16, 1024, 8, 2), (4, 1024, 4, 3))
MAX_PROGRAMS = 1100
# Gluon swap-AB tiles (BLOCK_N, BLOCK_K), each with the deepest ring that fits (64 x 128 also 4 deep).
GLUON_TILES = ((64, 64), (64, 128), (64, 256), (128, 64), (128, 128), (128, 256))
GLUON_PLAN = ((1, 4096, 4096), (16, 4096, 4096), (4, 4096, 4096), (64, 4096, 4096), (1, 1024, 1024),
              (8, 1024, 1024), (32, 4096, 4096), (128, 4096, 4096), (1, 11008, 4096), (16, 8192, 8192))


def sweep_configs(M, N):
    configs = []
    for bn, bk, stages, warps in TC_TILES:
        configs += [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=warps, num_stages=stages)
                    for s in (1, 2, 4, 8) if triton.cdiv(N, bn) * s <= MAX_PROGRAMS]
    if M <= 8:
        for bn, bk, warps, stages in GEMV_TILES:
            gemv = [dict(GEMV=True, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=warps, num_stages=stages)
                    for s in (1, 2, 4) if triton.cdiv(N, bn) * s <= MAX_PROGRAMS]
            # One row: also with W read as int32 pairs of bf16 (small_m._w_tile).
            configs += gemv + ([dict(c, PAIRS=True) for c in gemv] if M == 1 else [])
    return configs


def gluon_configs(M, N, K):
    configs = []
    for bn, bk in GLUON_TILES:
        deepest = gluon_small_m._SMEM_BUDGET // ((bn + gluon_small_m.block_m(M)) * bk * 2)
        for stages in sorted({min(12, deepest), 4 if (bn, bk) == (64, 128) else deepest}):
            if 3 <= stages <= deepest:
                configs += [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, STAGES=stages, num_warps=4)
                            for s in (1, 2, 4, 8) if triton.cdiv(N, bn) * s <= 4 * SMS
                            and (s == 1 or triton.cdiv(K, bk) >= 2 * s)]
    return configs


def launcher(module, config, pdl, prefetch):
    def run(x, w, b):
        out = torch.empty((x.shape[0], w.shape[0]), device=x.device, dtype=x.dtype)
        return module.launch(x, w, b, "relu", out, config, input_precision="tf32", upcast_bf16=False,
                             pdl=pdl, prefetch_weight=prefetch)
    return run


def timed(fn, sets, M, N, K):
    try:
        return kbench.measure(fn, sets, M, N, K, torch.bfloat16, repeats=9)[0], None
    except Exception as e:  # a config that does not fit is recorded, and the sweep goes on
        return None, f"{type(e).__name__}: {str(e)[:150]}"


def sweep_shape(M, N, K, emit, deadline, kernel="triton"):
    sets = kbench.make_sets(M, N, K, torch.bfloat16)
    peers = {"cublaslt_fused": lambda x, w, b: torch._addmm_activation(b, x, w.t()),
             "torch_unfused": kbench.relu_linear}
    for name, fn in peers.items():
        us, err = timed(fn, sets, M, N, K)
        emit(dict(M=M, N=N, K=K, impl=name, us=us, err=err))
    if kernel == "gluon":
        plans = [(gluon_small_m, gluon_configs(M, N, K))]
    elif kernel == "ws":  # the warp-specialized kernel next to the TMA kernel it would replace
        plans = [(tma_persistent, tma_persistent.candidates(M, N, K, torch.bfloat16)),
                 (gluon_ws, gluon_ws.candidates(M, N, K, torch.bfloat16))]
    else:
        plans = [(small_m, sweep_configs(M, N)) if M <= 64
                 else (tma_persistent, tma_persistent.candidates(M, N, K, torch.bfloat16))]
    first = (True, M <= 64 or kernel == "gluon")  # PDL, and the weight prefetch wherever the kernel has one
    timings = []
    for module, configs in plans:
        for config in configs:
            if time.monotonic() > deadline:
                return
            us, err = timed(launcher(module, config, *first), sets, M, N, K)
            emit(dict(M=M, N=N, K=K, impl=module.NAME, cfg=config, pdl=first[0], pre=first[1], us=us, err=err))
            if us is not None:
                timings.append((us, module, config))
    for _, module, config in sorted(timings, key=lambda t: t[0])[:3]:
        for variant in {(False, False), (True, False), first} - {first}:
            us, err = timed(launcher(module, config, *variant), sets, M, N, K)
            emit(dict(M=M, N=N, K=K, impl=module.NAME, cfg=config, pdl=variant[0], pre=variant[1], us=us, err=err))
    del sets
    torch.cuda.empty_cache()


def _shapes(text):
    try:
        return [tuple(int(v) for v in shape.split("x", 2)) for shape in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK,..., got {text!r}") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON-lines file to write")
    parser.add_argument("--budget-s", type=float, default=280.0, help="start no new config after this")
    parser.add_argument("--kernel", choices=("triton", "gluon", "ws"), default="triton",
                        help="sweep the Triton weight-streaming kernels (default), the Gluon one, or (ws, "
                             "past M=64) the warp-specialized Gluon kernel's configs next to the TMA kernel's")
    parser.add_argument("--shapes", type=_shapes, help="MxNxK,... to sweep instead of the plan")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("small_m_sweep.py needs a CUDA GPU")
    deadline = time.monotonic() + args.budget_s
    with JsonLines(args.out) as out:
        for M, N, K in args.shapes or (GLUON_PLAN if args.kernel == "gluon" else PLAN):
            if time.monotonic() > deadline:
                print(f"budget of {args.budget_s} s spent before M={M} N={N} K={K}")
                break
            sweep_shape(M, N, K, out.emit, deadline, kernel=args.kernel)
            here = [r for r in out.rows if (r["M"], r["N"], r["K"]) == (M, N, K) and r["us"] is not None]
            peers = {r["impl"]: round(r["us"], 2) for r in here if "cfg" not in r}
            print(f"M={M} N={N} K={K} peers {peers}")
            for r in sorted((r for r in here if "cfg" in r), key=lambda r: r["us"])[:5]:
                print(f"  {r['us']:8.2f} us  {r['impl']}  pdl={r['pdl']:d} prefetch={r['pre']:d}  {r['cfg']}")


if __name__ == "__main__":
    main()
