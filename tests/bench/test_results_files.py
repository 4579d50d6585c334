"""bench/results: one JSONL file per benchmark, every line a run with the same head, every old result
file's line named in MOVED.md, and few files."""

import re
from pathlib import Path

from bench.runs import HEAD, RESULTS, read


def test_every_line_is_a_run_of_its_files_benchmark():
    files = sorted(RESULTS.glob("*.jsonl"))
    assert files and len(list(RESULTS.iterdir())) <= 40
    for path in files:
        for n, run in enumerate(read(path), 1):
            assert list(run)[:len(HEAD)] == list(HEAD), f"{path.name}:{n}"
            assert run["benchmark"] == path.stem and isinstance(run["rows"], list), f"{path.name}:{n}"


def test_moved_md_names_every_converted_line():
    moved = dict(re.findall(r"^\| `([^`]+)` \| `([^`]+\.jsonl:\d+)`", (RESULTS / "MOVED.md").read_text(), re.M))
    found = {Path(run["source"]).name: f"{path.name}:{n}" for path in RESULTS.glob("*.jsonl")
             for n, run in enumerate(read(path), 1) if "source" in run}
    assert found and {name: moved.get(name) for name in found} == found
