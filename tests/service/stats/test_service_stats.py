"""The stats object alone: aggregation keys, rates, percentiles, reservoir bound, reset, threads."""

import threading

import pytest

from fusedserve.models.timing import LayerTiming
from fusedserve.service.stats.service_stats import ServiceStats


def timing(seconds, layer="layers.0", M=17, N=70, K=130, dtype="float16", config="BM=16"):
    return LayerTiming(model="m", layer=layer, rows=M - 1, M=M, N=N, K=K, dtype=dtype, backend="triton",
                       kernel="triton_tiled", config=config, seconds=seconds)


def test_rates_come_from_the_mean_time():
    stats = ServiceStats()
    for s in (1e-5, 3e-5):
        stats.record_layer(timing(s))
    (row,) = stats.snapshot()["layers"]
    assert row["calls"] == 2 and row["total_s"] == pytest.approx(4e-5) and row["mean_s"] == pytest.approx(2e-5)
    # 2*M*N*K flops and (M*K + N*K + N + M*N) fp16 elements over 20 us; approx: float rounding only.
    assert row["tflops"] == pytest.approx(2 * 17 * 70 * 130 / 2e-5 / 1e12)
    assert row["gbps"] == pytest.approx((17 * 130 + 70 * 130 + 70 + 17 * 70) * 2 / 2e-5 / 1e9)


def test_keys_split_by_layer_bucket_dtype_and_config():
    stats = ServiceStats()
    for t in (timing(1e-5), timing(1e-5, layer="layers.1"), timing(1e-5, M=3), timing(1e-5, dtype="float32"),
              timing(1e-5, config="BM=64"), timing(2e-5)):
        stats.record_layer(t)
    rows = stats.snapshot()["layers"]
    assert len(rows) == 5, [(r["layer"], r["M"], r["dtype"], r["config"]) for r in rows]
    assert sorted(r["calls"] for r in rows) == [1, 1, 1, 1, 2]


def test_percentiles_use_a_bounded_reservoir_of_recent_samples():
    stats = ServiceStats(reservoir=100)
    for _ in range(1000):
        stats.record_layer(timing(1.0))
    for i in range(100):  # the 100 most recent samples: 1..100 ms
        stats.record_layer(timing((i + 1) * 1e-3))
    (row,) = stats.snapshot()["layers"]
    assert row["calls"] == 1100, "count and total cover every call, not just the reservoir"
    # numpy's linear interpolation over 1..100 ms: p50 = 50.5 ms, p99 = 99.01 ms.
    assert row["p50_s"] == pytest.approx(50.5e-3) and row["p99_s"] == pytest.approx(99.01e-3)


def test_batches_requests_and_reset():
    stats = ServiceStats()
    stats.record_batch("m", 3, [0.001, 0.003], 0.01)
    stats.record_batch("m", 3, [0.002], 0.01)
    stats.record_batch("m", 1, [0.004], 0.01)
    stats.record_request("m", ok=True, seconds=0.02)
    stats.record_request("m", ok=False, seconds=0.03)
    model = stats.snapshot()["models"]["m"]
    assert model["batch_size_histogram"] == {"1": 1, "3": 2}
    assert model["queue_wait"]["count"] == 4 and model["queue_wait"]["mean_s"] == pytest.approx(0.0025)
    assert model["requests"] == {"success": 1, "failed": 1} and model["rows"] == 7
    stats.reset()
    assert stats.snapshot()["models"] == {} and stats.snapshot()["layers"] == []


def test_concurrent_writers_lose_nothing():
    stats = ServiceStats()

    def write():
        for _ in range(2000):
            stats.record_layer(timing(1e-6))
            stats.record_batch("m", 1, [1e-6], 1e-6)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(50):
        stats.snapshot()  # readers run alongside the writers
    for t in threads:
        t.join()
    snap = stats.snapshot()
    assert snap["layers"][0]["calls"] == 8000 and snap["models"]["m"]["batches"] == 8000


def test_reservoir_must_be_positive():
    with pytest.raises(ValueError, match="reservoir"):
        ServiceStats(reservoir=0)
