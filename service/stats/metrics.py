"""Prometheus metrics, in a registry owned by one app (two apps in one process never collide)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:  # a front-end process of --workers N never imports torch (models/)
    from fusedserve.models.timing import LayerTiming

# Seconds: 50 us (one small GPU batch) to 10 s (a deadline).
_TIME_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 10)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Queue(Protocol):
    @property
    def queued_rows(self) -> int: ...


class _QueuedRows:
    """``fusedserve_queued_rows``, read from each model's batcher at scrape time: the load signal an
    autoscaler scales on (deploy/base/hpa.yaml, through prometheus-adapter)."""

    def __init__(self, queues: Mapping[str, _Queue]):
        self._queues = queues

    def collect(self):
        family = GaugeMetricFamily("fusedserve_queued_rows", "Rows waiting in a model's queue for a batch",
                                   labels=["model"])
        for model, queue in sorted(self._queues.items()):
            family.add_metric([model], queue.queued_rows)
        yield family


class _ModelReadiness:
    """``fusedserve_model_ready`` (1: answers requests) and ``fusedserve_model_failed`` (by stage: load
    or warmup), read from ``read() -> {model: (ready, failed stage or None)}`` at each scrape."""

    def __init__(self, read: Callable[[], Mapping[str, tuple[bool, str | None]]]):
        self._read = read

    def collect(self):
        ready = GaugeMetricFamily("fusedserve_model_ready", "1 when the model answers requests, else 0",
                                  labels=["model"])
        failed = GaugeMetricFamily("fusedserve_model_failed", "1 for a model that failed to load or warm up",
                                   labels=["model", "stage"])
        for model, (ok, stage) in sorted(self._read().items()):
            ready.add_metric([model], 1.0 if ok else 0.0)
            if stage:
                failed.add_metric([model, stage], 1.0)
        yield ready
        yield failed


class Metrics:
    def __init__(self, on_request: Callable[[str, str], None] | None = None):
        """``on_request(model, outcome)`` also hears every request counted (the stats object's
        ``record_outcome``: errors by status there clear on reset, Prometheus counters never do)."""
        disable_created_metrics()  # no *_created twin beside every counter and histogram
        self.registry = CollectorRegistry()
        self._on_request = on_request
        r = self.registry
        ProcessCollector(registry=r)  # CPU, memory, descriptors of the process that serves /metrics
        self.requests = Counter("fusedserve_requests", "Inference requests by model and outcome",
                                ["model", "outcome"], registry=r)
        self.rows = Counter("fusedserve_rows", "Rows computed", ["model"], registry=r)
        self.queue_wait = Histogram("fusedserve_queue_wait_seconds", "Time a request waited for its batch",
                                    ["model"], buckets=_TIME_BUCKETS, registry=r)
        self.compute = Histogram("fusedserve_batch_compute_seconds", "Runner wall time per batch",
                                 ["model"], buckets=_TIME_BUCKETS, registry=r)
        self.batch_rows = Histogram("fusedserve_batch_rows", "Rows per batch", ["model"],
                                    buckets=_ROW_BUCKETS, registry=r)
        self.duration = Histogram("fusedserve_request_duration_seconds",
                                  "Time from a request reaching a model's queue to its outputs (queue wait and "
                                  "batch), by model; requests answered with an error are not in it",
                                  ["model"], buckets=_TIME_BUCKETS, registry=r)
        # Timing samples a share of batches (kernel stats say which): these count the timed launches.
        self.kernel_seconds = Counter("fusedserve_kernel_seconds", "Device time of the layer launches timed",
                                      ["model", "layer", "kernel"], registry=r)
        self.kernel_launches = Counter("fusedserve_kernel_launches",
                                       "Layer launches timed (a sample of batches, not every launch)",
                                       ["model", "layer", "kernel"], registry=r)
        self.unexpected = Counter("fusedserve_unexpected_errors",
                                  "Requests answered with an internal error by a bug, by front end (http, grpc)",
                                  ["front_end"], registry=r)
        # Labelled children, looked up once: labels() takes a lock and builds a key on every call.
        self._children: dict[str, tuple] = {}
        self._layers: dict[tuple[str, str, str], tuple] = {}
        self._requests: dict[tuple[str, str], object] = {}
        self._durations: dict[str, object] = {}

    def watch_queues(self, queues: Mapping[str, _Queue]) -> None:
        """Export ``queued_rows`` of every queue in ``queues`` (a live mapping, read at each scrape)."""
        self.registry.register(_QueuedRows(queues))

    def watch_models(self, read: Callable[[], Mapping[str, tuple[bool, str | None]]]) -> None:
        """Export each model's readiness and failure stage, as ``read()`` gives them at each scrape."""
        self.registry.register(_ModelReadiness(read))

    def record_layer(self, timing: LayerTiming) -> None:
        labels = (timing.model, timing.layer, timing.kernel)
        children = self._layers.get(labels)
        if children is None:
            children = self._layers[labels] = (self.kernel_seconds.labels(*labels),
                                               self.kernel_launches.labels(*labels))
        children[0].inc(timing.seconds)
        children[1].inc()

    def _batch_children(self, model: str) -> tuple:
        children = self._children.get(model)
        if children is None:
            children = self._children[model] = (self.rows.labels(model), self.batch_rows.labels(model),
                                                 self.compute.labels(model), self.queue_wait.labels(model))
        return children

    def record_batch(self, model: str, rows: int, waits: list[float], compute_s: float) -> None:
        row_count, batch_rows, compute, wait = self._batch_children(model)
        row_count.inc(rows)
        batch_rows.observe(rows)
        compute.observe(compute_s)
        for w in waits:
            wait.observe(w)

    def record_duration(self, model: str, seconds: float, count: int = 1) -> None:
        child = self._durations.get(model)
        if child is None:
            child = self._durations[model] = self.duration.labels(model)
        for _ in range(count):
            child.observe(seconds)

    def record_request(self, model: str, outcome: str, count: int = 1) -> None:
        key = (model, outcome)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.requests.labels(model, outcome)
        counter.inc(count)
        if self._on_request is not None:
            self._on_request(model, outcome, count)
