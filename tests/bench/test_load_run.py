"""bench/load.py end to end on this machine: two real servers, two alternated rounds, its line and plot."""

import json
import os

import numpy as np
import pytest

from bench.load import main
from bench.runs import read


@pytest.mark.slow
def test_a_short_run_alternates_the_servers_and_leaves_none_running(tmp_path, lingering):
    png = tmp_path / "load.png"
    main(["--servers", "fusedserve", "naive_fastapi_1w", "--models", "digits", "--clients", "2", "--rounds", "2",
          "--duration", "0.3", "--procs", "2", "--out", str(tmp_path), "--plot", str(png)])
    (report,) = read(tmp_path / "load.jsonl")
    assert report["benchmark"] == "load" and report["gpu"] is None and report["quick"] is False
    order = [(r["round"], r["server"]) for r in report["rows"]]
    assert order == [(0, "fusedserve"), (0, "naive_fastapi_1w"), (1, "naive_fastapi_1w"), (1, "fusedserve")]
    for run in report["rows"]:
        assert run["requests"] > 0 and run["errors"] == 0 and run["server_cpu_ms_per_request"] > 0
    assert {r["server"] for r in report["summary"]} == {"fusedserve", "naive_fastapi_1w"}
    assert report["answers_max_abs_diff"]["naive_fastapi_1w"] < 1e-3
    assert report["machine"]["cores"] == os.cpu_count() and report["config"]["rounds"] == 2
    assert len(report["targets"]) == 3  # the CPU box's; at 2 clients none of them is measured
    assert all(t["met"] is None for t in report["targets"])
    assert png.exists()
    assert lingering() == [], "every server and load process ended"


@pytest.mark.slow
def test_v2_binary_traffic_is_answered_and_peers_without_v2_are_skipped(tmp_path):
    main(["--servers", "fusedserve", "naive_fastapi_1w", "--models", "digits", "--clients", "2", "--rounds", "1",
          "--duration", "0.3", "--procs", "2", "--protocol", "v2-binary", "--out", str(tmp_path)])
    (report,) = read(tmp_path / "load.jsonl")
    assert report["skipped"] == {"naive_fastapi_1w": "speaks no v2-binary"}
    (run,) = report["rows"]
    # Every request answered 200: the server took the binary header, input and output request as sent.
    assert run["server"] == "fusedserve" and run["requests"] > 0 and run["errors"] == 0


def test_v2_binary_bodies_hold_the_same_rows_as_the_json_ones():
    from bench.load import request_traffic

    as_json, as_v2 = request_traffic("wide", 24, 3), request_traffic("wide", 24, 3, "v2-binary")
    length = int(dict(as_v2.headers)["Inference-Header-Content-Length"])
    assert as_v2.path == "/v2/models/wide/infer" and len(as_v2.bodies) == len(as_json.bodies)
    for text, blob in zip(as_json.bodies, as_v2.bodies, strict=True):
        head = json.loads(blob[:length])
        assert head["inputs"][0]["shape"] == [3, 24] and head["outputs"][0]["parameters"] == {"binary_data": True}
        rows = np.frombuffer(blob[length:], dtype="<f4").reshape(3, 24)
        assert np.array_equal(rows, np.array(json.loads(text)["inputs"], dtype=np.float32))
