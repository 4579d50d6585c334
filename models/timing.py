"""Per-layer timings of a runner, and the records that flow from it to the service's stats.

The runner measures each fused layer (CUDA events on the GPU, ``time.perf_counter`` on the CPU)
and hands one ``LayerTiming`` per layer launch to a sink, which the service aggregates for
``/kernel-stats`` and ``/metrics``. Here too: which batches are timed (``TimingSampler``), the
clocks of eager batches (``EagerClock``) and the records' fields (``LayerRecords``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch


@dataclass(frozen=True, slots=True)
class LayerTiming:
    """One measured launch of one layer: ``Y[M, N] = act(X[M, K] @ W[N, K]^T + b)``."""

    model: str  # model name, e.g. "digits"
    layer: str  # launch site inside the model, e.g. "layers.0"
    rows: int  # real rows in the batch
    M: int  # rows computed: the batch padded to its bucket
    N: int
    K: int
    dtype: str  # "float32", "float16", "bfloat16"
    backend: str  # "triton" or "torch"
    kernel: str  # which implementation ran, e.g. "triton_tiled"
    config: str  # the kernel's launch config (autotuned block sizes...), "" when none
    seconds: float  # device time of the launch


class TimingSink(Protocol):
    def record_layer(self, timing: LayerTiming) -> None: ...


class PendingEvents:
    """Layer launches bracketed by CUDA events, turned into ``LayerTiming``s once the GPU is past them.

    Reading an event before the GPU reaches it would need a synchronize; instead the launcher adds
    ``(timing, start, end)`` and later collects what ``ready()`` finds finished (``end.query()``),
    oldest first. ``drain()`` waits for everything (tests, a stats read that wants the latest).
    The runner thread adds while a stats reader may drain: a lock keeps each entry resolved once.
    """

    def __init__(self):
        self._items: deque = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, timing: LayerTiming, start, end) -> None:
        """``timing`` has every field but ``seconds``, which the events will give."""
        with self._lock:
            self._items.append((timing, start, end))

    def ready(self) -> list[LayerTiming]:
        done = []
        with self._lock:
            # Events on one stream complete in order: stop at the first one still pending.
            while self._items and self._items[0][2].query():
                done.append(self._resolve(*self._items.popleft()))
        return done

    def drain(self) -> list[LayerTiming]:
        with self._lock:
            items, self._items = self._items, deque()
        for _, _, end in items:
            end.synchronize()
        return [self._resolve(*item) for item in items]

    @staticmethod
    def _resolve(timing: LayerTiming, start, end) -> LayerTiming:
        return replace(timing, seconds=start.elapsed_time(end) / 1e3)  # elapsed_time is in ms


class TimingSampler:
    """Which batches of a bucket are timed. Every eager CUDA batch (events cost next to nothing
    there); otherwise (a bucket with a CUDA graph, or the CPU, where a timed batch's records cost
    more than a small model's compute) its first batch, then every ``every``-th that comes at
    least ``min_interval_s`` seconds after the last timed one."""

    def __init__(self, every: int, min_interval_s: float):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"timing_sample_every must be a positive integer, got {every!r}")
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) \
                or not min_interval_s >= 0:
            raise ValueError(f"timing_min_interval_s must be a number >= 0, got {min_interval_s!r}")
        self.every = every
        self.min_interval_s = float(min_interval_s)
        self._untimed_left: dict[int, int] = {}  # bucket -> batches to run before the clock is read
        self._last_timed: dict[int, float] = {}  # bucket -> monotonic time of its last timed batch

    def due(self, bucket: int, each_batch: bool) -> bool:
        """Whether this batch of ``bucket`` is timed (``each_batch``: yes). Most sampled batches cost
        one dict lookup: the clock is read every ``every`` batches only (a replay takes
        microseconds; this is on its budget)."""
        if each_batch:
            return True
        left = self._untimed_left.get(bucket, 0)
        if left:
            self._untimed_left[bucket] = left - 1
            return False
        self._untimed_left[bucket] = self.every - 1
        now = time.monotonic()
        last = self._last_timed.get(bucket)
        if last is not None and now - last < self.min_interval_s:
            return False  # due by count, not by time: the clock is read again that many batches on
        self._last_timed[bucket] = now
        return True


class LayerRecords:
    """The ``LayerTiming`` fields that every timing of a (path, layer, bucket) shares: model, layer,
    shape, dtype, backend and the kernel and config that ``kernel_of(path, layer, bucket)`` says run
    it. Built once per key (timings are recorded per batch on the CPU); a config that reads "" (a
    Triton layer before its bucket is tuned) is asked for again next time."""

    def __init__(self, model, kernel_of: Callable[[str, int, int], tuple[str, str]]):
        self.model = model
        self.kernel_of = kernel_of
        self._fields: dict[tuple[str, int, int], dict] = {}

    def fields(self, path: str, index: int, bucket: int) -> dict:
        key = (path, index, bucket)
        fields = self._fields.get(key)
        if fields is not None:
            return fields
        model, layer = self.model, self.model.layers[index]
        kernel, config = self.kernel_of(path, index, bucket)
        fields = dict(model=model.name, layer=f"layers.{index}", M=bucket, N=layer.out_features,
                      K=layer.in_features, dtype=model.config.dtype, backend=model.backend,
                      kernel=kernel, config=config)
        if config or model.backend == "torch":
            self._fields[key] = fields
        return fields

    def forget(self, bucket: int) -> None:
        """Drop what was recorded for ``bucket`` (its choices changed: ``ModelRunner.retune``)."""
        for key in [k for k in self._fields if k[2] == bucket]:
            del self._fields[key]

    def timing(self, path: str, index: int, rows: int, bucket: int, seconds: float) -> LayerTiming:
        return LayerTiming(rows=rows, seconds=seconds, **self.fields(path, index, bucket))


class EagerClock:
    """Hooks that time each layer of one eager forward: CUDA events kept in ``pending`` (read once
    the GPU has passed them), or on the CPU ``time.perf_counter``, emitted as each layer ends.
    What a hook does between layers (records, emitting) is outside every layer's time."""

    def __init__(self, records: LayerRecords, pending: PendingEvents, emit, device: torch.device):
        self.records = records
        self.pending = pending
        self.emit = emit
        self.device = device
        self.layers = len(records.model.layers)

    def hook(self, path: str, rows: int, bucket: int):
        """The ``hook`` (see ``MLP.forward``) for one batch of ``rows`` real rows at ``bucket``."""
        start = end = None
        if self.device.type == "cuda":
            def cuda_hook(i: int) -> None:
                nonlocal start, end
                if i:
                    end.record()
                    self.pending.add(self.records.timing(path, i - 1, rows, bucket, 0.0), start, end)
                if i < self.layers:  # both events made before the layer: nothing but it between them
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()

            return cuda_hook

        def cpu_hook(i: int) -> None:
            nonlocal start
            if i:
                self.emit([self.records.timing(path, i - 1, rows, bucket, time.perf_counter() - start)])
            start = time.perf_counter()

        return cpu_hook
