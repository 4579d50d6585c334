"""Pieces of ``bench/kernels.py`` for shapes nobody benchmarked and for provisional choices: the
seeded random shapes of ``--random N --seed S``, the provisional choice as an impl of its own, and
the summaries (ours against the better peer; provisional against tuned) written into the results.
"""

import math
import random
import statistics

import torch

from fusedserve.kernels import choosing, provisional, registry
from fusedserve.kernels.device import cuda_name
from fusedserve.kernels.rules import problem_of

# --random draws M in [1, 8192] and N, K in [256, 16384], multiples of 8, each log-uniform (as
# many shapes below 64 rows, where serving lives, as above 1024), and bf16 or fp16 at random.
M_RANGE, NK_RANGE, NK_STEP = (1, 8192), (256, 16384), 8
RANDOM_DTYPES = (torch.bfloat16, torch.float16)
PEERS = ("torch_unfused", "cublaslt_fused")
# Issue 36's targets: ours at least this times the better peer at every shape, and in the median;
# our own families (not the vendor's) chosen on this share of shapes; the provisional choice at most
# this much slower than the tuned one; every answer within this times torch's own error.
MIN_RATIO, MEDIAN_RATIO, OWN_SHARE, PROVISIONAL_SLACK, ERROR_FACTOR = 0.97, 1.10, 0.60, 0.05, 2.0
VENDOR = "torch_cublas"
# Where the vendor won a shape, a random run also times our fastest family alone under this name.
OWN = "fusedserve_own"


def _log_uniform(rng: random.Random, low: int, high: int) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def draw_shapes(n: int, seed: int, dtypes=RANDOM_DTYPES) -> list[tuple[int, int, int, torch.dtype]]:
    """``n`` shapes ``(M, N, K, dtype)`` drawn from ``seed`` (the same seed draws the same shapes),
    each dtype drawn from ``dtypes``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)

    def nk():
        value = round(_log_uniform(rng, *NK_RANGE) / NK_STEP) * NK_STEP
        return min(max(value, NK_RANGE[0]), NK_RANGE[1])

    shapes = []
    for _ in range(n):
        M = min(max(round(_log_uniform(rng, *M_RANGE)), M_RANGE[0]), M_RANGE[1])
        shapes.append((M, nk(), nk(), rng.choice(tuple(dtypes))))
    return shapes


def _provisional(x, w) -> choosing.Choice:
    """The provisional choice for ``x @ w^T`` as a served layer's (static weights), whatever the
    tune cache holds: what a cold server runs before tuning."""
    problem = problem_of(x, w)
    families = registry.offered(problem)
    kernel, config, source = provisional.provisional_choice(problem, families, provisional.table(cuda_name(x.device)),
                                                            static_weight=True)
    return choosing.Choice(kernel, config, tuned=False, source=source)


def provisional_linear(x, w, b):
    """relu(x @ W^T + b) on the provisional choice."""
    return choosing.launch(_provisional(x, w), x, w, b, "relu", static_weight=True)


def describe_provisional(x, w) -> tuple[str, str]:
    """``(kernel, config)`` of the provisional choice, the config as kernel stats show it."""
    choice = _provisional(x, w)
    return choice.kernel, f"{choice.describe()} ({choice.source})"


def _own_choice(x, w, b) -> choosing.Choice:
    """The tuned choice for ``x @ w^T`` among our own families alone, the vendor's left out (a
    call in choosing mode "tune" times every candidate of theirs; later calls read it back)."""
    problem = problem_of(x, w)
    families = tuple(f for f in registry.offered(problem) if f.name != VENDOR)
    return choosing.choose(problem, x, w, b, "relu", static_weight=True, families=families)


def own_linear(x, w, b):
    """relu(x @ W^T + b) on the fastest of our own families: where the vendor won, by how much."""
    return choosing.launch(_own_choice(x, w, b), x, w, b, "relu", static_weight=True)


def describe_own(x, w, b) -> tuple[str, str]:
    """``(kernel, config)`` of ``own_linear``'s choice once tuned."""
    choice = _own_choice(x, w, b)
    return choice.kernel, choice.describe()


def _by_shape(rows):
    cells = {}
    for r in rows:
        if "median_us" in r:
            cells.setdefault((r["M"], r["N"], r["K"], r["dtype"]), {})[r["impl"]] = r
    return cells


def _spread(ratios):
    values = [r for _, r in ratios]
    return dict(min=round(min(values), 3), median=round(statistics.median(values), 3), shapes=len(values))


def peer_summary(rows, ours="fusedserve_static_weight"):
    """Ours against the better of ``PEERS`` per shape: min and median of (peer us / ours us), the
    shapes below ``MIN_RATIO``, the share of shapes our own families won (``own_share``), the
    shapes whose error exceeds ``ERROR_FACTOR`` times torch's, the slowest first call, and whether
    issue 36's targets are met. None without a full shape."""
    ratios, own, too_wrong, first_calls = [], 0, [], []
    for shape, cells in _by_shape(rows).items():
        peers = [cells[p] for p in PEERS if p in cells]
        if ours not in cells or not peers:
            continue
        mine = cells[ours]
        ratios.append((shape, min(p["median_us"] for p in peers) / mine["median_us"]))
        own += mine.get("kernel") != VENDOR
        torch_err = min(p.get("max_rel_err", float("inf")) for p in peers)
        if mine.get("max_rel_err", 0.0) > ERROR_FACTOR * max(torch_err, 1e-7):
            too_wrong.append(shape)
        first_calls += [mine["first_call_s"]] if "first_call_s" in mine else []
    if not ratios:
        return None
    summary = dict(impl=ours, **_spread(ratios), own_share=round(own / len(ratios), 3),
                   errors_over_torch=[dict(zip(("M", "N", "K", "dtype"), s, strict=True)) for s in too_wrong])
    if first_calls:
        summary["first_call_max_s"] = max(first_calls)
    summary["losing"] = [dict(M=M, N=N, K=K, dtype=dt, ratio=round(r, 3)) for (M, N, K, dt), r in sorted(ratios)
                         if r < MIN_RATIO]
    summary["met"] = (summary["min"] >= MIN_RATIO and summary["median"] >= MEDIAN_RATIO
                      and summary["own_share"] >= OWN_SHARE and not too_wrong)
    return summary


def provisional_summary(rows, tuned="fusedserve_static_weight", provisional_impl="fusedserve_provisional"):
    """The provisional choice against the tuned one per shape: (provisional us / tuned us) spread,
    the shapes more than ``PROVISIONAL_SLACK`` slower, and whether every shape is within it."""
    ratios = [(shape, cells[provisional_impl]["median_us"] / cells[tuned]["median_us"])
              for shape, cells in _by_shape(rows).items() if tuned in cells and provisional_impl in cells]
    if not ratios:
        return None
    worst = max(r for _, r in ratios)
    summary = dict(_spread(ratios), max=round(worst, 3))
    summary["slower"] = [dict(M=M, N=N, K=K, dtype=dt, ratio=round(r, 3)) for (M, N, K, dt), r in sorted(ratios)
                         if r > 1 + PROVISIONAL_SLACK]
    summary["met"] = worst <= 1 + PROVISIONAL_SLACK
    return summary


def print_summaries(log, summaries):
    for name, s in summaries.items():
        if s is None:
            continue
        log(f"\n{name}: min {s['min']:.3f}, median {s['median']:.3f}"
            + (f", max {s['max']:.3f}" if "max" in s else "")
            + (f", own families on {s['own_share']:.0%}" if "own_share" in s else "")
            + (f", first call <= {s['first_call_max_s']:.2f} s" if "first_call_max_s" in s else "")
            + f" over {s['shapes']} shapes: "
            + ("MET" if s["met"] else "MISS"))
        for r in s.get("losing", s.get("slower", [])):
            log(f"  M={r['M']} N={r['N']} K={r['K']} {r['dtype']}: {r['ratio']:.3f}")


def plot_ratios(rows, path, gpu, log):
    """Ours / better peer and provisional / tuned per shape against M."""
    try:
        import matplotlib
    except ImportError:
        log(f"matplotlib is not installed: no plot written to {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for (M, _, _, dt), cells in _by_shape(rows).items():
        peers = [cells[p]["median_us"] for p in PEERS if p in cells]
        ours = cells.get("fusedserve_static_weight")
        color = "C0" if dt == "bfloat16" else "C1"
        if ours and peers:
            axes[0].scatter(M, min(peers) / ours["median_us"], color=color, s=14)
        if ours and "fusedserve_provisional" in cells:
            axes[1].scatter(M, cells["fusedserve_provisional"]["median_us"] / ours["median_us"], color=color, s=14)
    axes[0].axhline(MIN_RATIO, color="k", ls="--")
    axes[0].set(xscale="log", xlabel="M", ylabel="better peer us / ours us", title="ours vs better peer")
    axes[1].axhline(1 + PROVISIONAL_SLACK, color="k", ls="--")
    axes[1].set(xscale="log", xlabel="M", ylabel="provisional us / tuned us", title="provisional vs tuned")
    fig.suptitle(f"{gpu}: relu(x @ W^T + b), cold L2 (blue bf16, orange fp16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")
