"""Load benchmark: the service with dynamic batching on vs off, under 1..64 keep-alive clients.

Starts two servers (``python -m service``) on loopback ports, one batching (``--max-batch-size``,
``--max-delay-ms``) and one not (batch size 1), and drives each with a load generator on raw
asyncio streams (httpx costs ~6 ms of CPU per request, far more than the server). Runs alternate
A B A B per client count so drifting machine noise hits both alike. Every run is bounded by
``--duration``; every read by a timeout. Writes ``bench/results/load_<host>.json`` and a plot.

    python bench/load.py --device cpu --clients 1 16 64 --duration 3 --reps 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IO_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=IO_TIMEOUT_S) as r:
        return json.loads(r.read())


class ServerProcess:
    def __init__(self, label: str, flags: list[str], log_dir: Path):
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server_{label}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(self.port),
                                          "--log-level", "warning", *flags],
                                         cwd=ROOT, env=env, stdout=out, stderr=out)

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.label} exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.label} not ready after {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def build_request(port: int, body: bytes) -> bytes:
    head = (f"POST /infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    """Reads one HTTP/1.1 response with a Content-Length body; returns its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def client_loop(port: int, requests: list[bytes], deadline: float, latencies: list, errors: list) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT_S)
    i = 0
    try:
        while time.monotonic() < deadline:
            payload = requests[i % len(requests)]
            i += 1
            t0 = time.perf_counter()
            writer.write(payload)
            status = await asyncio.wait_for(read_response(reader), IO_TIMEOUT_S)
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors.append(status)
    finally:
        writer.close()


async def drive(port: int, requests: list[bytes], clients: int, duration_s: float) -> dict:
    latencies, errors = [], []
    t0 = time.monotonic()
    deadline = t0 + duration_s
    await asyncio.gather(*(client_loop(port, requests, deadline, latencies, errors) for _ in range(clients)))
    elapsed = time.monotonic() - t0
    lat = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return {"requests": len(latencies), "errors": len(errors), "seconds": elapsed,
            "rps": len(latencies) / elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "mean_ms": float(lat.mean())}


def mean_batch(stats: dict) -> float:
    hist = {}
    for model in stats["models"].values():
        for size, count in model["batch_size_histogram"].items():
            hist[int(size)] = hist.get(int(size), 0) + count
    batches = sum(hist.values())
    return sum(s * c for s, c in hist.items()) / batches if batches else 0.0


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rps, ax_p99) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("batching", "no_batching"):
        rows = [r for r in results if r["mode"] == mode]
        clients = sorted({r["clients"] for r in rows})
        rps = [np.median([r["rps"] for r in rows if r["clients"] == c]) for c in clients]
        p99 = [np.median([r["p99_ms"] for r in rows if r["clients"] == c]) for c in clients]
        ax_rps.plot(clients, rps, marker="o", label=mode)
        ax_p99.plot(clients, p99, marker="o", label=mode)
    for ax, label in ((ax_rps, "requests / s (median of reps)"), (ax_p99, "p99 latency, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent keep-alive clients")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="server device: auto, cpu, cuda")
    parser.add_argument("--model", default="digits", help="model of the shipped repository to call")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--reps", type=int, default=2, help="A B alternations per client count")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for warm-up")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/load_<host>.json)")
    args = parser.parse_args(argv)
    host = socket.gethostname()
    out = args.out or RESULTS / f"load_{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    logs = Path(tempfile.mkdtemp(prefix="fusedserve_load_"))  # server logs, quoted on failure
    servers = {
        "batching": ServerProcess("batching", ["--device", args.device, "--max-batch-size",
                                               str(args.max_batch_size), "--max-delay-ms", str(args.max_delay_ms)],
                                  logs),
        "no_batching": ServerProcess("no_batching", ["--device", args.device, "--max-batch-size", "1",
                                                     "--max-delay-ms", "0"], logs),
    }
    results = []
    try:
        for s in servers.values():
            s.wait_ready(args.ready_timeout)
        served = http_json(servers["batching"].url + "/kernel-stats")["served"]
        if args.model not in served:
            raise SystemExit(f"--model {args.model!r} is not served; choose one of {sorted(served)}")
        width = served[args.model]["in_features"]
        rng = np.random.default_rng(0)
        rows = [rng.uniform(0, 16, size=(args.rows, width)).round(2).tolist() for _ in range(64)]
        for clients in args.clients:
            for rep in range(args.reps):
                for mode, s in servers.items():
                    requests = [build_request(s.port, json.dumps({"model": args.model, "inputs": r}).encode())
                                for r in rows]
                    http_json(s.url + "/kernel-stats/reset", "POST")
                    run = asyncio.run(drive(s.port, requests, clients, args.duration))
                    run.update(mode=mode, clients=clients, rep=rep,
                               mean_batch_rows=mean_batch(http_json(s.url + "/kernel-stats")))
                    results.append(run)
                    print(f"{mode:12s} clients={clients:3d} rep={rep} {run['rps']:8.0f} req/s "
                          f"p50={run['p50_ms']:.2f} ms p99={run['p99_ms']:.2f} ms "
                          f"mean batch={run['mean_batch_rows']:.1f} errors={run['errors']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    report = {"host": host, "device": served[args.model]["device"], "model": args.model,
              "backend": served[args.model]["backend"], "rows_per_request": args.rows,
              "duration_s": args.duration, "max_batch_size": args.max_batch_size,
              "max_delay_ms": args.max_delay_ms, "cpu_count": os.cpu_count(), "results": results}
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(results, png, f"fusedserve /infer, {args.model} on {report['device']} ({host})")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
