"""bench/load.py end to end on this machine: two real servers, two alternated rounds, JSON and plot."""

import json
import os
from pathlib import Path

import pytest

from bench.load import main
from bench.servers import read_procs, tree


@pytest.mark.slow
def test_a_short_run_alternates_the_servers_and_leaves_none_running(tmp_path):
    out = tmp_path / "load_test.json"
    main(["--servers", "fusedserve", "naive_fastapi_1w", "--models", "digits", "--clients", "2", "--rounds", "2",
          "--duration", "0.3", "--procs", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    order = [(r["round"], r["server"]) for r in report["runs"]]
    assert order == [(0, "fusedserve"), (0, "naive_fastapi_1w"), (1, "naive_fastapi_1w"), (1, "fusedserve")]
    for run in report["runs"]:
        assert run["requests"] > 0 and run["errors"] == 0 and run["server_cpu_ms_per_request"] > 0
    assert {r["server"] for r in report["summary"]} == {"fusedserve", "naive_fastapi_1w"}
    assert report["answers_max_abs_diff"]["naive_fastapi_1w"] < 1e-3
    assert report["machine"]["cores"] == os.cpu_count() and report["config"]["rounds"] == 2
    assert len(report["targets"]) == 3  # the CPU box's; at 2 clients none of them is measured
    assert all(t["met"] is None for t in report["targets"])
    assert out.with_suffix(".png").exists()
    # Every server and load process ended; multiprocessing's resource tracker lives as long as we do.
    left = [p for p in tree(os.getpid(), read_procs()) if p != os.getpid()
            and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert left == []
