"""The GPU suite's record, so CPU-only CI can say whether the GPU tests ran on the code it tests.

The record names the git tree of ``kernels/`` and ``models/`` the suite ran on (computed from the
files, so it works on a copy without ``.git``), the GPU, torch and Triton, the date and pytest's
summary line of each part of the suite.

    python tools/gpu_record.py part NAME PYTEST_LOG OUT.json   # after one part of the suite (GPU host)
    python tools/gpu_record.py merge OUT.json PART.json ...    # the parts of one code version into one
    python tools/gpu_record.py check RECORD.json               # does it match this checkout? (CI)
"""

import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("kernels", "models")
SKIP = {"__pycache__"}


def tree_hash(path: Path) -> str:
    """What ``git rev-parse HEAD:<path>`` says of a committed folder, computed from its files."""
    entries = []
    for child in path.iterdir():
        if child.name in SKIP or child.suffix == ".pyc":
            continue
        if child.is_dir():
            entries.append((child.name + "/", b"40000 " + child.name.encode(), bytes.fromhex(tree_hash(child))))
        else:
            mode = b"100755 " if os.access(child, os.X_OK) else b"100644 "
            blob = bytes.fromhex(_git_hash(b"blob", child.read_bytes()))
            entries.append((child.name, mode + child.name.encode(), blob))
    body = b"".join(head + b"\0" + digest for _, head, digest in sorted(entries))
    return _git_hash(b"tree", body)


def _git_hash(kind: bytes, data: bytes) -> str:
    return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\0" + data).hexdigest()


def _summary(log: Path) -> str:
    """pytest's last summary line ("12 passed, 3 skipped in 40.1s"), or why there is none."""
    lines = [line.strip("= \n") for line in log.read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|error)", line)]
    return lines[-1] if lines else "no pytest summary in the log"


def part(name: str, log: Path, out: Path) -> dict:
    import torch
    import triton

    record = {"trees": {t: tree_hash(ROOT / t) for t in TREES}, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "parts": {name: _summary(log)}}
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def merge(out: Path, parts: list[Path]) -> dict:
    records = [json.loads(p.read_text()) for p in parts]
    if any(r["trees"] != records[0]["trees"] for r in records):
        sys.exit("the parts ran on different code: " + ", ".join(str(r["trees"]) for r in records))
    merged = dict(records[0], date=" / ".join(r["date"] for r in records),
                  parts={k: v for r in records for k, v in r["parts"].items()})
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return merged


def check(record_path: Path) -> bool:
    """Print whether the record is of this checkout's kernels/ and models/; True if it is."""
    if not record_path.is_file():
        print(f"GPU record: none at {record_path}; no GPU run of this code is on record")
        return False
    record = json.loads(record_path.read_text())
    here = {t: _committed_tree(t) for t in TREES}
    ran = "; ".join(f"{k}: {v}" for k, v in record["parts"].items())
    if record["trees"] == here:
        print(f"GPU record: matches kernels/ and models/ ({record['gpu']}, torch {record['torch']}, "
              f"triton {record['triton']}, {record['date']}): {ran}")
        return True
    stale = [t for t in TREES if record["trees"].get(t) != here[t]]
    print(f"GPU record: OUT OF DATE for {', '.join(stale)} (it ran {record['date']} on other code: {ran}); "
          "CI cannot run the GPU tests, so this code's GPU tests have not been run on record")
    return False


def _committed_tree(name: str) -> str:
    try:
        return subprocess.run(["git", "rev-parse", f"HEAD:{name}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return tree_hash(ROOT / name)


if __name__ == "__main__":
    verb, *rest = sys.argv[1:] or ["help"]
    if verb == "part" and len(rest) == 3:
        print(json.dumps(part(rest[0], Path(rest[1]), Path(rest[2]))))
    elif verb == "merge" and len(rest) >= 2:
        print(json.dumps(merge(Path(rest[0]), [Path(p) for p in rest[1:]])))
    elif verb == "check" and len(rest) == 1:
        check(Path(rest[0]))  # informational: CI prints it and goes on
    else:
        sys.exit(__doc__)
