"""Time one kernel family's configs against the library at chosen shapes: what its candidates miss.

    python bench/configs.py gluon_small_m 33x3752x10224 34x4816x1736:float16 \\
        --vary BLOCK_N=128,num_warps=8 SPLIT_K=4

At each shape (``MxNxK``, bf16 unless ``:float16``), ``relu(x @ W^T + b)`` with static weights, as a
served layer runs: the family's own candidates are timed once each (the tuner's first round); then
its ``--top`` fastest, each of them again with every ``--vary`` set of values applied (a config that
does not fit the GPU is skipped), and the library's two ops (``torch_cublas``) are timed in
interleaved rounds over rotating weight copies (L2 cold). Every config is checked against a float64
reference first. Appends one line to ``OUT/configs.jsonl``: per shape and config its median us and
weight TB/s; the summary gives per shape the library's time over the best own and best varied config.
"""

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402

ROUNDS, REPEATS = 4, 5


def parse_shape(text: str) -> tuple[int, int, int, torch.dtype]:
    dims, _, dtype = text.partition(":")
    try:
        M, N, K = (int(v) for v in dims.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK[:dtype], got {text!r}") from None
    if dtype not in ("", "bfloat16", "float16") or min(M, N, K) < 1:
        raise argparse.ArgumentTypeError(f"expected MxNxK[:bfloat16|float16], got {text!r}")
    return M, N, K, getattr(torch, dtype or "bfloat16")


def parse_vary(text: str) -> dict:
    """``BLOCK_N=128,num_warps=8`` as ``{"BLOCK_N": 128, "num_warps": 8}`` (ints and booleans)."""
    values = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if not key or not value:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE,..., got {text!r}")
        values[key] = value == "True" if value in ("True", "False") else int(value)
    return values


def layer(M, N, K, dtype):
    """``x``, ``W``, ``b`` on the GPU, drawn as ``bench/kernels.py`` draws them."""
    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
    return x, w, torch.randn(N, device="cuda").to(dtype)


def sampler_for(family, config, args):
    """A sampler ``repeats -> [ms, ...]`` of ``config`` over rotating copies of ``args``, launched as
    the tuner launches a candidate, or None where the config does not fit; raises where its answer
    is wrong (``bench/kernels.py``'s float64 check)."""
    from bench.kernels import check
    from fusedserve.kernels import choosing
    from fusedserve.kernels.timers import DOES_NOT_FIT, default_timer
    from fusedserve.kernels.tuning import rotating_sets

    choice = choosing.Choice(family.name, config, tuned=False)
    sets, turn = rotating_sets(*args), itertools.count()

    def run():
        return choosing.launch(choice, *sets[next(turn) % len(sets)], "relu", static_weight=True)

    try:
        check(lambda x, w, b: choosing.launch(choice, x, w, b, "relu", static_weight=True), *args)
        return default_timer(len(sets))(run)
    except DOES_NOT_FIT:
        return None


def measure(family_name, shape, vary, top, log):
    """Rows for one shape: the first round of the family's candidates, then the final rounds."""
    from fusedserve.kernels import registry
    from fusedserve.kernels.rules import problem_of

    M, N, K, dtype = shape
    args = layer(M, N, K, dtype)
    family, vendor = registry.family(family_name), registry.family("torch_cublas")
    first = []
    for config in family.candidates(problem_of(args[0], args[1])):
        sampler = sampler_for(family, config, args)
        if sampler is not None:
            first.append((statistics.median(sampler(REPEATS)), config))
    best = [c for _, c in sorted(first, key=lambda t: t[0])[:top]]
    finalists = [(family, c, "own") for c in best] + [(vendor, c, "library") for c in vendor.candidates(None)]
    for config in best:
        for values in vary:
            varied = {**config, **values}
            if all(varied != c for _, c, _ in finalists):
                finalists.append((family, varied, "varied"))
    samplers = [(f, c, kind, sampler_for(f, c, args)) for f, c, kind in finalists]
    samplers = [s for s in samplers if s[3] is not None]
    samples = {i: [] for i in range(len(samplers))}
    for _ in range(ROUNDS):
        for i, (*_, sampler) in enumerate(samplers):
            samples[i] += sampler(REPEATS)
    rows = [dict(M=M, N=N, K=K, dtype=str(dtype).removeprefix("torch."), family=f.name, kind=kind, config=c,
                 median_us=round(1e3 * statistics.median(samples[i]), 3),
                 tbps=round(N * K * args[1].element_size() / (1e6 * statistics.median(samples[i])), 3))
            for i, (f, c, kind, _) in enumerate(samplers)]
    log(f"{M}x{N}x{K} {dtype}: " + "; ".join(f"{r['kind']} {r['median_us']} us" for r in rows))
    return rows


def summary(rows):
    """Per shape: the library's best time over our best own config's and best varied config's."""
    shapes = {}
    for r in rows:
        shapes.setdefault((r["M"], r["N"], r["K"], r["dtype"]), {}).setdefault(r["kind"], []).append(r["median_us"])
    return [dict(M=M, N=N, K=K, dtype=dtype, own=round(min(t["library"]) / min(t["own"]), 3),
                 varied=round(min(t["library"]) / min(t["varied"]), 3) if "varied" in t else None)
            for (M, N, K, dtype), t in shapes.items() if "own" in t and "library" in t]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.arguments(parser)
    parser.add_argument("family", help="a kernel family's name, as kernels/registry.py lists them")
    parser.add_argument("shapes", nargs="+", type=parse_shape, help="MxNxK[:bfloat16|float16]")
    parser.add_argument("--vary", nargs="*", type=parse_vary, default=[], help="KEY=VALUE,... sets applied to the best")
    parser.add_argument("--top", type=int, default=3, help="how many of the family's fastest configs to vary")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/configs.py needs a CUDA GPU")
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    run = runs.Run("configs", args.out, gpu=torch.cuda.get_device_name(), note=args.note, torch=torch.__version__,
                   family=args.family, vary=args.vary)
    rows = []
    for shape in args.shapes:
        rows += measure(args.family, shape, args.vary, args.top, log)
        run.save(rows, summary(rows), complete=False)
    run.save(rows, summary(rows), complete=True)
    log(f"summary: {summary(rows)}")


if __name__ == "__main__":
    main()
