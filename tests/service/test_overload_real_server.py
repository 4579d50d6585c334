"""Overload, deadlines and disconnects on a real server (``python -m fusedserve serve`` on loopback).

The model is made slow enough (six 2048-wide layers, 4-row batches, a few ms each on the CPU) that
concurrent clients build a queue, and the queue is small (16 rows), so the limits are reached.
"""

import asyncio
import json
import re

import httpx
import pytest
import torch

from fusedserve import models

from .conftest import Server

IN = 256
ROWS = [[0.25] * IN] * 4  # one request = one full batch (max batch size 4)


def write_slow_repository(root):
    torch.manual_seed(0)
    models.save_model(models.MLP(models.MLPConfig(IN, (2048,) * 6, 8)), root / "slow")
    return root


async def post(port: int, body: bytes, headers: str = "", hang_up: bool = False):
    """One request on its own connection: (status, lower-cased headers, body), or None if we hang up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
    await writer.drain()
    if hang_up:
        writer.close()
        return None
    try:
        head, _, payload = (await reader.read()).partition(b"\r\n\r\n")
    finally:
        writer.close()
    lines = head.decode("latin-1").lower().split("\r\n")
    return int(lines[0].split(" ", 2)[1]), dict(line.split(": ", 1) for line in lines[1:]), payload


async def keep_busy(port: int, body: bytes, stop: asyncio.Event, statuses: list) -> None:
    while not stop.is_set():
        statuses.append((await post(port, body))[0])


def requests_by_outcome(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(r'fusedserve_requests_total\{model="slow",outcome="(\w+)"\} ([0-9.e+]+)', text)
    return {outcome: float(value) for outcome, value in found}


async def scenario(port: int) -> dict:
    body = json.dumps({"model": "slow", "inputs": ROWS}).encode()
    # 1. Overload: 48 requests at once against a 16-row queue.
    burst = await asyncio.gather(*(post(port, body) for _ in range(48)))
    # 2. Deadlines and disconnects while 3 clients keep the model busy (12 rows: they fit the queue).
    stop, background = asyncio.Event(), []
    busy = [asyncio.create_task(keep_busy(port, body, stop, background)) for _ in range(3)]
    await asyncio.sleep(0.2)
    late = [await post(port, body, "X-Request-Timeout-Ms: 1\r\n") for _ in range(5)]
    for _ in range(5):
        await post(port, body, hang_up=True)
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.gather(*busy)
    return {"burst": burst, "late": late, "background": background}


# --workers 2: the queue, the deadlines and the withdrawals live in the engine process, behind the front ends.
@pytest.mark.parametrize("workers", ["1", "2"])
def test_overload_deadline_and_disconnect(tmp_path, workers):
    repo = write_slow_repository(tmp_path / "repo")
    server = Server(repo, tmp_path / "server.log", "--max-batch-size", "4", "--max-queue-rows", "16",
                    "--max-delay-ms", "1", "--inline-batch-ms", "0", "--torch-threads", "1", "--workers", workers)
    try:
        server.wait_ready()
        got = asyncio.run(asyncio.wait_for(scenario(server.port), timeout=60))

        statuses = [status for status, _, _ in got["burst"]]
        assert set(statuses) <= {200, 503}, f"burst statuses: {sorted(set(statuses))}"
        refused = [(h, p) for s, h, p in got["burst"] if s == 503]
        assert refused, "48 requests at once never filled a 16-row queue"
        assert statuses.count(200) >= 4, f"only {statuses.count(200)} of the burst were served"
        assert all(h.get("retry-after") == "1" and "queue" in json.loads(p)["error"] for h, p in refused), refused[0]

        late = [status for status, _, _ in got["late"]]
        assert set(late) <= {200, 504} and 504 in late, f"1 ms deadlines behind a busy model: {late}"
        assert set(got["background"]) == {200}, f"background load: {sorted(set(got['background']))}"

        outcomes = requests_by_outcome(server.url)
        assert outcomes.get("disconnected", 0) >= 1, f"no hung-up request was dropped: {outcomes}"
        # And the server keeps serving.
        r = httpx.post(server.url + "/infer", json={"model": "slow", "inputs": ROWS}, timeout=30)
        assert r.status_code == 200 and len(r.json()["outputs"]) == 4, r.text
    finally:
        server.stop()
