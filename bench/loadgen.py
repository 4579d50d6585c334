"""The load generator: keep-alive HTTP/1.1 clients on raw asyncio streams, spread over processes.

One asyncio process drives ~4k req/s on a core of the 2-core dev machine and ~15-20k on a fast one
(httpx costs ~6 ms of CPU per request: no load generator). A run splits a fixed number of clients
over ``procs`` worker processes; each opens its connections, waits for a start time shared by all
(CLOCK_MONOTONIC is system-wide), then sends until the deadline or its share of the request cap.
``merge`` puts the processes' results together: req/s, percentiles over every latency, statuses.
Loopback only: the target is always 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np

IO_TIMEOUT_S = 30.0
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Shard:
    """One process's share of a run: ``clients`` connections sending ``bodies`` in turn."""

    port: int
    path: str
    bodies: tuple[bytes, ...]
    clients: int
    start_at: float  # time.monotonic() at which every process starts sending
    duration_s: float
    max_requests: int  # this process's share of the run's request cap
    headers: tuple[tuple[str, str], ...] = ()  # besides Host and Content-Length; JSON's Content-Type unless named


@dataclass
class Tally:
    """What one process saw: latencies of 200s (seconds), statuses and transport errors by name."""

    latencies: list = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    sent: int = 0
    last: float = 0.0  # time.monotonic() of the last answer


def default_procs() -> int:
    """Load generator processes: half the cores, 2 to 8 (the servers need the other half)."""
    return max(2, min(8, (os.cpu_count() or 1) // 2))


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal non-negative integers, larger first, that add up to it."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def plan_shards(port: int, path: str, bodies: list[bytes], clients: int, procs: int, start_at: float,
                duration_s: float, max_requests: int, headers: tuple = ()) -> list[Shard]:
    """Clients over at most ``procs`` processes (none gets zero), the request cap pro rata."""
    counts = [c for c in split(clients, min(procs, clients)) if c]
    return [Shard(port, path, tuple(bodies), c, start_at, duration_s, math.ceil(max_requests * c / clients),
                  tuple(headers)) for c in counts]


def build_request(port: int, path: str, body: bytes, headers: tuple = ()) -> bytes:
    named = {name.lower() for name, _ in headers}
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
             *([] if "content-type" in named else ["Content-Type: application/json"]),
             *(f"{name}: {value}" for name, value in headers), f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def parse_head(head: bytes) -> tuple[int, int | None, bool]:
    """Status, Content-Length (None when chunked) and whether the server closes the connection."""
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, chunked, close = 0, False, False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding":
            chunked = "chunked" in value
        elif name == "connection":
            close = value == "close"
    return status, None if chunked else length, close


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Reads one response (Content-Length or chunked body); returns its status and Connection: close."""
    status, length, close = parse_head(await reader.readuntil(b"\r\n\r\n"))
    if length is not None:
        await reader.readexactly(length)
        return status, close
    while True:  # chunked: size line, data, CRLF; a zero size ends it (no trailers expected)
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return status, close


async def _connect(port: int):
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT_S)


async def _client(shard: Shard, requests: list[bytes], offset: int, tally: Tally, start: asyncio.Event) -> None:
    """One keep-alive connection: request, answer, next; reconnects after a close or an error."""
    deadline = shard.start_at + shard.duration_s
    conn = None
    try:
        conn = await _connect(shard.port)
    except (OSError, asyncio.TimeoutError) as exc:
        tally.errors[f"connect:{type(exc).__name__}"] += 1
    await start.wait()
    i = offset
    while time.monotonic() < deadline and tally.sent < shard.max_requests:
        tally.sent += 1  # before any await: the clients of this process share the cap
        try:
            if conn is None:
                conn = await _connect(shard.port)
            t0 = time.perf_counter()
            conn[1].write(requests[i % len(requests)])
            status, close = await asyncio.wait_for(read_response(conn[0]), IO_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            tally.errors[type(exc).__name__] += 1
            close = True
            await asyncio.sleep(0.01)  # a refused or reset connection: no busy loop until the deadline
        else:
            tally.last = time.monotonic()
            tally.statuses[status] += 1
            if status == 200:
                tally.latencies.append(time.perf_counter() - t0)
        i += 1
        if close and conn is not None:
            conn[1].close()
            conn = None
    if conn is not None:
        conn[1].close()


async def drive(shard: Shard) -> Tally:
    """Runs one shard's clients in this process; they all start sending at ``shard.start_at``."""
    requests = [build_request(shard.port, shard.path, b, shard.headers) for b in shard.bodies]
    tally, start = Tally(), asyncio.Event()
    tasks = [asyncio.create_task(_client(shard, requests, k, tally, start)) for k in range(shard.clients)]
    await asyncio.sleep(max(shard.start_at - time.monotonic(), 0.0))
    start.set()
    await asyncio.gather(*tasks)
    return tally


def _new_loop():
    try:
        import uvloop  # uvicorn[standard] brings it: a cheaper client loop, more load per process
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_shard(shard: Shard) -> dict:
    """Entry point in a worker process: the shard's tally, plus this process's CPU seconds for it."""
    cpu0 = time.process_time()
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        tally = runner.run(drive(shard))
    return {"latencies": np.asarray(tally.latencies, dtype=np.float64), "statuses": dict(tally.statuses),
            "errors": dict(tally.errors), "clients": shard.clients,
            "elapsed_s": max(tally.last - shard.start_at, 0.0), "cpu_s": time.process_time() - cpu0}


def percentiles_ms(latencies_s: np.ndarray) -> dict:
    """p50/p90/p99, mean and max in milliseconds; None for each when there is no latency."""
    keys = [f"p{q}_ms" for q in PERCENTILES] + ["mean_ms", "max_ms"]
    if len(latencies_s) == 0:
        return dict.fromkeys(keys)
    ms = np.asarray(latencies_s) * 1e3
    values = [*np.percentile(ms, PERCENTILES), ms.mean(), ms.max()]
    return {k: round(float(v), 3) for k, v in zip(keys, values, strict=True)}


def merge(parts: list[dict], duration_s: float, keep_latencies: bool = False) -> dict:
    """One run's result from its processes' ``run_shard`` results.

    req/s counts 200s over the time from the shared start to the last answer of any process (the
    duration when nothing was answered); percentiles are over every 200's latency of every process
    (``keep_latencies``: those latencies too, in seconds, to pool several runs)."""
    latencies = np.concatenate([p["latencies"] for p in parts]) if parts else np.array([])
    statuses, errors = Counter(), Counter()
    for p in parts:
        statuses.update({str(k): v for k, v in p["statuses"].items()})
        errors.update(p["errors"])
    elapsed = max((p["elapsed_s"] for p in parts), default=0.0) or duration_s
    ok = int(statuses.get("200", 0))
    failed = sum(v for k, v in statuses.items() if k != "200") + sum(errors.values())
    merged = {"requests": ok, "errors": failed, "statuses": dict(sorted(statuses.items())),
              "transport_errors": dict(sorted(errors.items())), "seconds": round(elapsed, 4),
              "rps": round(ok / elapsed, 1), **percentiles_ms(latencies),
              "processes": len(parts), "client_cpu_s": round(sum(p["cpu_s"] for p in parts), 4)}
    return {**merged, "latencies": latencies} if keep_latencies else merged


class LoadPool:
    """Worker processes kept for the whole benchmark (spawned: the parent may hold torch's threads)."""

    def __init__(self, procs: int):
        self.procs = procs
        self._pool = ProcessPoolExecutor(max_workers=procs, mp_context=get_context("spawn"))
        list(self._pool.map(time.sleep, [0.0] * procs))  # start them all now, not in the first run

    def run(self, port: int, path: str, bodies: list[bytes], clients: int, duration_s: float,
            max_requests: int, lead_s: float = 0.5, headers: tuple = (), keep_latencies: bool = False) -> dict:
        """One run: ``clients`` over the processes, sending from ``lead_s`` from now for ``duration_s``."""
        start_at = time.monotonic() + lead_s  # time for every process to connect its clients
        shards = plan_shards(port, path, bodies, clients, self.procs, start_at, duration_s, max_requests, headers)
        return merge(list(self._pool.map(run_shard, shards)), duration_s, keep_latencies)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
