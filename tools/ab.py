"""Compare two versions of the kernels from ``bench/kernels.py`` runs made in alternation.

Run on any machine (no GPU needed) over runs made A, B, A, B, ... in one GPU session (``tools/gpu_check.sh
ab`` makes them, each run in a ``kernels.jsonl`` of its own; ``FILE.jsonl:LINE`` names one line of a file):

    python tools/ab.py --a DIR/a_1/kernels.jsonl DIR/a_2/kernels.jsonl --b DIR/b_1/kernels.jsonl ...
                       [--names main experiment/x] [--out bench/results]

A kernel measured in one process can be ~5% faster or slower in the next (seen on the H200: the
same GEMV at 9.86 and 10.22 us a minute apart), so one A run against one B run cannot tell a 3%
change from noise. With the runs alternated, each version's time per (shape, impl) is the median
of its runs, and the peers (torch's impls, which neither version changes) are the control: their
B / A ratios show how far the two sides' machines drifted, and a change to ours is only news where
it exceeds that. Prints, per shape, ours (each fusedserve impl) and the peers, with B / A; with
``--out DIR`` appends the same as a line of ``DIR/ab.jsonl`` (``bench/runs.py``).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs as stored  # noqa: E402

PEERS = ("torch_unfused", "cublaslt_fused", "torch_compile")


def times(specs):
    """{(M, N, K, dtype, impl): [median_us of each run]} over the runs ``specs`` name."""
    found = {}
    for spec in specs:
        for row in stored.pick(spec)["rows"]:
            if "median_us" in row:
                key = (row["M"], row["N"], row["K"], row["dtype"], row["impl"])
                found.setdefault(key, []).append(row["median_us"])
    return found


def compare(a_specs, b_specs):
    """Rows {M, N, K, dtype, impl, peer, a_us, b_us, b_over_a} for every (shape, impl) both sides
    measured; ``a_us``/``b_us`` are medians over each side's runs."""
    a, b = times(a_specs), times(b_specs)
    rows = []
    for key in sorted(a.keys() & b.keys(), key=lambda k: (k[3], k[1], k[2], k[0], k[4])):
        a_us, b_us = statistics.median(a[key]), statistics.median(b[key])
        M, N, K, dtype, impl = key
        rows.append(dict(M=M, N=N, K=K, dtype=dtype, impl=impl, peer=impl in PEERS, a_runs=len(a[key]),
                         b_runs=len(b[key]), a_us=round(a_us, 3), b_us=round(b_us, 3),
                         b_over_a=round(b_us / a_us, 4)))
    return rows


def runs(specs, side):
    """Where and when each run was made: {side, run, gpu, commit, date, torch, triton} per run."""
    described = []
    for spec in specs:
        run = stored.pick(spec)
        described.append(dict(side=side, run=str(spec),
                              **{key: run.get(key) for key in ("gpu", "commit", "date", "torch", "triton")}))
    return described


def summary(rows) -> dict:
    """The spread of B / A over the peers (the drift between the sides) and over ours."""
    def spread(values):
        return [min(values), max(values)] if values else None

    return {"peers_b_over_a": spread([r["b_over_a"] for r in rows if r["peer"]]),
            "ours_b_over_a": spread([r["b_over_a"] for r in rows if not r["peer"]])}


def report(rows):
    lines = []
    shapes = {}
    for r in rows:
        shapes.setdefault((r["dtype"], r["N"], r["K"], r["M"]), []).append(r)
    for (dtype, N, K, M), group in shapes.items():
        peers = [r["b_over_a"] for r in group if r["peer"]]
        drift = f"peers B/A {min(peers):.3f}-{max(peers):.3f}" if peers else "no peers"
        lines.append(f"{dtype} M={M} N={N} K={K} ({drift})")
        for r in group:
            if not r["peer"]:
                lines.append(f"  {r['impl']:28s} A {r['a_us']:9.2f}  B {r['b_us']:9.2f}  B/A {r['b_over_a']:.3f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="+", required=True, help="version A's runs: kernels.jsonl[:LINE] ...")
    parser.add_argument("--b", nargs="+", required=True, help="version B's runs: kernels.jsonl[:LINE] ...")
    parser.add_argument("--out", type=Path, help="also append the comparison to OUT/ab.jsonl")
    parser.add_argument("--names", nargs=2, default=("A", "B"), metavar=("A", "B"),
                        help="what the two versions are (e.g. main experiment/x), kept in the JSON")
    args = parser.parse_args()
    rows = compare(args.a, args.b)
    if not rows:
        raise SystemExit("the two sides share no (shape, impl): nothing to compare")
    print(report(rows))
    if args.out:
        made = runs(args.a, "a") + runs(args.b, "b")
        line = stored.Run("ab", args.out, gpu=made[0]["gpu"], a=args.names[0], b=args.names[1], runs=made)
        line.save(rows, summary(rows))
        print(f"appended the comparison to {line.path}")


if __name__ == "__main__":
    main()
