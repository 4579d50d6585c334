"""Compare two versions of the kernels from ``bench/kernels.py`` runs made in alternation.

Run on any machine (no GPU needed) over the JSON files of runs made A, B, A, B, ... in one GPU
session (``tools/gpu_check.sh ab`` makes them):

    python tools/ab.py --a DIR/a_1.json DIR/a_2.json --b DIR/b_1.json DIR/b_2.json [--out ab.json]
                       [--names main experiment/x]

A kernel measured in one process can be ~5% faster or slower in the next (seen on the H200: the
same GEMV at 9.86 and 10.22 us a minute apart), so one A run against one B run cannot tell a 3%
change from noise. With the runs alternated, each version's time per (shape, impl) is the median
of its runs, and the peers (torch's impls, which neither version changes) are the control: their
B / A ratios show how far the two sides' machines drifted, and a change to ours is only news where
it exceeds that. Prints, per shape, ours (each fusedserve impl) and the peers, with B / A; writes
the same as JSON with ``--out``.
"""

import argparse
import json
import statistics
from pathlib import Path

PEERS = ("torch_unfused", "cublaslt_fused", "torch_compile")


def times(paths):
    """{(M, N, K, dtype, impl): [median_us of each run]} over the runs in ``paths``."""
    found = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if "median_us" in row:
                key = (row["M"], row["N"], row["K"], row["dtype"], row["impl"])
                found.setdefault(key, []).append(row["median_us"])
    return found


def compare(a_paths, b_paths):
    """Rows {M, N, K, dtype, impl, peer, a_us, b_us, b_over_a} for every (shape, impl) both sides
    measured; ``a_us``/``b_us`` are medians over each side's runs."""
    a, b = times(a_paths), times(b_paths)
    rows = []
    for key in sorted(a.keys() & b.keys(), key=lambda k: (k[3], k[1], k[2], k[0], k[4])):
        a_us, b_us = statistics.median(a[key]), statistics.median(b[key])
        M, N, K, dtype, impl = key
        rows.append(dict(M=M, N=N, K=K, dtype=dtype, impl=impl, peer=impl in PEERS, a_runs=len(a[key]),
                         b_runs=len(b[key]), a_us=round(a_us, 3), b_us=round(b_us, 3),
                         b_over_a=round(b_us / a_us, 4)))
    return rows


def runs(paths, side):
    """Where and when each run was made: {side, file, gpu, date, torch, triton} per path."""
    described = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        described.append(dict(side=side, file=Path(path).name,
                              **{key: run.get(key) for key in ("gpu", "date", "torch", "triton")}))
    return described


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
    parser.add_argument("--a", nargs="+", required=True, help="kernels_*.json of version A's runs")
    parser.add_argument("--b", nargs="+", required=True, help="kernels_*.json of version B's runs")
    parser.add_argument("--out", type=Path, help="also write the comparison here as JSON")
    parser.add_argument("--names", nargs=2, default=("A", "B"), metavar=("A", "B"),
                        help="what the two versions are (e.g. main experiment/x), kept in the JSON")
    args = parser.parse_args()
    rows = compare(args.a, args.b)
    if not rows:
        raise SystemExit("the two sides share no (shape, impl): nothing to compare")
    print(report(rows))
    if args.out:
        args.out.write_text(json.dumps(dict(a=args.names[0], b=args.names[1],
                                            runs=runs(args.a, "a") + runs(args.b, "b"), rows=rows), indent=1))


if __name__ == "__main__":
    main()
