"""Does the tuner pick what the benchmark finds fastest? For each shape the tuner's own timing
(``tuning.time_configs`` over every candidate kernel and config, as ``fused_linear`` tunes
on a first call, at the batch bucket's largest M) is repeated ``--rounds`` times; then every round's pick and the configs the tuner
ranked best are timed again the way ``bench/kernels.py`` times an impl (fresh random sets, CUDA-graph
replays, interleaved rounds), next to cuBLASLt's fused epilogue.

Run on a CUDA GPU from the repository root:

    python bench/tuner_check.py --shapes 64x4096x4096,32x11008x4096 --dtype bfloat16 --out tuner_check.jsonl

Each line of the output is one of:
  {"kind": "round", "M", "N", "K", "dtype", "round", "pick": [kernel, config], "first": [[ms, kernel, config], ...]}
     (the round's first-pass medians, fastest first; the pick comes from its final interleaved pass)
  {"kind": "bench", "M", "N", "K", "dtype", "kernel", "config", "us", "picked": rounds that picked it,
   "tuner_ms": its median first-pass time over the rounds}
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import kernels as kbench  # noqa: E402  (needs sys.path)
from bench.json_lines import JsonLines  # noqa: E402
from fusedserve.kernels import choosing, registry  # noqa: E402
from fusedserve.kernels.family import config_str  # noqa: E402
from fusedserve.kernels.rules import bucket_rows, problem_of  # noqa: E402
from fusedserve.kernels.timers import default_timer  # noqa: E402
from fusedserve.kernels.tuning import rotating_sets, time_configs  # noqa: E402


def _shapes(text):
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def _key(kernel, config):
    return kernel, config_str(config)


def tuner_rounds(M, N, K, dtype, rounds, sets):
    """``rounds`` times the tuner's full timing on copies of the first set: [(pick, first-pass)]."""
    x, w, b = sets[0]
    x_timed = bucket_rows(x)  # as choosing times a bucket: at its largest M
    problem = problem_of(x_timed, w)
    options = [(f.name, c) for f in registry.offered(problem_of(x, w)) for c in f.candidates(problem)]
    results = []
    for _ in range(rounds):
        copies = rotating_sets(x_timed, w, b)
        turn = iter(range(1 << 62))

        def run(option, copies=copies, turn=turn):
            xs, ws, bs = copies[next(turn) % len(copies)]
            return choosing.launch(choosing.Choice(*option, tuned=False), xs, ws, bs, "relu")

        timings, best = time_configs(options, run, timer=default_timer(len(copies)))
        del copies
        results.append((best, sorted(timings, key=lambda t: t[0])))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=_shapes, required=True, help="MxNxK,...")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3, help="tuner runs per shape")
    parser.add_argument("--top", type=int, default=4, help="also bench this many of the tuner's fastest")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved replays per bench timing")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new shape after this")
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tuner_check needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    start = time.monotonic()
    with JsonLines(args.out) as out:
        for M, N, K in args.shapes:
            if time.monotonic() - start > args.budget_s:
                print(f"budget spent: {M}x{N}x{K} and later shapes not checked", flush=True)
                break
            shape = dict(M=M, N=N, K=K, dtype=args.dtype)
            sets = kbench.make_sets(M, N, K, dtype)
            rounds = tuner_rounds(M, N, K, dtype, args.rounds, sets)
            first_ms = {}
            picks = {}
            for r, (best, timings) in enumerate(rounds):
                picks.setdefault(_key(*best), []).append(r)
                for ms, option in timings:
                    first_ms.setdefault(_key(*option), []).append(ms)
                out.emit(dict(kind="round", **shape, round=r, pick=list(_key(*best)),
                              first=[[round(ms, 5), *_key(*option)] for ms, option in timings]))
            by_tuner = sorted(first_ms, key=lambda k: statistics.median(first_ms[k]))
            chosen = list(dict.fromkeys([*picks, *by_tuner[:args.top]]))
            options = {_key(*o): o for _, o in rounds[0][1]}
            graphs = {}
            for key in chosen:
                name, config = options[key]
                choice = choosing.Choice(name, config, tuned=False)
                fn = lambda x, w, b, choice=choice: choosing.launch(choice, x, w, b, "relu")  # noqa: E731
                kbench.check(fn, *sets[0])
                graphs[key] = kbench.capture(fn, sets, M, N, K, dtype)
            peer = lambda x, w, b: torch._addmm_activation(b, x, w.t())  # noqa: E731
            graphs[("cublaslt_fused", "")] = kbench.capture(peer, sets, M, N, K, dtype)
            for (name, config), us in kbench.time_graphs(graphs, args.repeats).items():
                tuner = first_ms.get((name, config))
                out.emit(dict(kind="bench", **shape, kernel=name, config=config, us=round(us, 3),
                              picked=picks.get((name, config), []),
                              tuner_ms=None if tuner is None else round(statistics.median(tuner), 5)))
                print(f"{M}x{N}x{K} {args.dtype} {name:22s} {us:8.2f} us  tuner "
                      f"{'-' if tuner is None else f'{statistics.median(tuner) * 1e3:8.2f} us'}  "
                      f"picked in rounds {picks.get((name, config), [])}  {config}", flush=True)
            del graphs, sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
