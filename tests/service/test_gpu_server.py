"""The shipped digits model behind a real uvicorn on CUDA (triton backend, CUDA graphs), with httpx.

Needs no scikit-learn: outputs are checked against the same model on the CPU torch backend."""

import time

import httpx
import numpy as np
import pytest
import torch

from fusedserve import models

from .conftest import Server

# float32 with TF32 off (torch's default) is IEEE on both sides; only the summation order differs
# (K <= 256 terms of size ~1), so logits agree to ~1e-5; 1e-3 leaves room and still catches a
# wrong row, a wrong bias or a missing ReLU (errors of order 1).
ATOL = 1e-3


def check_outputs(client, x, want):
    outputs = []
    for start in range(0, len(x), 17):  # 17-row requests: padded to the 32-row bucket
        r = client.post("/infer", json={"model": "digits", "inputs": x[start:start + 17].tolist()})
        assert r.status_code == 200, f"rows {start}: {r.status_code} {r.text}"
        outputs += r.json()["outputs"]
    got = np.array(outputs, dtype=np.float32)
    err = np.abs(got - want)
    row, col = np.unravel_index(err.argmax(), err.shape)
    print(f"max |server - cpu reference| = {err.max():.2e} at row {row}, logit {col}")
    assert err.max() <= ATOL, f"row {row} logit {col}: server {got[row, col]} vs reference {want[row, col]}"
    assert (got.argmax(1) == want.argmax(1)).all(), "a predicted digit differs from the reference"


@pytest.mark.gpu
@pytest.mark.timeout(800)  # ready within 420 s, then background tuning within 360 s, beside the other GPU tests
def test_shipped_digits_on_cuda_real_server(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 17, size=(400, 64)).astype(np.float32)  # digits pixels are 0..16
    reference = models.load_model(models.DEFAULT_REPOSITORY / "digits", device="cpu", backend="torch")
    with torch.no_grad():
        want = reference(torch.from_numpy(x)).numpy()

    server = Server(None, tmp_path / "server.log", "--max-batch-size", "64", device="cuda")
    try:
        # Warm-up compiles one provisional config per layer and bucket (tuning comes after ready).
        server.wait_ready(timeout_s=420)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            check_outputs(client, x, want)
            # Background tuning swaps each provisional bucket in between batches: every answer meanwhile
            # and after must be right (a cold tune cache starts every bucket provisional).
            deadline = time.monotonic() + 360  # generous: all 7 buckets, beside the other GPU tests
            while "provisional" in client.get("/kernel-stats").json()["served"]["digits"]["choices"].values():
                assert time.monotonic() < deadline, "background tuning did not finish within 360 s"
                check_outputs(client, x[:68], want[:68])
            check_outputs(client, x, want)
            stats = client.get("/kernel-stats").json()
            print("served:", stats["served"])
            for s in stats["layers"]:
                print(f"{s['layer']} M={s['M']} {s['kernel']} [{s['config']}] calls={s['calls']} "
                      f"mean={s['mean_s'] * 1e6:.1f} us {s['tflops']:.2f} TFLOP/s {s['gbps']:.1f} GB/s")
            served = stats["served"]["digits"]
            assert served["device"].startswith("cuda") and served["backend"] == "triton", served
            assert served["layer_timings"]["method"] == "timed_graph", served  # not eager launches
            # The first batch of each bucket is timed, and a stats read collects finished events.
            assert stats["layers"], f"no layer timings after {len(x)}-row passes: {stats}"
    finally:
        server.stop()
        print(server.log.read_text()[-4000:])
