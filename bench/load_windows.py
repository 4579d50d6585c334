"""Load in short windows while a server's background tuning runs, and after it: each model under each
load generator (h2load, the C one, and the project's own), so req/s and p99 while tuning can be set
against the same load once tuning has finished.

A round is one window per (model, generator), back to back. Windows are labelled after the fact
from when tuning finished: "tuning" (ended before), "steady" (started after) or "mixed" (left out
of the comparison). Loopback only, bounded by the caller's rounds and timeouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import h2load
from bench.loadgen import LoadPool, percentiles_ms

RPS_RATIO_MIN, P99_RATIO_MAX = 0.8, 1.5  # issue 38: while tuning, against steady


@dataclass
class LoadWindows:
    """``clients`` connections for ``seconds`` per window, to each model's body in ``bodies``."""

    port: int
    bodies: dict[str, bytes]  # model -> one JSON /infer body
    clients: int
    seconds: int  # whole: h2load's -D takes no fraction
    pool: LoadPool | None  # the project's generator (None: not run)
    h2load_binary: Path | None  # the C generator (None: not run)
    threads: int = 4  # h2load's threads

    def generators(self) -> list[str]:
        return [name for name, there in (("h2load", self.h2load_binary), ("loadgen", self.pool)) if there]

    def window(self, model: str, generator: str) -> dict:
        """One window's result (``latencies`` in seconds included), stamped with its start and end."""
        started = time.perf_counter()
        if generator == "h2load":
            result = h2load.run(self.h2load_binary, self.port, "/infer", self.bodies[model], self.clients,
                                self.seconds, self.threads)
        else:
            result = self.pool.run(self.port, "/infer", [self.bodies[model]], self.clients, self.seconds,
                                   max_requests=10**9, keep_latencies=True)
        return {**result, "model": model, "generator": generator, "started": started, "ended": time.perf_counter()}

    def round(self) -> list[dict]:
        return [self.window(model, generator) for model in self.bodies for generator in self.generators()]


def label(windows: list[dict], tuned_at: float | None) -> None:
    """Each window's ``phase`` from ``tuned_at`` (time.perf_counter() when tuning finished; None: never)."""
    for w in windows:
        if tuned_at is None or w["ended"] <= tuned_at:
            w["phase"] = "tuning"
        else:
            w["phase"] = "steady" if w["started"] >= tuned_at else "mixed"


def _pooled(windows: list[dict]) -> tuple[float | None, float | None]:
    """req/s (200s over seconds) and p99 in ms over every window's latencies; None where no window."""
    if not windows:
        return None, None
    rps = sum(w["requests"] for w in windows) / sum(w["seconds"] for w in windows)
    latencies = np.concatenate([np.asarray(w["latencies"]) for w in windows])
    return round(rps, 1), percentiles_ms(latencies)["p99_ms"]


def compare(windows: list[dict]) -> list[dict]:
    """Per (model, generator): req/s and p99 while tuning and steady, their ratios, and whether they
    meet ``RPS_RATIO_MIN`` and ``P99_RATIO_MAX``."""
    rows = []
    for key in sorted({(w["model"], w["generator"]) for w in windows}):
        mine = [w for w in windows if (w["model"], w["generator"]) == key]
        (rps_t, p99_t), (rps_s, p99_s) = (_pooled([w for w in mine if w["phase"] == p]) for p in ("tuning", "steady"))
        rps_ratio = round(rps_t / rps_s, 3) if rps_t is not None and rps_s else None
        p99_ratio = round(p99_t / p99_s, 3) if p99_t is not None and p99_s else None
        rows.append(dict(model=key[0], generator=key[1], rps_tuning=rps_t, rps_steady=rps_s, rps_ratio=rps_ratio,
                         p99_ms_tuning=p99_t, p99_ms_steady=p99_s, p99_ratio=p99_ratio,
                         windows={p: sum(w["phase"] == p for w in mine) for p in ("tuning", "mixed", "steady")},
                         errors=sum(w["errors"] for w in mine),
                         met=rps_ratio is not None and p99_ratio is not None and rps_ratio >= RPS_RATIO_MIN
                         and p99_ratio <= P99_RATIO_MAX))
    return rows


def stored(windows: list[dict]) -> list[dict]:
    """The windows as a results line keeps them: no latencies, times relative to the first start."""
    t0 = min((w["started"] for w in windows), default=0.0)
    keep = ("model", "generator", "phase", "rps", "p50_ms", "p99_ms", "requests", "errors")
    return [{**{k: w.get(k) for k in keep}, "at_s": round(w["started"] - t0, 2)} for w in windows]
