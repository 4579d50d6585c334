"""Load benchmark: the service with dynamic batching on vs off, under 1..64 keep-alive clients.

Writes a temporary model repository with the shipped ``digits`` (64-256-256-10) and ``wide``, a
seeded random MLP of four 2048x2048 layers (float32 on the CPU, bfloat16 on CUDA), then starts two
servers (``python -m fusedserve serve``) on loopback ports, one batching (``--max-batch-size``,
``--max-delay-ms``) and one not (batch size 1), and drives each with a load generator on raw asyncio
streams (httpx costs ~6 ms of CPU per request, far more than the server). Runs alternate A B A B
(B A on odd reps) per model and client count, so drifting machine noise hits both alike. Then it
measures where one digits request's time goes, stage by stage, in this process (see ``breakdown``).
Every run is bounded by ``--duration``; every read by a timeout. Writes
``bench/results/load_<host>.json`` (results, breakdown, targets) and a plot.

    python bench/load.py --device cpu             # ~2 min on the 2-core dev machine
    python bench/load.py --device cuda --quick    # ~1.5 min on a GPU host
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
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
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: models and service import from the checkout
RESULTS = ROOT / "bench" / "results"
IO_TIMEOUT_S = 30.0
WIDE = 2048  # width of every layer of the "wide" model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=IO_TIMEOUT_S) as r:
        return json.loads(r.read())


def write_repository(root: Path, device: str) -> Path:
    """The shipped digits plus the seeded wide model, in a fresh repository folder."""
    import torch

    from fusedserve import models

    shutil.copytree(Path(models.DEFAULT_REPOSITORY) / "digits", root / "digits")
    dtype = "float32" if device == "cpu" else "bfloat16"
    torch.manual_seed(0)
    config = models.MLPConfig(WIDE, (WIDE, WIDE, WIDE), WIDE, dtype=dtype)
    models.save_model(models.MLP(config), root / "wide")
    return root


class ServerProcess:
    def __init__(self, label: str, flags: list[str], log_dir: Path):
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server_{label}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "wb") as out:
            # --grpc-port 0: this benchmark drives HTTP, and two servers must not both take 8001.
            self.proc = subprocess.Popen([sys.executable, "-m", "fusedserve", "serve", "--port", str(self.port),
                                          "--grpc-port", "0", "--log-level", "warning", *flags],
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

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server so far (Linux /proc), None where unavailable."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

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


def batch_summary(stats: dict, model: str) -> dict:
    """Mean rows per batch, queue wait and runner time per batch of ``model`` from /kernel-stats."""
    m = stats["models"].get(model)
    if m is None:
        return {"mean_batch_rows": 0.0}
    return {"mean_batch_rows": m["rows"] / m["batches"] if m["batches"] else 0.0,
            "queue_wait_mean_ms": m["queue_wait"]["mean_s"] * 1e3,
            "queue_wait_p99_ms": m["queue_wait"]["p99_s"] * 1e3,
            "compute_per_batch_ms": m["compute_s"] / m["batches"] * 1e3 if m["batches"] else 0.0}


def request_bodies(model: str, width: int, rows: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    low, high = (0.0, 16.0) if model == "digits" else (-1.0, 1.0)  # digits takes raw 0..16 pixel values
    return [json.dumps({"model": model, "inputs": rng.uniform(low, high, size=(rows, width)).round(3).tolist()}).encode()
            for _ in range(64)]


def median_us(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples) * 1e6)


async def _breakdown(device: str, body: bytes, reps: int) -> dict:
    import torch

    from fusedserve.service.app import create_app
    from fusedserve.service.inputs import dump_json, parse_json, rows_from_json
    from fusedserve.service.settings import Settings

    settings = Settings(device=device, max_batch_size=64, gc_freeze=False, grpc_port=0)  # shipped digits, HTTP only
    app = create_app(settings)
    headers = [(b"host", b"bench"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/infer", "raw_path": b"/infer", "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}

    async def one_asgi_request() -> None:
        sent, done = [], asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await done.wait()  # like a server: http.disconnect only once the response is out
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        await app(dict(scope, state={}), receive, send)
        if sent[0]["status"] != 200:
            raise RuntimeError(f"in-process /infer answered {sent[0]['status']}: {sent[-1].get('body')!r}")

    async with app.router.lifespan_context(app):
        state = app.state.service
        while not state.serving:
            if state.startup_error:
                raise RuntimeError(f"in-process app failed to start: {state.startup_error}")
            await asyncio.sleep(0.05)
        batcher, runner = state.batchers["digits"], state.runners["digits"]
        parsed = parse_json(body)
        x = rows_from_json(parsed["inputs"], "inputs", runner.in_features, 64)
        out = runner.run(torch.from_numpy(x)).numpy()
        for _ in range(50):  # warm: first calls measure each path and settle the batcher's choice
            await one_asgi_request()
        stages = {
            "parse_json": median_us(lambda: parse_json(body), reps),
            "validate": median_us(lambda: rows_from_json(parsed["inputs"], "inputs", runner.in_features, 64), reps),
            "compute": median_us(lambda: runner.run(torch.from_numpy(x)), reps),
            "serialize": median_us(lambda: dump_json({"model": "digits", "outputs": out}), reps),
        }
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await batcher.submit(x)
            samples.append(time.perf_counter() - t0)
        # Queueing and hand-off of an idle batcher: its round trip less the runner's own time.
        stages["batcher"] = max(float(np.median(samples) * 1e6) - stages["compute"], 0.0)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await one_asgi_request()
            samples.append(time.perf_counter() - t0)
        asgi = float(np.median(samples) * 1e6)
    # Body reading, routing, middleware, request/response objects, stats: the app's rest.
    stages["framework"] = max(asgi - sum(stages.values()), 0.0)
    return {"asgi_total": asgi, **stages}


def _gpu_name(device: str) -> str | None:
    """The GPU's name (breakdown() has run a model on it in this process already)."""
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else None


def breakdown(device: str, body: bytes, client_p50_ms: float | None, reps: int) -> dict:
    """Median microseconds of each stage of one digits request on an idle server, in this process.

    ``asgi_total`` is the whole app called with the request (no socket); ``framework`` is what of it
    no named stage covers. ``http_and_client`` is the 1-client p50 of the batching server less
    ``asgi_total``: uvicorn's HTTP parsing, loopback sockets and the load generator itself."""
    result = asyncio.run(_breakdown(device, body, reps))
    if client_p50_ms is not None:
        result["client_p50"] = client_p50_ms * 1e3
        result["http_and_client"] = max(client_p50_ms * 1e3 - result["asgi_total"], 0.0)
    return {k: round(v, 1) for k, v in result.items()}


def evaluate(results: list[dict]) -> list[dict]:
    """Issue 5's targets from the median of each (model, clients, mode) over reps."""

    def med(model, clients, mode, key):
        values = [r[key] for r in results
                  if (r["model"], r["clients"], r["mode"]) == (model, clients, mode) and r[key] is not None]
        return float(np.median(values)) if values else None

    def errors(model, clients):
        return sum(r["errors"] for r in results if (r["model"], r["clients"]) == (model, clients))

    targets = []
    on, off = med("digits", 1, "batching", "rps"), med("digits", 1, "no_batching", "rps")
    if on is not None and off is not None:
        cpu_on = med("digits", 1, "batching", "server_cpu_ms_per_request")
        cpu_off = med("digits", 1, "no_batching", "server_cpu_ms_per_request")
        targets.append({"target": "digits, 1 client: batching throughput >= batching off",
                        "value": round(on / off, 3), "unit": "ratio", "met": on >= off,
                        "server_cpu_ms_per_request": {"batching": cpu_on, "no_batching": cpu_off}})
        p_on, p_off = med("digits", 1, "batching", "p50_ms"), med("digits", 1, "no_batching", "p50_ms")
        targets.append({"target": "digits, 1 client: batching p50 within 10% of batching off",
                        "value": round(p_on / p_off, 3), "unit": "ratio", "met": p_on <= 1.1 * p_off})
    p99 = med("digits", 64, "batching", "p99_ms")
    if p99 is not None:
        targets.append({"target": "digits, 64 clients, batching: p99 < 60 ms with zero errors",
                        "value": round(p99, 1), "unit": "ms", "errors": errors("digits", 64),
                        "met": p99 < 60 and errors("digits", 64) == 0})
    on, off = med("wide", 64, "batching", "rps"), med("wide", 64, "no_batching", "rps")
    if on is not None and off is not None:
        targets.append({"target": "wide, 64 clients: batching >= 5x the throughput of batching off",
                        "value": round(on / off, 2), "unit": "ratio", "met": on >= 5 * off})
    return targets


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 4 * len(names)), squeeze=False)
    for (ax_rps, ax_p99), model in zip(axes, names):
        for mode in ("batching", "no_batching"):
            rows = [r for r in results if r["mode"] == mode and r["model"] == model]
            clients = sorted({r["clients"] for r in rows})
            rps = [np.median([r["rps"] for r in rows if r["clients"] == c]) for c in clients]
            p99 = [np.median([r["p99_ms"] for r in rows if r["clients"] == c]) for c in clients]
            ax_rps.plot(clients, rps, marker="o", label=mode)
            ax_p99.plot(clients, p99, marker="o", label=mode)
        for ax, label in ((ax_rps, "requests / s (median of reps)"), (ax_p99, "p99 latency, ms")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent keep-alive clients")
            ax.set_ylabel(label)
            ax.set_title(model)
            ax.legend()
            ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="server device")
    parser.add_argument("--models", nargs="+", default=["digits", "wide"], choices=["digits", "wide"])
    parser.add_argument("--clients", type=int, nargs="+", default=None,
                        help="client counts (default 1 16 64; --quick: 1 64)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per run (default 3; --quick 2)")
    parser.add_argument("--reps", type=int, default=None, help="A B alternations per client count (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (~1.5 min)")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for warm-up")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/load_<host>.json)")
    args = parser.parse_args(argv)
    clients = args.clients or ([1, 64] if args.quick else [1, 16, 64])
    duration = args.duration or (2.0 if args.quick else 3.0)
    reps = args.reps or (1 if args.quick else 3)
    host = socket.gethostname()
    out = args.out or RESULTS / f"load_{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    work = Path(tempfile.mkdtemp(prefix="fusedserve_load_"))  # the repository, and server logs quoted on failure
    try:
        report = _run(args, work, clients, duration, reps, host, started)
    finally:
        shutil.rmtree(work)
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(report["results"], png, f"fusedserve /infer on {report['device']} ({host})")
    print(f"wrote {out} and {png} in {report['wall_s']:.0f} s")


def _run(args, work: Path, clients: list[int], duration: float, reps: int, host: str, started: float) -> dict:
    repo = write_repository(work / "repo", args.device)
    common = ["--device", args.device, "--model-repository", str(repo)]
    servers = {
        "batching": ServerProcess("batching", [*common, "--max-batch-size", str(args.max_batch_size),
                                               "--max-delay-ms", str(args.max_delay_ms)], work),
        "no_batching": ServerProcess("no_batching", [*common, "--max-batch-size", "1", "--max-delay-ms", "0"],
                                     work),
    }
    results = []
    try:
        for s in servers.values():
            s.wait_ready(args.ready_timeout)
        print(f"servers ready after {time.monotonic() - started:.0f} s", flush=True)
        served = http_json(servers["batching"].url + "/kernel-stats")["served"]
        for model in args.models:
            bodies = request_bodies(model, served[model]["in_features"], args.rows)
            for s in servers.values():  # untimed: first traffic (page faults, lazy setup) skews no run
                asyncio.run(drive(s.port, [build_request(s.port, b) for b in bodies], max(clients), 0.5))
            for n in clients:
                for rep in range(reps):
                    order = list(servers.items()) if rep % 2 == 0 else list(servers.items())[::-1]
                    for mode, s in order:
                        http_json(s.url + "/kernel-stats/reset", "POST")
                        cpu0 = s.cpu_seconds()
                        run = asyncio.run(drive(s.port, [build_request(s.port, b) for b in bodies], n, duration))
                        cpu1 = s.cpu_seconds()
                        # Server CPU per request: steadier than req/s when other processes share the CPUs.
                        run["server_cpu_ms_per_request"] = (None if cpu0 is None or cpu1 is None else
                                                            (cpu1 - cpu0) * 1e3 / max(run["requests"], 1))
                        run.update(model=model, mode=mode, clients=n, rep=rep,
                                   **batch_summary(http_json(s.url + "/kernel-stats"), model))
                        results.append(run)
                        print(f"{model:6s} {mode:12s} clients={n:3d} rep={rep} {run['rps']:8.0f} req/s "
                              f"p50={run['p50_ms']:.2f} ms p99={run['p99_ms']:.2f} ms "
                              f"mean batch={run['mean_batch_rows']:.1f} errors={run['errors']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    p50s = [r["p50_ms"] for r in results if (r["model"], r["clients"], r["mode"]) == ("digits", 1, "batching")]
    digits_body = request_bodies("digits", 64, 1)[0]
    stages = breakdown(args.device, digits_body, float(np.median(p50s)) if p50s else None,
                       reps=300 if args.quick else 1000)
    print("one digits request, median us per stage: " + ", ".join(f"{k}={v}" for k, v in stages.items()))
    targets = evaluate(results)
    for t in targets:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']} {t['unit']}")
    report = {"host": host, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": _gpu_name(args.device),
              "device": served["digits"]["device"], "models": {m: served[m] for m in args.models},
              "rows_per_request": args.rows, "duration_s": duration, "reps": reps,
              "max_batch_size": args.max_batch_size, "max_delay_ms": args.max_delay_ms,
              "cpu_count": os.cpu_count(), "wall_s": round(time.monotonic() - started, 1),
              "digits_request_breakdown_us": stages, "targets": targets, "results": results}
    return report


if __name__ == "__main__":
    main()
