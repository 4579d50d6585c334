"""What the engine transport of ``--workers N`` costs per request: the same batcher and model called
in process (``LocalEngine``) and from another process over ``service.wire`` frames on a Unix socket
(``RemoteEngine`` here, ``service.engine_process`` there), at 1 and 64 requests in flight from one
event loop; plus the codec alone, raw float32 frames against pickling the rows.

    python bench/ipc_cost.py --out bench/results/ipc_cost_<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fusedserve.service import startup, wire  # noqa: E402
from fusedserve.service.engine import LocalEngine  # noqa: E402
from fusedserve.service.remote import RemoteEngine  # noqa: E402
from fusedserve.service.settings import Settings  # noqa: E402
from fusedserve.service.state import ServiceState  # noqa: E402
from fusedserve.service.timing import LayerSinks  # noqa: E402

MODEL = "digits"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy(seconds: float) -> float:
    def ticks():
        return np.array(Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:], dtype=np.int64)

    t0 = ticks()
    time.sleep(seconds)
    d = ticks() - t0
    return round(1 - (d[3] + d[4]) / max(d.sum(), 1), 3)


async def _drive(engine, requests: int, in_flight: int) -> float:
    """``requests`` one-row requests, ``in_flight`` at a time; returns the wall seconds."""
    row = np.full((1, engine.models()[MODEL].in_features), 0.5, dtype=np.float32)
    left = requests

    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            await engine.infer(MODEL, row, 30.0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.perf_counter() - t0


async def _measure(engine, requests: int, in_flight: int, other_pid: int | None) -> dict:
    await _drive(engine, 200, in_flight)  # warm: every row count this load makes has run once
    own0, other0 = time.process_time(), _cpu_s(other_pid) if other_pid else 0.0
    wall = await _drive(engine, requests, in_flight)
    own = time.process_time() - own0
    other = (_cpu_s(other_pid) - other0) if other_pid else 0.0
    return {"in_flight": in_flight, "requests": requests, "req_per_s": round(requests / wall),
            "wall_us_per_req": round(wall / requests * 1e6, 1),
            "caller_cpu_us_per_req": round(own / requests * 1e6, 1),
            "engine_process_cpu_us_per_req": round(other / requests * 1e6, 1),
            "total_cpu_us_per_req": round((own + other) / requests * 1e6, 1)}


def _settings() -> Settings:
    return Settings(device="cpu", grpc_port=0, workers=1, torch_threads=1)


async def local(requests: int, loads: list[int]) -> list[dict]:
    state = ServiceState.fresh(_settings())
    await startup.warm_up_and_serve(state, await startup.load(state, LayerSinks((state.stats, state.metrics))))
    engine = LocalEngine(state)
    try:
        return [await _measure(engine, requests, n, None) for n in loads]
    finally:
        await asyncio.gather(*(b.stop() for b in state.batchers.values()))


async def remote(requests: int, loads: list[int], log: Path) -> list[dict]:
    settings = _settings()
    path = os.path.join(tempfile.mkdtemp(prefix="ipc-cost-"), "engine.sock")
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        pipe.write(settings.handoff())
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fusedserve.service.engine_process", "--socket", path,
                                 "--settings-fd", str(read), "--log-level", "warning"],
                                stdout=out, stderr=out, cwd=ROOT, pass_fds=(read,))
    os.close(read)
    state = ServiceState.fresh(settings)
    engine = RemoteEngine(path, state)
    await engine.start()
    try:
        for _ in range(600):
            if engine.ready():
                break
            await asyncio.sleep(0.1)
        return [await _measure(engine, requests, n, proc.pid) for n in loads]
    finally:
        await engine.close()
        proc.terminate()
        proc.wait(timeout=30)


def codec(rows: int, cols: int, repeat: int = 20000) -> dict:
    """Microseconds to encode and decode one request and its answer: raw frames against pickle."""
    x = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    out = x[:, :10].copy()
    frames = wire.Frames()

    def raw():
        head, data = wire.infer_frame(7, 0, x, 30.0)
        _, got, _ = wire.read_infer(frames.feed(head + bytes(data))[0][2])
        head, data = wire.result_frame(7, out)
        wire.read_result(frames.feed(head + bytes(data))[0][2])

    def pickled():
        pickle.loads(pickle.dumps((7, MODEL, x, 30.0), protocol=5))
        pickle.loads(pickle.dumps((7, out), protocol=5))

    result = {}
    for name, fn in (("raw_frames", raw), ("pickle", pickled)):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        result[f"{name}_us"] = round((time.perf_counter() - t0) / repeat * 1e6, 2)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 64])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ipc_cost.json")
    args = p.parse_args()
    quiet = _machine_busy(1.0)
    result = {"what": "per-request cost of the --workers N engine transport, digits, 1 row per request",
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine_busy_before": quiet},
              "codec_digits_row": codec(1, 64), "codec_64_rows_of_2048": codec(64, 2048, 2000)}
    result["in_process"] = asyncio.run(local(args.requests, args.in_flight))
    result["engine_process"] = asyncio.run(remote(args.requests, args.in_flight, Path(tempfile.gettempdir()) /
                                                  "ipc_cost_engine.log"))
    result["machine"]["machine_busy_after"] = _machine_busy(1.0)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
