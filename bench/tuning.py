"""How long tuning a model takes, and where the time goes: compiling or timing.

    python bench/tuning.py                      # two models, every bucket up to --max-batch-size
    python bench/tuning.py --models 1024-4096-1024:float16 --max-batch-size 128

For each model (``IN-HIDDEN...-OUT:DTYPE``, random weights) on a fresh tune cache and a fresh Triton
cache: warm every bucket on provisional choices (what start-up compiles), then tune every bucket as
the background tuner's worker does (``ModelRunner.tune``: every candidate of every layer and path
compiled and timed). Then the tune cache is emptied and the buckets tuned again in the same process,
whose compiled kernels are all in memory: that pass is the timing alone, so the difference is
compiling. ``--ahead`` measures the background tuner's way instead: every candidate compiled by
parallel processes without the GPU, bucket by bucket, each bucket tuned once its kernels are. Appends one line to
``OUT/tuning.jsonl``: per model and bucket, the seconds of each step (issue 36's target: a model's
background tuning within 20 s). ``--profile`` adds where the tuning calls' time goes, per model: a
cProfile dump beside the results and its top functions in the log.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402

DEFAULT_MODELS = ("512-2048-2048-2048-256:bfloat16", "1024-4096-1024:float16")


def parse_model(text: str) -> tuple[list[int], str]:
    widths, _, dtype = text.partition(":")
    sizes = [int(w) for w in widths.split("-")]
    if len(sizes) < 2 or min(sizes) < 1 or dtype not in ("float32", "float16", "bfloat16"):
        raise argparse.ArgumentTypeError(f"expected IN-HIDDEN...-OUT:DTYPE, got {text!r}")
    return sizes, dtype


def fresh_caches() -> None:
    """An empty tune cache for what follows in this process (Triton keeps its compiled kernels)."""
    from fusedserve.kernels import choosing, tune_cache

    os.environ[tune_cache.ENV_VAR] = tempfile.mkdtemp(prefix="fusedserve-tune-")
    tune_cache.device_cache.cache_clear()
    choosing._provisional.clear()


def runner_for(sizes, dtype, max_batch_size):
    from fusedserve.models.mlp import MLP, MLPConfig
    from fusedserve.models.runner import ModelRunner

    config = MLPConfig(sizes[0], tuple(sizes[1:-1]), sizes[-1], "relu", dtype)
    model = MLP(config, backend="triton", device="cuda").eval().requires_grad_(False)
    runner = ModelRunner(model, max_batch_size=max_batch_size, cuda_graphs=False, provisional=True)
    runner.input_buffer.uniform_(0, 4)
    return runner


def seconds_of(fn, profiler: cProfile.Profile | None = None) -> float:
    """Seconds of ``fn()`` to the GPU's last kernel, under ``profiler`` where given."""
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        if profiler is not None:
            profiler.disable()
    return round(time.perf_counter() - start, 3)


def save_profile(profiler: cProfile.Profile, path: Path, log, top: int = 30) -> None:
    """``profiler``'s dump at ``path`` and its ``top`` functions by own and by cumulative time in the log."""
    profiler.dump_stats(path)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        log(f"profile by {order} ({path.name}):\n{text.getvalue()}")


def measure(sizes, dtype, max_batch_size, log) -> list[dict]:
    fresh_caches()
    runner = runner_for(sizes, dtype, max_batch_size)
    rows = [dict(model="-".join(map(str, sizes)), dtype=dtype, bucket=b, warm_s=seconds_of(lambda b=b: runner.warm(b)))
            for b in runner.buckets]
    for row in rows:
        row["tune_cold_s"] = seconds_of(lambda b=row["bucket"]: runner.tune(b))
    fresh_caches()
    for row in rows:
        row["tune_timing_only_s"] = seconds_of(lambda b=row["bucket"]: runner.tune(b))
        log(f"  {row}")
    return rows


def measure_ahead(sizes, dtype, max_batch_size, log, profiler=None) -> list[dict]:
    """The background tuner's way (``--ahead``): on a fresh Triton cache, processes that need no GPU
    compile every candidate bucket by bucket (``models.aot.compile_candidates_ahead``) while this
    process tunes each bucket as soon as its kernels are compiled (``waited_s`` for them), which should
    only time (kernels load from Triton's cache); what it still compiles is counted per kernel
    (``compiled_after``). ``ahead_compile_s``: the compile processes' span; ``total_s``: from their
    start to the last bucket tuned."""
    from fusedserve.models import aot

    fresh_caches()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    runner = runner_for(sizes, dtype, max_batch_size)
    rows, misses, start = [], [], time.perf_counter()
    triton.knobs.compilation.listener = lambda src, cache_hit, **_: misses.append(src.name) if not cache_hit else None
    try:
        with tempfile.TemporaryDirectory(prefix="compiled-") as directory:
            progress, compiled = aot.compile_candidates_ahead(
                aot.local_target(runner.device), "mlp", runner.model.config.to_dict(), max_batch_size, runner.buckets,
                directory)
            for b in runner.buckets:
                waited = progress.wait(b)
                misses.clear()
                rows.append(dict(model="-".join(map(str, sizes)), dtype=dtype, bucket=b, waited_s=round(waited, 3),
                                 tune_after_s=seconds_of(lambda b=b: runner.tune(b), profiler),
                                 compiled_after=dict(Counter(misses))))  # kernels the ahead pass missed
                log(f"  {rows[-1]}")
            ahead = compiled.result()[2]
    finally:
        triton.knobs.compilation.listener = None
    total = time.perf_counter() - start
    for row in rows:
        row.update(ahead_compile_s=round(ahead, 3), total_s=round(total, 3))
    return rows


def main(argv=None):
    from fusedserve.kernels import choosing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.arguments(parser)
    parser.add_argument("--models", nargs="+", type=parse_model, default=[parse_model(m) for m in DEFAULT_MODELS])
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--ahead", action="store_true",
                        help="the background tuner's way: candidates compiled ahead in parallel, then timed")
    parser.add_argument("--profile", action="store_true",
                        help="with --ahead: profile the tuning calls (OUT/tuning_profile_MODEL.pstats, top in the log)")
    parser.add_argument("--search", choices=choosing.SEARCHES, default=choosing.SEARCHES[0],
                        help="how widely tuning searches (kernels.choosing.SEARCH_ENV; default a server's)")
    args = parser.parse_args(argv)
    if args.profile and not args.ahead:
        parser.error("--profile profiles the background tuner's way: pass --ahead too")
    os.environ[choosing.SEARCH_ENV] = args.search  # here and in the compile processes
    if not torch.cuda.is_available():
        raise SystemExit("bench/tuning.py needs a CUDA GPU")
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    run = runs.Run("tuning", args.out, gpu=torch.cuda.get_device_name(), note=args.note, torch=torch.__version__,
                   mode="ahead" if args.ahead else "in_process", search=args.search,
                   profiled=args.profile, max_batch_size=args.max_batch_size,
                   triton_cache="fresh" if "triton-cache-" in os.environ["TRITON_CACHE_DIR"] else "given")
    rows = []
    if args.ahead:  # as an engine starts it, before it loads its models
        from fusedserve.models import precompile

        precompile.start_compile_server()
    for sizes, dtype in args.models:
        log(f"model {sizes} {dtype}")
        profiler = cProfile.Profile() if args.profile else None
        rows += (measure_ahead(sizes, dtype, args.max_batch_size, log, profiler) if args.ahead
                 else measure(sizes, dtype, args.max_batch_size, log))
        if profiler is not None:
            save_profile(profiler, args.out / f"tuning_profile_{'-'.join(map(str, sizes))}_{dtype}.pstats", log)
        mine = [r for r in rows if r["model"] == "-".join(map(str, sizes)) and r["dtype"] == dtype]
        totals = {k: round(sum(r[k] for r in mine), 1) for k in mine[0] if k.endswith("_s")}
        if args.ahead:  # spans, not sums over buckets
            totals.update(ahead_compile_s=mine[0]["ahead_compile_s"], total_s=mine[0]["total_s"])
        log(f"model {sizes} {dtype}: {totals}")
        run.save(rows, complete=False)
    run.save(rows, complete=True)


if __name__ == "__main__":
    main()
