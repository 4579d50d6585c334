"""The shipped digits model served end to end in memory on the CPU (CUDA: test_gpu_server.py)."""

import asyncio

import httpx
import numpy as np
import pytest

from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings

from .conftest import wait_ready

# The GPU host may lack scikit-learn (its wheels are most of what a device run carries): skip there,
# rather than stop the whole run's collection.
load_digits = pytest.importorskip("sklearn.datasets", reason="the digits come from scikit-learn").load_digits

# 98.3% held out when trained (models/repository/digits/training.json); these rows mix train and
# held-out ones, so anything below 95% means the service mangled rows, not that the model is weak.
MIN_ACCURACY = 0.95


def digits(n=130):
    data = load_digits()
    return data.data[:n].astype(np.float32), data.target[:n]


def accuracy(outputs, labels) -> float:
    return float((np.asarray(outputs).argmax(1) == labels).mean())


async def test_shipped_digits_in_memory_with_concurrent_requests():
    x, y = digits()
    app = create_app(Settings(device="cpu", max_batch_size=16, gc_freeze=False))
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c):
        await wait_ready(c)
        # Awkward request sizes (at most max_batch_size=16 rows each), sent concurrently so they batch.
        sizes = [1, 3, 16, 7, 1, 16, 13, 16, 16, 16, 16, 9]
        starts = np.cumsum([0, *sizes[:-1]])
        responses = await asyncio.gather(*(
            c.post("/infer", json={"inputs": x[s:s + n].tolist()}) for s, n in zip(starts, sizes, strict=True)))
        outputs = []
        for s, n, r in zip(starts, sizes, responses, strict=True):
            assert r.status_code == 200, f"rows {s}:{s + n}: {r.status_code} {r.text}"
            assert len(r.json()["outputs"]) == n, f"rows {s}:{s + n} got {len(r.json()['outputs'])} outputs"
            outputs += r.json()["outputs"]
        acc = accuracy(outputs, y[:len(outputs)])
        assert acc >= MIN_ACCURACY, f"digits accuracy through /infer {acc:.3f} < {MIN_ACCURACY}"
        stats = (await c.get("/kernel-stats")).json()
        assert stats["served"]["digits"]["in_features"] == 64
        # Timings are sampled: every layer of each timed batch, and at least each bucket's first.
        calls = [row["calls"] for row in stats["layers"]]
        buckets = {row["M"] for row in stats["layers"]}
        assert len(calls) == 3 * len(buckets), stats["layers"]
        assert sum(calls) <= 3 * stats["models"]["digits"]["batches"], stats["layers"]
