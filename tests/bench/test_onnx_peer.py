"""bench/onnx_peer.py runs quick on the CPU: an exported, imported model against onnxruntime, one
JSONL line with the serving-contract rows and the provider named; with --http, end to end: fusedserve
serve and the onnxruntime FastAPI app on loopback ports, their answers checked, both under load."""


import pytest

from bench import onnx_peer, runs


@pytest.mark.timeout(180)
def test_the_quick_run_appends_one_line_with_every_batch(tmp_path):
    onnx_peer.main(["--quick", "--calls", "3", "--out", str(tmp_path), "--note", "test"])
    [line] = runs.read(tmp_path / "onnx_peer.jsonl")
    assert line["mode"] == "contract" and line["complete"] and line["note"] == "test"
    assert line["provider"] == ["CPUExecutionProvider"]
    assert [row["batch"] for row in line["rows"]] == list(onnx_peer.QUICK_BATCHES)
    for row in line["rows"]:
        assert row["fusedserve_us"] > 0 and row["onnxruntime_us"] > 0, row
        # Both compute the same float32 MLP; only the summation order differs.
        assert row["max_error"] < 1e-4, row


@pytest.mark.slow
@pytest.mark.timeout(90)  # ~25 s on the 2-core box: both servers' start, 2 rounds x 2 client counts of 1 s each
def test_the_quick_http_run_alternates_both_servers_and_checks_their_answers(tmp_path, lingering):
    onnx_peer.main(["--http", "--quick", "--procs", "2", "--ready-timeout", "60", "--out", str(tmp_path),
                    "--note", "test"])
    [line] = runs.read(tmp_path / "onnx_peer.jsonl")
    assert line["mode"] == "http" and line["complete"] and line["note"] == "test" and line["device"] == "cpu"
    assert line["provider"] == ["CPUExecutionProvider"] and line["gpu"] is None and not line["cut_short"]
    peer = "naive_onnxruntime_1w"
    order = [(r["round"], r["clients"], r["server"]) for r in line["rows"]]
    assert order == [(0, 1, "fusedserve"), (0, 1, peer), (0, 16, "fusedserve"), (0, 16, peer),
                     (1, 1, peer), (1, 1, "fusedserve"), (1, 16, peer), (1, 16, "fusedserve")]
    for run in line["rows"]:
        assert run["requests"] > 0 and run["errors"] == 0, run
        assert run["rps"] > 0 and 0 < run["p50_ms"] <= run["p99_ms"] and run["mean_ms"] > 0, run
    ratios = {r["clients"]: r for r in line["summary"]["ratios"]}
    assert set(ratios) == {1, 16} and all(r["peer"] == peer and r["rps_ratio"] > 0 for r in ratios.values())
    answers = line["answers"]
    # Both compute the same float32 MLP on the CPU; only the summation order differs.
    assert answers["tolerance"] == 1e-4 and answers["max_error"][onnx_peer.QUICK_MODELS[0][0]] < 1e-4
    assert answers["bodies_per_model"] == 9
    assert lingering() == [], "every server and load process ended"
