"""Where a server's CPU time goes: py-spy samples of it under load, and one digits request's stages.

``record`` attaches py-spy (``--subprocesses``: a server's worker processes too; ``--nonblocking``:
the server is never paused) and writes raw collapsed stacks; ``summarize_stacks`` shares them out
by the area each frame's file belongs to. py-spy samples only threads that are running, so the
shares are of the server's busy time. ``stages`` times one request's steps inside this process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

# Area of a frame by the first folder of its file as py-spy prints it (relative to site-packages or
# the checkout; a namespace package such as opentelemetry loses its top folder: trace/, context/).
_EVENT_LOOP = "asyncio/uvloop (event loop)"
AREAS = {
    "service": "fusedserve service (routes, batcher, stats, middleware)",
    "models": "fusedserve models (runner)",
    "kernels": "fusedserve kernels",
    "torch": "torch",
    "uvicorn": "uvicorn (HTTP/1.1 protocol)",
    "starlette": "starlette/FastAPI (framework)",
    "fastapi": "starlette/FastAPI (framework)",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",
    "trace": "opentelemetry (FastAPI's telemetry check)",
    "context": "opentelemetry (FastAPI's telemetry check)",
    "prometheus_client": "prometheus_client (metrics)",
    "logging": "logging",
    "asyncio": _EVENT_LOOP,
    "uvloop": _EVENT_LOOP,
    "numpy": "numpy",
    "orjson": "orjson",
    "concurrent": "threads",
}


def py_spy() -> str | None:
    """The py-spy binary: beside this interpreter (a venv) or on PATH; None where not installed."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen:
    """Starts sampling ``pid`` and its children for ``seconds``; raw collapsed stacks go to ``out``."""
    argv = [py_spy(), "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--format", "raw",
            "--rate", str(rate), "--duration", str(max(int(round(seconds)), 1)), "--output", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def thread_ticks(pids: list[int], proc: Path = Path("/proc")) -> dict[tuple[int, int], int]:
    """(pid, tid) -> CPU ticks of every thread of ``pids`` (threads that end meanwhile are missed)."""
    ticks = {}
    for pid in pids:
        try:
            tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                fields = (proc / str(pid) / "task" / str(tid) / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks[(pid, tid)] = int(fields[11]) + int(fields[12])
    return ticks


def thread_split(before: dict, after: dict, root: int) -> dict:
    """CPU seconds between two ``thread_ticks`` snapshots: the main thread of the root process (the
    event loop), its other threads (torch's pool, batch worker), and child processes."""
    split = {"main_thread_s": 0.0, "other_threads_s": 0.0, "child_processes_s": 0.0}
    hz = os.sysconf("SC_CLK_TCK")
    for (pid, tid), ticks in after.items():
        key = "child_processes_s" if pid != root else "main_thread_s" if tid == pid else "other_threads_s"
        split[key] += (ticks - before.get((pid, tid), 0)) / hz
    return {k: round(v, 3) for k, v in split.items()}


def area(frame: str) -> str | None:
    """The area of one py-spy frame, ``function (folder/file.py:line)``; None for a frame of a
    single-file standard module (``<frozen os>``, ``contextlib.py``): its caller's area counts."""
    where = frame.rsplit("(", 1)[-1].rsplit(":", 1)[0]
    if "/" not in where:
        return "threads" if where == "threading.py" else None
    return AREAS.get(where.split("/", 1)[0], "other")


def self_area(stack: tuple[str, ...]) -> str:
    """The area of the innermost frame that has one."""
    return next((a for a in map(area, reversed(stack)) if a is not None), "other")


def parse_stacks(text: str) -> Counter:
    """Collapsed stacks (``frame;frame;... count`` per line) -> Counter of frame tuples.

    Frames that name a process or thread (``process 12:"..."``, ``thread (0x...)``) are dropped."""
    stacks = Counter()
    for (_, frames), n in parse_stacks_by_process(text).items():
        stacks[frames] += n
    return stacks


def parse_stacks_by_process(text: str) -> Counter:
    """Like ``parse_stacks``, keyed by ``(role, frames)``: the role is the module of the innermost
    process frame (``process 12:"python -m fusedserve.service.workers.engine_process ..."`` ->
    ``engine_process``), or ``""`` where py-spy named no process."""
    stacks = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        processes = [p for p in parts if p.startswith("process ")]  # the root's, then its child's
        role = _role(processes[-1]) if processes else ""
        frames = tuple(f for f in parts if not f.startswith(("process ", "thread ")))
        if frames:
            stacks[(role, frames)] += int(count)
    return stacks


def _role(process_frame: str) -> str:
    argv = process_frame.split(":", 1)[-1].strip('"').split()
    return argv[argv.index("-m") + 1].rsplit(".", 1)[-1] if "-m" in argv[:-1] else "main"


def summarize_by_process(text: str, top: int = 15) -> dict:
    """``summarize_stacks`` for each process role (engine, front ends, ...) of a py-spy recording."""
    roles: dict[str, Counter] = {}
    for (role, frames), n in parse_stacks_by_process(text).items():
        roles.setdefault(role, Counter())[frames] += n
    return {role: summarize_stacks(stacks, top) for role, stacks in roles.items()}


def summarize_stacks(stacks: Counter, top: int = 15) -> dict:
    """Shares of samples: by the area of the innermost frame (self), by areas anywhere in the stack
    (inclusive: under our route, say), and the innermost frames that take the most."""
    total = sum(stacks.values())
    if not total:
        return {"samples": 0}
    by_self, by_incl, frames = Counter(), Counter(), Counter()
    for stack, n in stacks.items():
        by_self[self_area(stack)] += n
        frames[stack[-1]] += n
        for name in {area(f) for f in stack} - {None}:
            by_incl[name] += n

    def shares(counter, k=None):
        return [{"what": what, "share": round(n / total, 4)} for what, n in counter.most_common(k)]

    return {"samples": total, "self_by_area": shares(by_self), "inclusive_by_area": shares(by_incl),
            "top_self_frames": shares(frames, top)}


def _median_us(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples) * 1e6)


async def _one_asgi_request(app, body: bytes) -> None:
    """POST /infer through the ASGI app as a server would call it, with no socket."""
    headers = [(b"host", b"bench"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/infer", "raw_path": b"/infer", "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
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

    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"in-process /infer answered {sent[0]['status']}: {sent[-1].get('body')!r}")


async def _stages(device: str, body: bytes, reps: int) -> dict:
    import torch

    from fusedserve.service.app import create_app
    from fusedserve.service.http.codec import dump_json, parse_json, rows_from_json
    from fusedserve.service.settings import Settings

    # The shipped digits model, HTTP only.
    app = create_app(Settings(device=device, max_batch_size=64, gc_freeze=False, grpc_port=0))
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
        for _ in range(50):  # warm: the first calls measure each path and settle the batcher's choice
            await _one_asgi_request(app, body)
        stages = {"parse_json": _median_us(lambda: parse_json(body), reps),
                  "validate": _median_us(lambda: rows_from_json(parsed["inputs"], "inputs", runner.in_features, 64),
                                         reps),
                  "compute": _median_us(lambda: runner.run(torch.from_numpy(x)), reps),
                  "serialize": _median_us(lambda: dump_json({"model": "digits", "outputs": out}), reps)}
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
            await _one_asgi_request(app, body)
            samples.append(time.perf_counter() - t0)
        asgi = float(np.median(samples) * 1e6)
    # Body reading, routing, middleware, request/response objects, stats: the app's rest.
    stages["framework"] = max(asgi - sum(stages.values()), 0.0)
    return {"asgi_total": asgi, **stages}


def stages(device: str, body: bytes, client_p50_ms: float | None, reps: int) -> dict:
    """Median microseconds of each stage of one digits request on an idle app, in this process.

    ``asgi_total`` is the whole app called with the request (no socket); ``framework`` is what of it
    no named stage covers; ``http_and_client``, the 1-client p50 measured over loopback less
    ``asgi_total``: uvicorn's HTTP handling, the sockets and the load generator."""
    result = asyncio.run(_stages(device, body, reps))
    if client_p50_ms is not None:
        result["client_p50"] = client_p50_ms * 1e3
        result["http_and_client"] = max(client_p50_ms * 1e3 - result["asgi_total"], 0.0)
    return {k: round(v, 1) for k, v in result.items()}
