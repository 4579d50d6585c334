"""How good the provisional choices are on measured shapes the table has not seen, without a GPU.

For each run named (a ``bench/kernels.py`` run with tuned rows), the table is built from the other
runs of its GPU (``tools/provisional_table.py``'s rule), and the provisional choice that
``kernels.provisional`` makes today is taken for each of its shapes (static weights, as a served
layer). Against the tuned winner of the run: the same family (its time about the tuned one, though
the config may differ), the vendor (its measured time, ``cublaslt_fused``), or another family (not
measured: unknown). Beside it, what the run itself measured of the provisional choice of its day.

    python tools/provisional_check.py bench/results/kernels.jsonl:32 bench/results/kernels.jsonl:33
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench import runs as stored  # noqa: E402
from fusedserve.kernels import choosing, provisional, registry  # noqa: E402
from fusedserve.kernels.rules import Problem  # noqa: E402
from fusedserve.kernels.vendor.cublas import NAME as VENDOR  # noqa: E402
from tools.provisional_table import parse_config, stored_runs, winners  # noqa: E402

SERVED, PROVISIONAL, PEER = "fusedserve_static_weight", "fusedserve_provisional", "cublaslt_fused"
HOPPER = (9, 0)


def table_without(runs: list[dict], held: dict) -> tuple:
    """The table entries ``runs`` other than ``held`` make, for ``held``'s GPU and Triton version."""
    others = [run for run in runs if run != held]
    chosen = winners(others).get((held["gpu"], held["triton"]), {})
    return tuple(provisional.Entry(*key, kernel, config) for key, (_, kernel, config) in sorted(chosen.items()))


def _same_family(kernel: str, config: dict, tuned: dict) -> bool:
    # triton_small_m's GEMV and tensor-core tiles are two kernels: the flag must match too.
    return kernel == tuned["kernel"] and bool(config.get("GEMV")) == ("GEMV=True" in tuned.get("config", ""))


def check(run: dict, entries: tuple, capability=HOPPER) -> list[dict]:
    """One row per shape of ``run`` that has tuned and provisional rows: the choice made today and
    its estimated time over the tuned one (None where not measured)."""
    shapes: dict = {}
    for row in run["rows"]:
        shapes.setdefault((row["M"], row["N"], row["K"], row["dtype"]), {})[row["impl"]] = row
    found = []
    for (M, N, K, dtype), rows in shapes.items():
        if SERVED not in rows or PROVISIONAL not in rows:
            continue
        problem = Problem(M, N, K, getattr(torch, dtype), capability, N % 8 == 0 and K % 8 == 0)
        kernel, config, source = provisional.provisional_choice(problem, registry.offered(problem), entries, True)
        tuned_us = rows[SERVED]["median_us"]
        same = _same_family(kernel, config, rows[SERVED])
        estimate = (1.0 if same else rows[PEER]["median_us"] / tuned_us if kernel == VENDOR and PEER in rows
                    else None)
        found.append(dict(M=M, N=N, K=K, dtype=dtype, tuned=rows[SERVED]["kernel"], choice=kernel, source=source,
                          same_family=same, estimate=estimate and round(estimate, 3),
                          measured_then=round(rows[PROVISIONAL]["median_us"] / tuned_us, 3),
                          **_near_search(problem, entries, rows[SERVED])))
    return found


def _near_search(problem: Problem, entries: tuple, tuned: dict) -> dict:
    """How many candidates a near search would time against a full one, and whether the full search's
    winner is among them (the vendor's by family: its config is a note, not a candidate's)."""
    families = registry.offered(problem)
    near, _ = choosing.search_list(problem, families, entries, True)
    winner = (tuned["kernel"], parse_config(tuned.get("config") or ""))
    held = any(kernel == VENDOR for kernel, _ in near) if winner[0] == VENDOR else winner in near
    return dict(near_candidates=len(near), full_candidates=len(choosing.every_candidate(families, problem)),
                near_holds_winner=held)


def summary(rows: list[dict]) -> str:
    known = [r["estimate"] for r in rows if r["estimate"] is not None]
    then = [r["measured_then"] for r in rows]
    return (f"{len(rows)} shapes; today's choice is the tuned family on "
            f"{sum(r['same_family'] for r in rows)}, estimated over 1.05x the tuned time on "
            f"{sum(e > 1.05 for e in known)} (worst {max(known, default=1.0)}x), unknown on {len(rows) - len(known)}; "
            f"as measured in the runs: over 1.05x on {sum(t > 1.05 for t in then)}, "
            f"median {round(statistics.median(then), 3) if then else None}x, worst {max(then, default=None)}x; "
            f"a near search would time {sum(r['near_candidates'] for r in rows)} candidates (full: "
            f"{sum(r['full_candidates'] for r in rows)}) and hold the full search's winner on "
            f"{sum(r['near_holds_winner'] for r in rows)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="kernels.jsonl:LINE ... (runs with provisional rows)")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.runs:
        held = stored.pick(spec)
        entries = table_without(list(stored_runs(held["gpu"]).values()), held)
        for row in check(held, entries):
            print(spec, row)
            rows.append(row)
    print(summary(rows))


if __name__ == "__main__":
    main()
