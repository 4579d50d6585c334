"""h2load (nghttp2's C load generator, Debian's nghttp2-client) as a benchmark client: one timed run
of POST requests over HTTP/1.1, read back from its per-request log (``--log-file``).

A C client beside the project's own (``bench/loadgen.py``): a Python client can saturate before the
server does, h2load does not on these hosts. ``find`` looks on PATH, then in a folder holding the
binary and its libraries (``h2load``, ``libnghttp2.so.14``, ``libev.so.4``, ``libjemalloc.so.2``).
Loopback only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench.loadgen import percentiles_ms


def find(folder: str | Path | None = None) -> Path | None:
    """The h2load binary in ``folder`` (with its libraries beside it), else on PATH; None if neither."""
    if folder is not None and (Path(folder) / "h2load").is_file():
        return Path(folder) / "h2load"
    found = shutil.which("h2load")
    return Path(found) if found else None


def read_log(text: str) -> tuple[np.ndarray, dict[str, int]]:
    """Latencies in seconds of the 200s, and the count per status, from h2load's ``--log-file``
    (tab-separated: start in microseconds since the epoch, HTTP status, microseconds to the end of
    the response; status -1 where no response came)."""
    latencies, statuses = [], {}
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) < 3:
            continue
        status = fields[1]
        statuses[status] = statuses.get(status, 0) + 1
        if status == "200":
            latencies.append(int(fields[2]) / 1e6)
    return np.asarray(latencies), dict(sorted(statuses.items()))


def run(binary: Path, port: int, path: str, body: bytes, clients: int, seconds: int, threads: int,
        content_type: str = "application/json") -> dict:
    """``clients`` keep-alive HTTP/1.1 connections sending ``body`` to 127.0.0.1:``port``/``path`` for
    ``seconds`` (whole: h2load's -D takes no fraction); req/s counts the 200s. Returns
    loadgen's fields plus the 200s' ``latencies`` (s)."""
    threads = max(1, min(threads, clients))
    with tempfile.TemporaryDirectory(prefix="h2load-") as work:
        body_file, log_file = Path(work) / "body", Path(work) / "requests.log"
        body_file.write_bytes(body)
        argv = [str(binary), "--h1", "-c", str(clients), "-t", str(threads), "-D", str(seconds),
                "-d", str(body_file), "-H", f"content-type: {content_type}", "--log-file", str(log_file),
                f"http://127.0.0.1:{port}{path}"]
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
        if done.returncode != 0 or not log_file.exists():
            raise RuntimeError(f"h2load exited with {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
        latencies, statuses = read_log(log_file.read_text())
    ok = statuses.get("200", 0)
    return {"generator": "h2load", "requests": ok, "errors": sum(statuses.values()) - ok, "statuses": statuses,
            "seconds": seconds, "rps": round(ok / seconds, 1), **percentiles_ms(latencies), "latencies": latencies}
