"""Build the provisional-choice table shipped in the package (``kernels/tables/``) from measured
kernel results: for every (dtype, batch bucket, N, K, static_weight) the family and config the
tuner chose in the newest run that measured it.

No GPU needed. From the repository root:

    python tools/provisional_table.py        # every H200 run in bench/results/kernels.jsonl
    python tools/provisional_table.py --gpu "NVIDIA H100 80GB HBM3" [--out DIR]
    python tools/provisional_table.py bench/results/kernels.jsonl:12 ...   # these runs only

Writes ``DIR/<gpu>-triton-<version>.json`` (default DIR: ``kernels/tables``) per GPU and Triton
version found: {"gpu", "triton", "sources", "fields", "entries": [[dtype, M, N, K, static_weight,
kernel, config], ...]}; a source is the run's line (``kernels.jsonl:12``), or the file a run was
converted from. ``kernels/provisional.py`` reads it.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench import runs as stored  # noqa: E402
from fusedserve.kernels.provisional import table_path  # noqa: E402  (sys.path)
from fusedserve.kernels.rules import SMALL_M_MAX, m_bucket  # noqa: E402
from fusedserve.kernels.vendor.cublas import NAME as VENDOR  # noqa: E402

FIELDS = ("dtype", "M", "N", "K", "static_weight", "kernel", "config")
# Runs before this date read float32 rows with K off a multiple of 16 4 bytes at a time (docs/kernels.md,
# "Rows 8 elements apart"): their winners at such K measured a handicap that is gone, and are left out.
ALIGNED_LOADS_SINCE = "2026-12-07"
# The impls whose rows name the tuner's choice, and whether they ran with static_weight.
IMPLS = {"fusedserve": False, "fusedserve_static_weight": True}


def parse_config(text: str) -> dict | None:
    """``"BLOCK_M=64,FMA=True"`` as ``{"BLOCK_M": 64, "FMA": True}``; None for a config some family
    describes in another form (it cannot be matched to a candidate). A trailing note in parentheses
    (``"op=linear (cuBLASLt addmm, then the activation)"``) is not part of the config."""
    config = {}
    for part in re.sub(r"\s*\(.*\)$", "", text).split(","):
        key, sep, value = part.partition("=")
        if not sep:
            return None
        config[key] = True if value == "True" else False if value == "False" else int(value) if value.lstrip(
            "-").isdigit() else value
    return config


def winners(runs) -> dict:
    """``{(gpu, triton): {(dtype, M bucket, N, K, static): (date, kernel, config)}}``, the newest run
    winning where several measured the same key. Where some run of a GPU had the vendor's family
    win somewhere, its runs in which it never won were (most likely) made before it competed: their
    winners past ``SMALL_M_MAX`` rows, where the vendor mostly wins, are left out. Runs whose tuner
    searched near the table (``bench/kernels.py --search near``) only echo it: left out."""
    runs = [run for run in runs if run.get("search", "full") == "full"]
    with_vendor = {(run["gpu"], run["triton"]) for run in runs if _vendor_won(run)}
    tables = {}
    for run in runs:
        gpu = (run["gpu"], run["triton"])
        chosen = tables.setdefault(gpu, {})
        small_only = gpu in with_vendor and not _vendor_won(run)
        for row in run["rows"]:
            if row.get("impl") not in IMPLS or "median_us" not in row or not row.get("kernel"):
                continue
            if small_only and row["M"] > SMALL_M_MAX:
                continue
            config = parse_config(row.get("config", ""))
            date = row.get("run", run["date"])
            if config is None or (row["dtype"] == "float32" and row["K"] % 16 and date < ALIGNED_LOADS_SINCE):
                continue
            key = (row["dtype"], m_bucket(row["M"]), row["N"], row["K"], IMPLS[row["impl"]])
            if key not in chosen or chosen[key][0] <= date:
                chosen[key] = (date, row["kernel"], config)
    return tables


def _vendor_won(run) -> bool:
    return any(row.get("kernel") == VENDOR for row in run["rows"])


def stored_runs(gpu: str, path: Path = stored.RESULTS / "kernels.jsonl") -> dict:
    """``{source: run}`` for every run of ``gpu`` in ``path``."""
    return {Path(run["source"]).name if run.get("source") else f"{path.name}:{n}": run
            for n, run in enumerate(stored.read(path), 1) if run["gpu"] == gpu}


def build(named_runs: dict, out: Path) -> list[Path]:
    """One table per (GPU, Triton version) from ``{source: run}``."""
    written = []
    for (gpu, version), chosen in winners(named_runs.values()).items():
        entries = [[*key, kernel, config] for key, (_, kernel, config) in sorted(chosen.items())]
        path = table_path(gpu, version, out)
        path.parent.mkdir(parents=True, exist_ok=True)
        sources = sorted(name for name, run in named_runs.items() if (run["gpu"], run["triton"]) == (gpu, version))
        data = dict(gpu=gpu, triton=version, sources=sources, fields=FIELDS, entries=entries)
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        written.append(path)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {len(entries)} entries")
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="kernels.jsonl:LINE ... (default: every run of --gpu)")
    parser.add_argument("--gpu", default="NVIDIA H200", help="whose runs in bench/results/kernels.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "kernels" / "tables")
    args = parser.parse_args()
    build({spec: stored.pick(spec) for spec in args.runs} if args.runs else stored_runs(args.gpu), args.out)


if __name__ == "__main__":
    main()
