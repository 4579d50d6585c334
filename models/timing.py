"""Timing records that flow from the model runner to the service's stats.

The runner measures each fused layer (CUDA events on the GPU, ``time.perf_counter`` on the CPU)
and hands one ``LayerTiming`` per layer launch to a sink, which the service aggregates for
``/kernel-stats`` and ``/metrics``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol


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
