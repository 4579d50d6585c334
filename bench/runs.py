"""Every benchmark's runs, one appended JSONL file per benchmark: ``bench/results/<benchmark>.jsonl``.

A line is one run: ``benchmark``, ``gpu`` (None on a CPU box), ``commit`` (``FUSEDSERVE_COMMIT`` where
set, as on a GPU host given a copy of the tree; else HEAD's short hash, ``-dirty`` where tracked files
differ from it), ``date`` (UTC), ``seed`` (where shapes or inputs are random), ``quick``,
``rows`` (what the benchmark measured, one dict per row) and ``summary`` (its verdicts), then the
benchmark's own fields (versions, method, machine...). Lines are never edited once a run is over:
a line number names a run for good (``kernels.jsonl:12``, 1-based).

    python bench/runs.py show bench/results/kernels.jsonl   # one line per run: where, when, what
    python bench/runs.py add DIR_OR_FILE ...   # a GPU host's $OUT into bench/results (new lines only)
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
HEAD = ("benchmark", "gpu", "commit", "date", "seed", "quick", "rows", "summary")


def commit() -> str | None:
    """FUSEDSERVE_COMMIT where set (a copy's .git, if any, may not be of the tree it holds); else
    HEAD's short hash, with ``-dirty`` where tracked files differ from it; else None."""
    if os.environ.get("FUSEDSERVE_COMMIT"):
        return os.environ["FUSEDSERVE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark shares: where its line goes, a note kept in it, and a plot."""
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder of <benchmark>.jsonl, the run appended as one line (default bench/results)")
    parser.add_argument("--note", help="what this run is for (a branch, an A/B side...), kept in its line")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also draw the run's plot here")


class Run:
    """One run's line in ``OUT/<benchmark>.jsonl``. ``save`` appends it the first time and rewrites it
    in place after (the run's line is the file's last while it goes), so a run killed midway keeps
    what it had measured."""

    def __init__(self, benchmark: str, out: Path | None = None, *, gpu: str | None, quick: bool | None = None,
                 seed: int | None = None, **fields):
        self.path = Path(out or RESULTS) / f"{benchmark}.jsonl"
        self.head = dict(benchmark=benchmark, gpu=gpu, commit=commit(), date=now(), seed=seed, quick=quick)
        self.fields = {k: v for k, v in fields.items() if v is not None}
        self._at = self._end = None  # where this run's line starts and ends in the file

    def save(self, rows: list, summary=None, **fields) -> dict:
        line = {**self.head, "rows": rows, "summary": summary, **self.fields, **fields}
        data = (json.dumps(line) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            end = f.seek(0, os.SEEK_END)
            if self._at is None or end != self._end:  # the first save, or another writer appended since
                f.seek(max(end - 1, 0))
                if end and f.read(1) != b"\n":
                    f.write(b"\n")  # a line a killed writer left unfinished stays apart from ours
                self._at = f.seek(0, os.SEEK_END)
            f.truncate(self._at)
            f.write(data)  # "a" mode: every write goes to the end, which truncate just put at our line
            self._end = self._at + len(data)
        return line


def read(path: Path) -> list[dict]:
    """Every run in a JSONL file, in order (line N is ``read(path)[N - 1]``)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pick(spec: str | Path) -> dict:
    """One run: ``FILE.jsonl:N`` (line N, from 1), ``FILE.jsonl`` (its last line) or ``FILE.json``."""
    text = str(spec)
    match = re.fullmatch(r"(.+\.jsonl):(\d+)", text)
    if match:
        runs = read(Path(match[1]))
        if not 1 <= int(match[2]) <= len(runs):
            raise ValueError(f"{match[1]} has {len(runs)} lines, not {match[2]}")
        return runs[int(match[2]) - 1]
    if text.endswith(".jsonl"):
        return read(Path(text))[-1]
    return json.loads(Path(text).read_text())


def log_line(path: Path, **fields) -> dict:
    """A tools/gpu_check.sh log as a line of ``gpu_check.jsonl``: each stage's exit code and seconds as
    rows, the failed ones as the summary, the whole text kept."""
    text = path.read_text(errors="replace")
    rows = [dict(stage=m[1], rc=int(m[2]), seconds=int(m[3]))
            for m in re.finditer(r"^=== (\S+): rc=(-?\d+) in (\d+) s$", text, re.M)]
    gpu = re.search(r"^(NVIDIA [^,\n]+), \d", text, re.M)
    started = re.search(r"^=== \S+ \((\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)", text, re.M)
    known = re.search(r"^=== commit (\S+)$", text, re.M)
    line = dict(benchmark="gpu_check", gpu=gpu and gpu[1], commit=known and known[1],
                date=started and started[1].replace("Z", "+00:00"), seed=None, quick=None, rows=rows,
                summary=dict(stages=len(rows), failed=[r["stage"] for r in rows if r["rc"] != 0]))
    return {**line, **fields, "log": text}


def add(paths: list[Path], results: Path = RESULTS) -> int:
    """Append every line of the given JSONL files (or of the ``*.jsonl`` and ``gpu_check.log`` in the
    given folders) to ``results/<benchmark>.jsonl``, unless that file already holds it. Returns how
    many were added."""
    files = [f for p in paths for f in (sorted(p.glob("*.jsonl")) + sorted(p.glob("gpu_check.log"))
                                        if p.is_dir() else [p])]
    held: dict[Path, list[dict]] = {}  # each target's lines, read once
    added = 0
    for f in files:
        for line in [log_line(f)] if f.suffix == ".log" else read(f):
            target = results / f"{line['benchmark']}.jsonl"
            lines = held.setdefault(target, read(target) if target.exists() else [])
            if line in lines:
                continue
            with open(target, "a") as out:
                out.write(json.dumps(line) + "\n")
            lines.append(line)
            added += 1
            print(f"{f} -> {target.name}:{len(lines)}")
    return added


def show(path: Path) -> None:
    for n, run in enumerate(read(path), 1):
        what = run.get("note") or run.get("source") or ""
        print(f"{path.name}:{n}  {run.get('date')}  {run.get('gpu') or 'cpu'}  {run.get('commit')}  "
              f"quick={run.get('quick')}  {len(run.get('rows') or [])} rows  {what}"[:160])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("show", help="one line per run of a JSONL file").add_argument("path", type=Path)
    sub.add_parser("add", help="append a GPU host's lines here").add_argument("paths", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "show":
        show(args.path)
    else:
        print(f"{add(args.paths)} lines added")


if __name__ == "__main__":
    sys.exit(main())
