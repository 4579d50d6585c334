"""GET /model-stats in memory: request counts, latency, queue depth, errors by status and device
peaks, cleared by POST /kernel-stats/reset like the kernel timings."""

import json
from pathlib import Path

import pytest

from fusedserve.service.stats import peaks
from fusedserve.service.stats.model_stats import by_status, outcome_statuses
from fusedserve.service.stats.service_stats import ServiceStats

ROWS = [[0.5, -1.0, 2.0], [3.0, 0.0, -7.0]]
ROOT = Path(__file__).resolve().parents[3]


async def test_model_stats_count_requests_latency_and_errors_by_status(client):
    for _ in range(3):
        assert (await client.post("/infer", json={"model": "tiny", "inputs": ROWS})).status_code == 200
    assert (await client.post("/infer", json={"model": "tiny", "inputs": [[1.0]]})).status_code == 422
    assert (await client.post("/v2/models/tiny/infer", json={"inputs": []})).status_code == 422
    assert (await client.post("/infer", json={"model": "nope", "inputs": ROWS})).status_code == 404
    r = await client.get("/model-stats")
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(body["models"]) == ["tiny", "wide"], body["models"]
    tiny, wide = body["models"]["tiny"], body["models"]["wide"]
    assert tiny["requests"] == 5 and tiny["outcomes"] == {"ok": 3, "bad_input": 2}, tiny
    assert tiny["errors_by_status"] == {"422": 2}, tiny
    assert tiny["latency"]["count"] == 3 and tiny["latency"]["p99_s"] >= tiny["latency"]["p50_s"] > 0, tiny
    assert tiny["queue_wait"]["count"] == 3 and tiny["queued_rows"] == 0, tiny
    assert 0 < tiny["requests_per_s"] <= 5 / body["window_s"] + 1e-9, (tiny, body["window_s"])
    assert (tiny["device"], tiny["dtype"], tiny["in_features"], tiny["out_features"]) == ("cpu", "float32", 3, 2)
    assert wide["requests"] == 0 and wide["errors_by_status"] == {} and wide["latency"]["p50_s"] == 0, wide
    assert body["unattributed"] == {"requests": 1, "errors_by_status": {"404": 1}}, body["unattributed"]
    kernel = (await client.get("/kernel-stats")).json()
    assert sorted(kernel["models"]) == ["tiny"] and kernel["unattributed_outcomes"] == {"unknown_model": 1}, kernel
    cpu = body["devices"]["cpu"]
    assert cpu["estimate"] is True and "estimate" in cpu["source"] and cpu["tbps"] > 0, cpu
    assert set(cpu["tflops"]) == {"float32", "float16", "bfloat16"}, cpu


async def test_reset_clears_model_stats_with_the_kernel_stats(client):
    assert (await client.post("/infer", json={"model": "wide", "inputs": [[1.0] * 5]})).status_code == 200
    assert (await client.post("/infer", json={"model": "wide", "inputs": [[1.0]]})).status_code == 422
    before = (await client.get("/model-stats")).json()
    assert before["models"]["wide"]["requests"] == 2, before
    assert (await client.post("/kernel-stats/reset")).json() == {"reset": True}
    after = (await client.get("/model-stats")).json()
    wide = after["models"]["wide"]
    assert (wide["requests"], wide["errors_by_status"], wide["latency"]["count"]) == (0, {}, 0), wide
    assert after["since_unix_s"] > before["since_unix_s"], (before["since_unix_s"], after["since_unix_s"])
    assert (await client.get("/kernel-stats")).json()["layers"] == []


def test_outcomes_without_a_model_stay_out_of_the_models():
    stats = ServiceStats()
    stats.record_outcome("m", "ok")
    stats.record_outcome("", "bad_input")
    stats.record_outcome("", "bad_input")
    snap = stats.snapshot()
    assert list(snap["models"]) == ["m"] and snap["models"]["m"]["outcomes"] == {"ok": 1}, snap["models"]
    assert snap["unattributed_outcomes"] == {"bad_input": 2}
    stats.reset()
    assert stats.snapshot()["unattributed_outcomes"] == {} and stats.snapshot()["models"] == {}


def test_every_outcome_maps_to_its_status():
    statuses = outcome_statuses()
    assert statuses["ok"] == 200 and statuses["bad_input"] == 422 and statuses["unknown_model"] == 404, statuses
    assert statuses["queue_full"] == 503 and statuses["timeout"] == 504 and statuses["disconnected"] == 499
    assert by_status({"ok": 4, "queue_full": 2, "not_ready": 1, "mystery": 1}, statuses) == {"500": 1, "503": 3}


def test_gpu_peaks_by_name():
    h200 = peaks.gpu_peaks("NVIDIA H200")
    assert (h200["tflops"]["bfloat16"], h200["tbps"], h200["estimate"]) == (797.4, 4.255, False), h200
    assert peaks.gpu_peaks("NVIDIA H100 PCIe")["estimate"] is True  # a datasheet's
    assert peaks.gpu_peaks("NVIDIA H100 80GB HBM3")["tbps"] == 3.027
    other = peaks.gpu_peaks("NVIDIA A10")
    assert other["estimate"] is True and "A10" in other["source"] and other["name"] == "NVIDIA A10", other


@pytest.mark.parametrize("flags, per_cycle", [({"avx512f", "avx2", "fma"}, 64), ({"avx2", "fma"}, 32), (set(), 8)])
def test_cpu_peaks_are_an_estimate_from_cores_and_vector_width(flags, per_cycle):
    p = peaks.cpu_peaks(cores=4, flags=flags)
    assert p["tflops"]["float32"] == pytest.approx(4 * 2.5 * per_cycle / 1e3), p
    assert p["estimate"] is True and p["name"] == "CPU (4 cores)", p


def test_measured_peaks_are_the_best_runs_of_the_kernel_benchmark():
    # Each bench/kernels.py run records the best 8192^3 bf16 matmul and device copy on its GPU; a
    # roof below what a run reached would draw kernels above the roof.
    best: dict[str, tuple[float, float]] = {}
    for line in (ROOT / "bench" / "results" / "kernels.jsonl").read_text().splitlines():
        run = json.loads(line)
        if run.get("matmul_tflops") and run.get("copy_tbps"):
            tflops, tbps = best.get(run["gpu"], (0.0, 0.0))
            best[run["gpu"]] = (max(tflops, run["matmul_tflops"]), max(tbps, run["copy_tbps"]))
    assert {"NVIDIA H200", "NVIDIA H100 80GB HBM3"} <= set(best), best
    for gpu, (tflops, tbps) in best.items():
        table = peaks.gpu_peaks(gpu)
        assert not table["estimate"] and (table["tflops"]["bfloat16"], table["tbps"]) == (tflops, tbps), (gpu, table)
