"""Where ``ModelRunner.run``'s host time goes: ``run`` against itself with one step replaced.

    python bench/host_path.py 352-328-96-2800-144:float32:6 8-160-736:float32:44 [--at-ready]

For each ``WIDTHS:DTYPE:BATCH`` (random weights; at ready on provisional choices, else each measured
bucket tuned first) a runner is built (with ``graph_copies``, its default: each bucket's graph holds
its copies in and out), and ``run(rows)`` is alternated (``bench/timing.py``) with variants of itself, each with one
step done the peer's way (``bench/model_contract.py``'s torch CUDA graph contract): ``staged`` (the
rows copied in and out around the plain graph, as ``run`` does without ``graph_copies`` and as the
peer does), ``no_check`` (the rows' checks skipped), ``no_lock`` (no lock around the batch),
``peer_style`` (the whole call as the peer makes its own, ``RunnerAsPeer``), ``no_pdl`` (a second
runner of the same model whose kernels are plain launches, not programmatic dependent ones: the one
way left in which our graph differs from the peer's) and the peer itself; ``control`` changes
nothing, at the cost of changing it (what the others' figures include).
A row per (model, batch, variant): ``run`` us, the variant's us, and ``saved_us``, what the variant
saves (medians of ``ROUNDS`` alternations), with ``saved_spread_us``, the least and most one round
saved: a step worth less than that spread is below what the run resolves. Appends one line to
``OUT/host_path.jsonl``.
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402
from bench.model_contract import RunnerAsPeer, TorchGraphContract, build  # noqa: E402
from bench.timing import alternate  # noqa: E402

# 200 calls of each side a round: run() moved 50-66 us between 80-call rounds (host_path.jsonl:1).
CALLS, ROUNDS = 1800, 9
# A server's batch cap: a batch runs padded to its bucket, as served (6 rows as 8, 44 as 64).
MAX_BATCH = 1024


def parse_case(text: str) -> tuple[tuple, int]:
    """``352-328-96-2800-144:float32:6`` as (model spec, batch)."""
    try:
        widths, dtype, batch = text.split(":")
        sizes = [int(w) for w in widths.split("-")]
        batch = int(batch)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHS:DTYPE:BATCH, got {text!r}") from None
    if len(sizes) < 2 or dtype not in ("float32", "float16", "bfloat16") or batch < 1:
        raise argparse.ArgumentTypeError(f"expected IN-...-OUT:float32|float16|bfloat16:BATCH, got {text!r}")
    return (f"host_{widths}", sizes[0], tuple(sizes[1:-1]), sizes[-1], dtype), batch


@contextlib.contextmanager
def replaced(obj, name, value):
    """The method ``obj.name`` shadowed by the instance attribute ``value`` for the block."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


@contextlib.contextmanager
def no_lock(runner):
    """The runner without its batch lock for the block."""
    lock, runner._lock = runner._lock, contextlib.nullcontext()
    try:
        yield
    finally:
        runner._lock = lock


@contextlib.contextmanager
def without_pdl():
    """Every launch plain (no programmatic dependent launch) for the block: each loaded kernels
    module's copy of ``device.pdl_supported`` (the one rule, imported by name) answers False."""
    from fusedserve.kernels import device

    rule = device.pdl_supported
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("fusedserve.kernels") and getattr(m, "pdl_supported", None) is rule]
    for m in modules:
        m.pdl_supported = lambda dev: False
    try:
        yield
    finally:
        for m in modules:
            m.pdl_supported = rule


@contextlib.contextmanager
def staged(runner):
    """The runner copying rows around its plain graphs for the block, its graphs with copies set aside."""
    served, runner._graphs.served = runner._graphs.served, {}
    try:
        yield
    finally:
        runner._graphs.served = served


def variants(runner, peer, x, plain_runner):
    """name -> a call alternated with ``run``: ``run`` with one step changed for that call only (the
    change made and undone around it, as ``control`` does with nothing changed), or the peer's way;
    ``plain_runner`` is the same model captured without programmatic dependent launches."""
    staging, as_peer = runner._staging, RunnerAsPeer(runner, x.shape[0])

    def within(context):
        def call():
            with context():
                return runner.run(x)
        return call

    return {
        "control": within(contextlib.nullcontext),
        "staged": within(lambda: staged(runner)),
        "no_check": within(lambda: replaced(staging, "check", lambda rows: rows.shape[0])),
        "no_lock": within(lambda: no_lock(runner)),
        "peer_style": lambda: as_peer(x),
        "no_pdl": lambda: plain_runner.run(x),
        "peer": lambda: peer(x),
    }


def savings(pairs) -> dict:
    """From each round's (run us, variant us): their medians, what the variant saves, and the least
    and most it saved in one round."""
    run_us, variant_us = (statistics.median(p[i] for p in pairs) for i in (0, 1))
    saved = [a - b for a, b in pairs]
    return dict(run_us=round(run_us, 2), variant_us=round(variant_us, 2), saved_us=round(run_us - variant_us, 2),
                saved_spread_us=[round(min(saved), 2), round(max(saved), 2)])


def measure(case, at_ready: bool, log) -> list[dict]:
    from fusedserve.models import ModelRunner

    spec, batch = case
    fused, reference = build(spec)
    runner = ModelRunner(fused, max_batch_size=max(batch, MAX_BATCH), provisional=at_ready)
    peer = TorchGraphContract(reference, batch)
    x = 4 * torch.rand(batch, fused.config.in_features)
    runner.run(x), peer(x)
    with without_pdl():  # warmed and captured here, so its graphs hold plain launches
        plain_runner = ModelRunner(fused, max_batch_size=max(batch, MAX_BATCH), provisional=at_ready)
        plain_runner.run(x)
    rows = []
    for name, call in variants(runner, peer, x, plain_runner).items():
        pairs = [alternate(lambda: runner.run(x), call, CALLS // ROUNDS) for _ in range(ROUNDS)]
        row = dict(model=spec[0], dtype=spec[4], batch=batch, variant=name, at_ready=at_ready, **savings(pairs))
        rows.append(row)
        log(f"{spec[0]} {spec[4]} batch {batch}: {name} saves {row['saved_us']:+.2f} us "
            f"(rounds {row['saved_spread_us'][0]:+.2f} to {row['saved_spread_us'][1]:+.2f}; "
            f"run {row['run_us']:.2f}, variant {row['variant_us']:.2f})")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.arguments(parser)
    parser.add_argument("cases", nargs="+", type=parse_case, help="WIDTHS:DTYPE:BATCH, e.g. 8-160-736:float32:44")
    parser.add_argument("--at-ready", action="store_true", help="provisional choices, as a server before tuning")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/host_path.py needs a CUDA GPU")
    from fusedserve.kernels import tune_cache

    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    directory = tempfile.mkdtemp(prefix="fusedserve-tune-")  # a fresh tune cache: nothing tuned before
    os.environ[tune_cache.ENV_VAR] = directory
    tune_cache.device_cache.cache_clear()
    run = runs.Run("host_path", args.out, gpu=torch.cuda.get_device_name(), note=args.note, torch=torch.__version__,
                   at_ready=args.at_ready)
    rows = []
    for case in args.cases:
        rows += measure(case, args.at_ready, log)
        run.save(rows, complete=False)
    run.save(rows, complete=True)


if __name__ == "__main__":
    main()
