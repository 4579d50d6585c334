"""One stats object for /kernel-stats and /v2/models/{m}/stats: per-layer kernel timings, batch sizes,
queue waits and per-model request counts. The runner thread writes, request handlers read: a lock."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # a front-end process of --workers N never imports torch (models/)
    from fusedserve.models.timing import LayerTiming

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _percentiles(samples: deque) -> tuple[float, float]:
    if not samples:
        return 0.0, 0.0
    p50, p99 = np.percentile(np.fromiter(samples, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


@dataclass
class _LayerSeries:
    samples: deque
    count: int = 0
    total: float = 0.0


@dataclass
class _ModelSeries:
    waits: deque
    batch_sizes: Counter = field(default_factory=Counter)
    batches: int = 0
    rows: int = 0
    compute_s: float = 0.0
    wait_total_s: float = 0.0
    wait_count: int = 0
    success: int = 0
    success_s: float = 0.0
    failures: int = 0
    failure_s: float = 0.0
    last_inference_ms: int = 0
    # Request latency samples (queue + compute, as the engine saw it) and every answer by outcome.
    latencies: deque = field(default_factory=deque)
    outcomes: Counter = field(default_factory=Counter)


def _plain(value):
    """A series field as JSON holds it: deques as lists, counters as dicts."""
    return list(value) if isinstance(value, deque) else dict(value) if isinstance(value, Counter) else value


def _absorb(series: _ModelSeries, row: dict) -> None:
    """Add one exported model series (``_plain`` fields) into ``series``."""
    for f in fields(series):
        value, mine = row[f.name], getattr(series, f.name)
        if isinstance(mine, deque):
            mine.extend(value)
        elif isinstance(mine, Counter):  # batch sizes come back from JSON with text keys
            mine.update({int(k) if f.name == "batch_sizes" else k: n for k, n in value.items()})
        elif f.name == "last_inference_ms":
            series.last_inference_ms = max(mine, value)
        else:
            setattr(series, f.name, mine + value)


class ServiceStats:
    """Aggregates ``LayerTiming`` records per (model, layer, M, dtype, backend, kernel, config)."""

    def __init__(self, reservoir: int = 1024):
        if reservoir < 1:
            raise ValueError(f"reservoir must be >= 1, got {reservoir}")
        self._reservoir = reservoir
        self._lock = threading.Lock()
        self._layers: dict[tuple, _LayerSeries] = {}
        self._models: dict[str, _ModelSeries] = {}
        self._unattributed: Counter = Counter()  # outcomes of requests refused before naming a model
        self._since = time.time()

    def _model(self, name: str) -> _ModelSeries:
        series = self._models.get(name)
        if series is None:
            series = self._models[name] = _ModelSeries(waits=deque(maxlen=self._reservoir),
                                                       latencies=deque(maxlen=self._reservoir))
        return series

    def record_layer(self, timing: LayerTiming) -> None:
        key = (timing.model, timing.layer, timing.M, timing.N, timing.K, timing.dtype,
               timing.backend, timing.kernel, timing.config)
        with self._lock:
            series = self._layers.get(key)
            if series is None:
                series = self._layers[key] = _LayerSeries(samples=deque(maxlen=self._reservoir))
            series.count += 1
            series.total += timing.seconds
            series.samples.append(timing.seconds)

    def record_batch(self, model: str, rows: int, waits: list[float], compute_s: float) -> None:
        """One batch ran: its row count, each request's queue wait and the runner's wall time."""
        with self._lock:
            series = self._model(model)
            series.batch_sizes[rows] += 1
            series.batches += 1
            series.rows += rows
            series.compute_s += compute_s
            series.waits.extend(waits)
            series.wait_total_s += sum(waits)
            series.wait_count += len(waits)
            series.last_inference_ms = int(time.time() * 1000)

    def record_request(self, model: str, ok: bool, seconds: float, count: int = 1) -> None:
        """``count`` requests answered together (one group of a front end), each after ``seconds``."""
        with self._lock:
            series = self._model(model)
            if count == 1:
                series.latencies.append(seconds)
            else:
                series.latencies.extend([seconds] * count)
            if ok:
                series.success += count
                series.success_s += seconds * count
            else:
                series.failures += count
                series.failure_s += seconds * count

    def record_outcome(self, model: str, outcome: str, count: int = 1) -> None:
        """Requests answered, by the outcome label /metrics counts them under ("ok", "bad_input"...)."""
        with self._lock:
            (self._model(model).outcomes if model else self._unattributed)[outcome] += count

    def reset(self) -> None:
        with self._lock:
            self._layers.clear()
            self._models.clear()
            self._unattributed.clear()
            self._since = time.time()

    def snapshot(self) -> dict:
        with self._lock:
            layers = [self._layer_row(key, s) for key, s in self._layers.items()]
            models = {name: self._model_row(s) for name, s in self._models.items()}
            since, unattributed = self._since, dict(self._unattributed)
        layers.sort(key=lambda row: (row["model"], row["layer"], row["M"]))
        return {"since_unix_s": since, "layers": layers, "models": models, "unattributed_outcomes": unattributed}

    def export(self) -> dict:
        """Every series with its samples, as JSON: what ``merged`` adds up over several engines."""
        with self._lock:
            layers = [[list(key), s.count, s.total, list(s.samples)] for key, s in self._layers.items()]
            models = {name: {f.name: _plain(getattr(s, f.name)) for f in fields(s)} for name, s in self._models.items()}
            return {"since_unix_s": self._since, "reservoir": self._reservoir, "layers": layers, "models": models,
                    "unattributed": dict(self._unattributed)}

    @classmethod
    def merged(cls, exports: list[dict]) -> ServiceStats:
        """One stats object holding every export's series (several engines' ``export``): counts and
        sums add up, and each keeps its samples, so percentiles span every engine's recent ones."""
        total = cls(reservoir=max(1, sum(e["reservoir"] for e in exports)))
        total._since = min((e["since_unix_s"] for e in exports), default=total._since)
        for export in exports:
            for key, count, seconds, samples in export["layers"]:
                series = total._layers.setdefault(tuple(key), _LayerSeries(samples=deque(maxlen=total._reservoir)))
                series.count += count
                series.total += seconds
                series.samples.extend(samples)
            for name, row in export["models"].items():
                _absorb(total._model(name), row)
            total._unattributed.update(export["unattributed"])
        return total

    def model_counts(self, model: str) -> dict:
        """Raw counters of one model, for the Open Inference Protocol statistics route."""
        with self._lock:
            s = self._models.get(model)
            if s is None:
                s = _ModelSeries(waits=deque())
            return {"success": s.success, "success_s": s.success_s, "failures": s.failures,
                    "failure_s": s.failure_s, "rows": s.rows, "batches": s.batches,
                    "compute_s": s.compute_s, "wait_total_s": s.wait_total_s,
                    "wait_count": s.wait_count, "last_inference_ms": s.last_inference_ms,
                    "batch_sizes": dict(s.batch_sizes)}

    @staticmethod
    def _layer_row(key: tuple, s: _LayerSeries) -> dict:
        model, layer, m, n, k, dtype, backend, kernel, config = key
        mean = s.total / s.count
        p50, p99 = _percentiles(s.samples)
        nbytes = (m * k + n * k + n + m * n) * ELEMENT_BYTES.get(dtype, 4)
        return {
            "model": model, "layer": layer, "M": m, "N": n, "K": k, "dtype": dtype,
            "backend": backend, "kernel": kernel, "config": config, "calls": s.count,
            "total_s": s.total, "mean_s": mean, "p50_s": p50, "p99_s": p99,
            # Achieved rates from the mean time: 2*M*N*K flops, and every operand touched once.
            "tflops": 2.0 * m * n * k / mean / 1e12 if mean > 0 else 0.0,
            "gbps": nbytes / mean / 1e9 if mean > 0 else 0.0,
        }

    @staticmethod
    def _model_row(s: _ModelSeries) -> dict:
        p50, p99 = _percentiles(s.waits)
        latency_p50, latency_p99 = _percentiles(s.latencies)
        answered = s.success + s.failures
        return {
            "batches": s.batches, "rows": s.rows, "compute_s": s.compute_s,
            "batch_size_histogram": {str(k): v for k, v in sorted(s.batch_sizes.items())},
            "queue_wait": {"count": s.wait_count,
                           "mean_s": s.wait_total_s / s.wait_count if s.wait_count else 0.0,
                           "p50_s": p50, "p99_s": p99},
            "requests": {"success": s.success, "failed": s.failures},
            "latency": {"count": answered, "mean_s": (s.success_s + s.failure_s) / answered if answered else 0.0,
                        "p50_s": latency_p50, "p99_s": latency_p99},
            "outcomes": dict(s.outcomes),
        }
