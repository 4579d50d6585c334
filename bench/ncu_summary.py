"""Print the counters that explain a GEMM from an Nsight Compute raw CSV (``ncu --csv --page raw``).

``bench/gpu_check.sh ncu`` writes one such file per kernel; each holds hundreds of metrics. This
prints, per profiled launch: the kernel's name (cuBLAS encodes its tile and cluster shape there),
grid and block, time, and every metric whose name matches one of the patterns (default: tensor-pipe
activity, shared-memory traffic, SM and DRAM throughput, and the warp stall reasons, largest first).

    python bench/ncu_summary.py ncu_gluon_ws_6_256x11008x4096.csv [--match REGEX ...] [--json OUT]

``--json`` also writes the same selection as one JSON list (file, launch, metrics, stalls), small
enough to commit next to the benchmarks (the raw files are ~160 KB each).
"""

import argparse
import csv
import json
import re
import sys
from pathlib import Path

ALWAYS = ("Kernel Name", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
          "launch__shared_mem_per_block_dynamic", "gpu__time_duration.sum")
PATTERNS = (
    r"^sm__pipe_tensor_op_hmma_cycles_active\.avg\.pct_of_peak_sustained_(active|elapsed)$",
    r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^dram__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^dram__bytes_read\.sum$",
    r"^lts__t_sector_hit_rate\.pct$",
    r"^l1tex__data_pipe_lsu_wavefronts_mem_shared\.sum(\.pct_of_peak_sustained_elapsed)?$",
    r"^l1tex__data_bank_(reads|writes)\.avg\.pct_of_peak_sustained_elapsed$",
    r"^l1tex__data_bank_conflicts_pipe_lsu_mem_shared\.sum$",
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
    """(metrics, stalls): the ALWAYS fields and every metric matching a pattern, name -> "value unit";
    the warp stall reasons per issued instruction, largest first."""
    compiled = [re.compile(p) for p in patterns]
    names = [n for n in ALWAYS if n in row]
    names += [n for n in sorted(row) if n not in ALWAYS and any(p.search(n) for p in compiled)]
    metrics = {n: " ".join(v for v in row[n] if v) for n in names}
    stalls = []
    for name, (value, _) in row.items():
        m = STALL.match(name)
        if m:
            try:
                stalls.append((float(value.replace(",", "")), m.group(1)))
            except ValueError:
                continue
    stalls.sort(reverse=True)
    return metrics, {n: v for v, n in stalls}


def _text(metrics, stalls):
    lines = [f"{name:64s} {value}".rstrip() for name, value in metrics.items()]
    if stalls:
        top = list(stalls.items())[:8]
        lines.append("stalls per issued instruction: " + ", ".join(f"{n} {v:.2f}" for n, v in top))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--match", action="append", help="a regex over metric names (replaces the defaults)")
    parser.add_argument("--json", type=Path, help="also write the selection here as JSON")
    args = parser.parse_args(argv)
    status, records = 0, []
    for path in args.csv:
        try:
            rows = read(path)
        except (OSError, ValueError) as e:
            print(e, file=sys.stderr)
            status = 1
            continue
        for i, row in enumerate(rows):
            metrics, stalls = summarize(row, args.match or PATTERNS)
            print(f"--- {path} launch {i}")
            print("\n".join(_text(metrics, stalls)))
            records.append({"file": Path(path).name, "launch": i, "metrics": metrics, "stalls": stalls})
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
