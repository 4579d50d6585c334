"""tools/provisional_table.py: the shipped H200 table is what the stored runs it names make of it."""

import json
from pathlib import Path

from tools.provisional_table import build, stored_runs

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "kernels" / "tables" / "NVIDIA_H200-triton-3.6.0.json"


def test_the_shipped_table_rebuilds_from_the_runs_it_names(tmp_path):
    shipped = json.loads(SHIPPED.read_text())
    named = {name: run for name, run in stored_runs("NVIDIA H200").items() if name in shipped["sources"]}
    assert sorted(named) == shipped["sources"], "a run the table was built from is missing from kernels.jsonl"
    (path,) = build(named, tmp_path)
    assert path.read_text() == SHIPPED.read_text()
