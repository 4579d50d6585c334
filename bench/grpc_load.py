"""gRPC against HTTP at the same load: the shipped digits, 1 row per request, N concurrent clients.

One server (``python -m fusedserve serve``, loopback ports) serves every protocol, so each sees the
same process, model and batcher. Loads, run in a rotated order per repetition (A B C, then B C A...)
so drifting machine noise hits all alike:

- ``grpc``: KServe v2 ModelInfer with ``raw_input_contents``, as ``tritonclient.grpc`` sends it, from a
  lean ``grpc.aio`` client: one channel (HTTP/2 connection) per client, the request serialized once,
  answers taken as bytes (no protobuf work per call) and decoded once per run to check them.
  ``grpc_shared``: the same calls multiplexed on one channel, as one shared client object makes them.
  ``grpc_stream``: ModelStreamInfer, one stream per client on its own channel, one request in
  flight per client as in every other load (what ``tritonclient.grpc``'s ``async_stream_infer`` sends).
- ``grpc_raw`` and ``grpc_raw_stream``: the same two calls from a raw-socket HTTP/2 client (frames and
  header block built once, one connection per client, no gRPC library), as the HTTP loads are sent: on
  the 2-core box grpc.aio's client spends ~3x the raw HTTP client's CPU per call, so it, not the
  server, bounds the ``grpc`` loads; these measure the server the way the HTTP loads do.
- ``http_v2``: ``POST /v2/models/digits/infer`` with the binary tensor extension (what
  ``tritonclient.http`` sends), and ``http_infer``: ``POST /infer`` JSON; both from bench/load.py's
  raw-socket keep-alive generator, one connection per client.
- ``grpc_floor`` and ``grpc_stream_floor``: the same gRPC clients against a bare ``grpc.aio`` server
  on the same stubs that answers a canned response (no model, no service): what grpc.aio itself
  costs per call, or per message on a stream, here. ``grpc_raw_floor`` and ``grpc_raw_stream_floor``:
  the raw clients against it, grpc.aio's server side alone.

Each run is bounded by ``--duration`` and each call by a timeout; loopback only. Per run: req/s,
p50/p99, errors, the server's CPU time per request (all its threads, from /proc), the client's, and
the mean batch rows (/kernel-stats). Appends the run to ``OUT/grpc_load.jsonl`` (``bench/runs.py``;
OUT defaults to bench/results): every run as a row, the medians and gRPC's ratios to HTTP per client
count as the summary.

    python bench/grpc_load.py              # ~4 min on the 2-core dev machine
    python bench/grpc_load.py --device cuda --procs 8 --fusedserve-flags "--workers 8"   # a GPU host

``--procs`` spreads each run's clients over that many load-generator processes (one asyncio process
drives ~15-20k req/s), started together, their latencies merged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: bench.load and the service import from the checkout
from bench import runs  # noqa: E402
from bench.h2_client import METHOD, STREAM_METHOD, raw_stream_client, raw_unary_client  # noqa: E402
from bench.loadgen import IO_TIMEOUT_S, read_response, split  # noqa: E402
from bench.servers import ServerProcess, ServerSpec, free_port, fusedserve_spec  # noqa: E402
from fusedserve.service.grpc.calls import length_prefixed  # noqa: E402

MAX_CLIENTS = 256  # a bound on the load this script may generate
SPREAD_START_S = 1.0  # load-generator processes start their clients together, this long after the run is handed out


def rows(n: int = 64) -> np.ndarray:
    """``n`` digits-like rows (raw 0..16 pixel values), 64 wide, float32."""
    return np.random.default_rng(0).uniform(0.0, 16.0, size=(n, 64)).round(3).astype(np.float32)


def grpc_requests(x: np.ndarray) -> list[bytes]:
    from tritonclient.grpc import service_pb2 as pb

    tensor = pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, x.shape[1]])
    return [pb.ModelInferRequest(model_name="digits", inputs=[tensor], raw_input_contents=[row[None].tobytes()])
            .SerializeToString() for row in x]


def http_requests(port: int, x: np.ndarray, kind: str) -> list[bytes]:
    """Whole HTTP/1.1 requests, one row each: ``/infer`` JSON or v2 with the binary extension."""
    out = []
    for row in x:
        if kind == "http_infer":
            path, extra = "/infer", ""
            body = json.dumps({"model": "digits", "inputs": [row.tolist()]}).encode()
        else:
            raw = row.tobytes()
            header = json.dumps({"inputs": [{"name": "input", "shape": [1, len(row)], "datatype": "FP32",
                                             "parameters": {"binary_data_size": len(raw)}}],
                                 "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
            path, body = "/v2/models/digits/infer", header + raw
            extra = f"Inference-Header-Content-Length: {len(header)}\r\n"
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\n"
                f"{extra}Content-Length: {len(body)}\r\n\r\n")
        out.append(head.encode() + body)
    return out


def http_json(url: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=IO_TIMEOUT_S) as r:
        return json.loads(r.read())


async def _http_client(port: int, requests: list[bytes], deadline: float, latencies: list, errors: list) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT_S)
    i = 0
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            writer.write(requests[i % len(requests)])
            status, _ = await asyncio.wait_for(read_response(reader), IO_TIMEOUT_S)
            (latencies.append(time.perf_counter() - t0) if status == 200 else errors.append(status))
            i += 1
    finally:
        writer.close()


def _summary(latencies: list, errors: list, elapsed: float) -> dict:
    lat = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return {"requests": len(latencies), "errors": len(errors), "seconds": elapsed,
            "rps": len(latencies) / elapsed, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "mean_ms": float(lat.mean())}


async def drive(port: int, requests: list[bytes], clients: int, duration_s: float) -> tuple[list, list, float]:
    """``clients`` keep-alive HTTP/1.1 connections in this process sending whole ``requests`` in turn
    (the gRPC clients run in this process too: one load generator for both protocols). Every driver
    returns (latencies in seconds, errors, seconds elapsed)."""
    latencies, errors = [], []
    t0 = time.monotonic()
    await asyncio.gather(*(_http_client(port, requests, t0 + duration_s, latencies, errors) for _ in range(clients)))
    return latencies, errors, time.monotonic() - t0


def _check_answer(message: bytes, streamed: bool) -> None:
    """Raises unless ``message`` (a ModelInferResponse, or ``streamed`` one inside a
    ModelStreamInferResponse) holds one [1, 10] output as raw bytes."""
    from tritonclient.grpc import service_pb2 as pb

    answer = (pb.ModelStreamInferResponse.FromString(message).infer_response if streamed
              else pb.ModelInferResponse.FromString(message))
    if len(answer.raw_output_contents) != 1 or len(answer.outputs) != 1 or list(answer.outputs[0].shape) != [1, 10]:
        raise RuntimeError(f"unexpected answer: {answer}")


async def _grpc_client(call, requests: list[bytes], deadline: float, latencies: list, errors: list) -> None:
    import grpc

    i = 0
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            await call(requests[i % len(requests)], timeout=IO_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            errors.append(exc.code().name)
        else:
            latencies.append(time.perf_counter() - t0)
        i += 1


async def drive_grpc(port: int, requests: list[bytes], clients: int, duration_s: float,
                     channels: int) -> tuple[list, list, float]:
    """Like ``drive``, over gRPC: ``clients`` callers on ``channels`` channels, bytes in and out."""
    import grpc

    # A local subchannel pool: each channel its own connection, not one shared under the hood.
    opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(channels)]
    try:
        calls = [opened[i % channels].unary_unary(METHOD) for i in range(clients)]  # no serializers: bytes
        answers = [await call(requests[0], timeout=IO_TIMEOUT_S) for call in calls]  # connects every channel
        _check_answer(answers[0], streamed=False)
        latencies, errors = [], []
        t0 = time.monotonic()
        await asyncio.gather(*(_grpc_client(call, requests, t0 + duration_s, latencies, errors) for call in calls))
        elapsed = time.monotonic() - t0
    finally:
        await asyncio.gather(*(c.close() for c in opened))
    return latencies, errors, elapsed


async def _stream_client(channel, requests: list[bytes], deadline: float, latencies: list, errors: list) -> None:
    from tritonclient.grpc import service_pb2 as pb

    call = channel.stream_stream(STREAM_METHOD)()  # no serializers: bytes
    i = 0
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            await call.write(requests[i % len(requests)])
            answer = pb.ModelStreamInferResponse.FromString(await asyncio.wait_for(call.read(), IO_TIMEOUT_S))
            if answer.error_message:
                errors.append(answer.error_message)
            else:
                latencies.append(time.perf_counter() - t0)
            i += 1
        await call.done_writing()
    finally:
        call.cancel()


async def drive_stream(port: int, requests: list[bytes], clients: int, duration_s: float) -> tuple[list, list, float]:
    """Like ``drive``, over one ModelStreamInfer stream per client, each on its own channel."""
    import grpc

    opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(clients)]
    try:
        latencies, errors = [], []
        t0 = time.monotonic()
        await asyncio.gather(*(_stream_client(c, requests, t0 + duration_s, latencies, errors) for c in opened))
        elapsed = time.monotonic() - t0
    finally:
        await asyncio.gather(*(c.close() for c in opened))
    if errors:
        print(f"grpc_stream: {len(errors)} answers were errors, the first: {errors[0]}", flush=True)
    return latencies, errors, elapsed


async def drive_raw(port: int, requests: list[bytes], clients: int, duration_s: float,
                    stream: bool) -> tuple[list, list, float]:
    """Like ``drive``, over gRPC from raw-socket HTTP/2 clients (pre-built frames, no gRPC library):
    ModelInfer, or (``stream``) one ModelStreamInfer stream per client. The run's first answer is checked."""
    if not 1 <= clients <= MAX_CLIENTS:
        raise ValueError(f"clients must be 1..{MAX_CLIENTS}")
    messages = [length_prefixed(r) for r in requests]
    client = raw_stream_client if stream else raw_unary_client
    latencies, errors, answers = [], [], []
    t0 = time.monotonic()
    await asyncio.gather(*(client(port, messages, t0 + duration_s, latencies, errors, answers)
                           for _ in range(clients)))
    elapsed = time.monotonic() - t0
    if answers:
        _check_answer(answers[0], stream)
    if errors:
        print(f"grpc_raw{'_stream' if stream else ''}: {len(errors)} calls failed, the first: {errors[0]}", flush=True)
    return latencies, errors, elapsed


def canned_server(port: int) -> None:
    """The floor: grpc.aio on the same stubs and event loop kind, answering one canned response."""
    import grpc
    import uvloop
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

    answer = pb.ModelInferResponse(model_name="digits", model_version="1", outputs=[
        pb.ModelInferResponse.InferOutputTensor(name="output", datatype="FP32", shape=[1, 10])],
        raw_output_contents=[bytes(40)])
    streamed = pb.ModelStreamInferResponse(infer_response=answer)

    class Canned(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            return answer

        async def ModelStreamInfer(self, requests, context):
            async for _ in requests:
                yield streamed

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Canned(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):  # ServerProcess.stop sends SIGTERM
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(0)

    uvloop.run(serve())


class CannedProcess(ServerProcess):
    """``canned_server`` in a subprocess; ServerProcess's CPU reading and stop apply as they are."""

    def __init__(self, log_dir: Path):
        spec = ServerSpec("grpc_floor", ("{python}", str(Path(__file__).resolve()), "--canned-server", "{port}"))
        super().__init__(spec, "cpu", ROOT, log_dir)

    def wait_ready(self, timeout_s: float) -> None:  # no HTTP: ready once its port accepts
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"canned server exited:\n{self.log.read_text()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"canned server not listening after {timeout_s} s")


async def drive_mode(mode: str, port: int, requests: list[bytes], clients: int, duration: float,
                     start_at: float = 0.0) -> tuple[list, list, float]:
    """``mode``'s driver (``port``: HTTP's for the HTTP loads, else gRPC's), from ``start_at`` (monotonic)."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    if mode.startswith("grpc_raw"):
        return await drive_raw(port, requests, clients, duration, mode.startswith("grpc_raw_stream"))
    if mode.startswith("grpc_stream"):
        return await drive_stream(port, requests, clients, duration)
    if mode.startswith("grpc"):
        return await drive_grpc(port, requests, clients, duration, 1 if mode == "grpc_shared" else clients)
    return await drive(port, requests, clients, duration)


def _shard(args: tuple) -> tuple[list, list, float]:
    """One load-generator process's part of a run (``pool``'s workers run this)."""
    return asyncio.run(drive_mode(*args))


def drive_spread(pool, procs: int, mode: str, port: int, requests: list[bytes], clients: int,
                 duration: float) -> dict:
    """``mode``'s clients over ``procs`` processes of ``pool`` (all in this one without a pool), all
    starting together; their latencies merged into one summary."""
    if pool is None:
        return _summary(*asyncio.run(drive_mode(mode, port, requests, clients, duration)))
    start_at = time.monotonic() + SPREAD_START_S
    shares = [n for n in split(clients, procs) if n]
    parts = list(pool.map(_shard, [(mode, port, requests, n, duration, start_at) for n in shares]))
    return _summary([x for p in parts for x in p[0]], [e for p in parts for e in p[1]], max(p[2] for p in parts))


def one_run(mode: str, server: ServerProcess, grpc_port: int, loads: dict, clients: int, duration: float,
            pool=None, procs: int = 1) -> dict:
    """One bounded run of ``mode`` against ``server``, with both sides' CPU time per request (the
    client's only when it ran in this process)."""
    if not mode.endswith("_floor"):
        http_json(server.url + "/kernel-stats/reset", "POST")
    cpu0, client0 = server.cpu_seconds(), os.times()
    port, requests = (server.port, loads[mode]) if mode.startswith("http") else (grpc_port, loads["grpc"])
    r = drive_spread(pool, procs, mode, port, requests, clients, duration)
    cpu1, client1 = server.cpu_seconds(), os.times()
    done = max(r["requests"], 1)
    client_s = client1.user + client1.system - client0.user - client0.system
    r.update(mode=mode, clients=clients,
             server_cpu_ms_per_request=(cpu1 - cpu0) * 1e3 / done if cpu0 is not None else None,
             client_cpu_ms_per_request=client_s * 1e3 / done if pool is None else None)
    if not mode.endswith("_floor"):
        m = http_json(server.url + "/kernel-stats")["models"]["digits"]
        r["mean_batch_rows"] = m["rows"] / m["batches"] if m["batches"] else 0.0
    return r


def summarize(results: list[dict], target: float) -> list[dict]:
    """Medians over repetitions per (clients, mode), and gRPC's ratios to each HTTP load."""

    def med(clients: int, mode: str, key: str) -> float | None:
        values = [r[key] for r in results if (r["clients"], r["mode"]) == (clients, mode) and r.get(key) is not None]
        return float(np.median(values)) if values else None

    rows = []
    for clients in sorted({r["clients"] for r in results}):
        row = {"clients": clients}
        for mode in sorted({r["mode"] for r in results}):
            row[mode] = {k: med(clients, mode, k) for k in ("rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request",
                                                             "client_cpu_ms_per_request", "mean_batch_rows")}
            row[mode]["errors"] = sum(r["errors"] for r in results if (r["clients"], r["mode"]) == (clients, mode))
        for grpc_mode in ("grpc", "grpc_shared", "grpc_stream", "grpc_raw", "grpc_raw_stream"):
            for http in ("http_v2", "http_infer"):
                if grpc_mode in row and http in row:
                    g, h = row[grpc_mode], row[http]
                    ratio = g["rps"] / h["rps"]
                    cpu = g["server_cpu_ms_per_request"] / h["server_cpu_ms_per_request"]
                    row[f"{grpc_mode}_over_{http}"] = {"rps": round(ratio, 3), "met": ratio >= target,
                                                       "server_cpu_per_request": round(cpu, 3)}
        rows.append(row)
    return rows


def _machine() -> dict:
    import grpc
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "grpcio": grpc.__version__, "torch": torch.__version__}


def _gpu() -> str:
    import torch

    return torch.cuda.get_device_name()


def run(args, work: Path) -> dict:
    floors = [] if args.no_floor else ["grpc_floor", "grpc_stream_floor", "grpc_raw_floor", "grpc_raw_stream_floor"]
    modes = ["grpc", "grpc_shared", "grpc_stream", "grpc_raw", "grpc_raw_stream", "http_v2", "http_infer"] + floors
    grpc_port = free_port()
    from fusedserve.models import DEFAULT_REPOSITORY

    # The last --grpc-port wins: this one turns gRPC back on, on a free port.
    spec = fusedserve_spec("fusedserve", ["--grpc-port", str(grpc_port), "--max-batch-size", "64",
                                          "--max-delay-ms", "2", *shlex.split(args.fusedserve_flags)])
    server = ServerProcess(spec, args.device, Path(DEFAULT_REPOSITORY), work)
    canned = None if args.no_floor else CannedProcess(work)
    # mode -> (the process it loads, the gRPC port its client calls)
    targets = {mode: (server, grpc_port) for mode in modes}
    pool = ProcessPoolExecutor(args.procs, mp_context=get_context("spawn")) if args.procs > 1 else None
    try:
        server.wait_ready(args.ready_timeout)
        if canned is not None:
            canned.wait_ready(30)
            targets.update({floor: (canned, canned.port) for floor in floors})
        x = rows()
        loads = {"grpc": grpc_requests(x), "http_v2": http_requests(server.port, x, "http_v2"),
                 "http_infer": http_requests(server.port, x, "http_infer")}
        results = measure(args, modes, targets, loads, pool)
    finally:
        server.stop()
        if canned is not None:
            canned.stop()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return {"results": results, "summary": summarize(results, args.target)}


def measure(args, modes: list[str], targets: dict, loads: dict, pool) -> list[dict]:
    """Every mode at every client count, ``args.reps`` times in rotated order, after one untimed pass."""
    for mode in modes:  # untimed: first traffic (connections, page faults) skews no run
        one_run(mode, *targets[mode], loads, max(args.clients), 0.5, pool, args.procs)
    results = []
    for clients in args.clients:
        for rep in range(args.reps):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                r = one_run(mode, *targets[mode], loads, clients, args.duration, pool, args.procs)
                results.append({**r, "rep": rep})
                print(f"{mode:21s} clients={clients:3d} rep={rep} {r['rps']:7.0f} req/s p50 {r['p50_ms']:6.2f} ms "
                      f"p99 {r['p99_ms']:6.2f} ms server {r['server_cpu_ms_per_request'] or 0:.3f} ms/req "
                      f"errors {r['errors']}", flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 64], help="client counts (default 1 64)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run (default 3)")
    parser.add_argument("--reps", type=int, default=4, help="repetitions per client count and load (default 4)")
    parser.add_argument("--target", type=float, default=1.2, help="gRPC req/s over HTTP's asked for (issue 22)")
    parser.add_argument("--no-floor", action="store_true", help="skip the bare grpc.aio server (all floors)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for warm-up")
    runs.arguments(parser)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where fusedserve runs the model")
    parser.add_argument("--procs", type=int, default=1,
                        help="load-generator processes, the clients spread over them (a GPU host: 8)")
    parser.add_argument("--fusedserve-flags", default="", help='extra flags for fusedserve, e.g. "--workers 8"')
    parser.add_argument("--canned-server", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.canned_server is not None:
        canned_server(args.canned_server)
        return
    if not 1 <= max(args.clients) <= MAX_CLIENTS or min(args.clients) < 1:
        parser.error(f"client counts must be 1..{MAX_CLIENTS}")
    if not 1 <= args.procs <= 64:
        parser.error("--procs must be 1..64")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fusedserve_grpc_load_") as work:
        report = run(args, Path(work))
    line = runs.Run("grpc_load", args.out, gpu=_gpu() if args.device == "cuda" else None, note=args.note,
                    machine=_machine(), model="digits (shipped)", device=args.device, procs=args.procs,
                    fusedserve_flags=args.fusedserve_flags, rows_per_request=1, duration_s=args.duration,
                    reps=args.reps, target=args.target, wall_s=round(time.monotonic() - started, 1))
    line.save(report["results"], report["summary"])
    for row in report["summary"]:
        print(json.dumps({k: v for k, v in row.items() if "_over_" in k or k == "clients"}))
    print(f"appended the run to {line.path} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
