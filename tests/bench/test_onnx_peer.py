"""bench/onnx_peer.py runs quick on the CPU: an exported, imported model against onnxruntime, one
JSONL line with the serving-contract rows and the provider named."""

import pytest

from bench import onnx_peer, runs


@pytest.mark.timeout(180)
def test_the_quick_run_appends_one_line_with_every_batch(tmp_path):
    onnx_peer.main(["--quick", "--calls", "3", "--out", str(tmp_path), "--note", "test"])
    [line] = runs.read(tmp_path / "onnx_peer.jsonl")
    assert line["complete"] and line["provider"] == ["CPUExecutionProvider"] and line["note"] == "test"
    assert [row["batch"] for row in line["rows"]] == list(onnx_peer.QUICK_BATCHES)
    for row in line["rows"]:
        assert row["fusedserve_us"] > 0 and row["onnxruntime_us"] > 0, row
        # Both compute the same float32 MLP; only the summation order differs.
        assert row["max_error"] < 1e-4, row
