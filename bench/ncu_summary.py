"""Print the counters that explain a GEMM from an Nsight Compute raw CSV (``ncu --csv --page raw``).

``bench/gpu_check.sh ncu`` writes one such file per kernel; each holds hundreds of metrics. This
prints, per profiled launch: the kernel's name (cuBLAS encodes its tile and cluster shape there),
grid and block, time, and every metric whose name matches one of the patterns (default: tensor-pipe
activity, shared-memory traffic, SM and DRAM throughput, and the warp stall reasons, largest first).

    python bench/ncu_summary.py ncu_gluon_ws_6_256x11008x4096.csv [--match REGEX ...]
"""

import argparse
import csv
import re
import sys

ALWAYS = ("Kernel Name", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
          "launch__shared_mem_per_block_dynamic", "gpu__time_duration.sum")
PATTERNS = (
    r"^sm__pipe_tensor.*pct_of_peak_sustained_(active|elapsed)$",
    r"^sm__inst_executed_pipe_tensor.*\.sum$",
    r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^gpu__compute_memory_throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^dram__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^dram__bytes_read\.sum$",
    r"^lts__t_sector_hit_rate\.pct$",
    r"^l1tex__data_pipe_lsu_wavefronts_mem_shared.*\.sum$",
    r"^l1tex__data_bank_conflicts_pipe_lsu_mem_shared.*\.sum$",
    r"^sm__cycles_active\.avg$",
    r"^gpc__cycles_elapsed\.max$",
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def read(path):
    """The raw page's rows as dicts (metric name -> (value, unit)), skipping ncu's own log lines."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    if len(lines) < 3:
        raise ValueError(f"{path}: no profiled kernel in it (was the -k filter right?)")
    table = list(csv.reader(lines))
    names, units = table[0], table[1]
    return [{n: (v, u) for n, u, v in zip(names, units, row)} for row in table[2:]]


def summarize(row, patterns):
    out = []
    for name in ALWAYS:
        if name in row:
            value, unit = row[name]
            out.append(f"{name:64s} {value} {unit}".rstrip())
    compiled = [re.compile(p) for p in patterns]
    for name in sorted(row):
        if name not in ALWAYS and any(p.search(name) for p in compiled):
            value, unit = row[name]
            out.append(f"{name:64s} {value} {unit}".rstrip())
    stalls = []
    for name, (value, _) in row.items():
        m = STALL.match(name)
        if m:
            try:
                stalls.append((float(value.replace(",", "")), m.group(1)))
            except ValueError:
                continue
    stalls.sort(reverse=True)
    if stalls:
        out.append("stalls per issued instruction: " + ", ".join(f"{n} {v:.2f}" for v, n in stalls[:8]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--match", action="append", help="a regex over metric names (replaces the defaults)")
    args = parser.parse_args(argv)
    status = 0
    for path in args.csv:
        try:
            rows = read(path)
        except (OSError, ValueError) as e:
            print(e, file=sys.stderr)
            status = 1
            continue
        for i, row in enumerate(rows):
            print(f"--- {path} launch {i}")
            print("\n".join(summarize(row, args.match or PATTERNS)))
    return status


if __name__ == "__main__":
    sys.exit(main())
