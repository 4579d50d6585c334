"""CUDA graphs of a runner's buckets: a plain graph per bucket, a twin with its copies in and out, and a
timed twin with events between layers."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from fusedserve.kernels.device import gc_paused

log = logging.getLogger(__name__)

# forward(hook) computes one bucket on the runner's input buffer and returns the device output;
# hook(i), when given, is called before layer i and once after the last layer (see MLP.forward).
# A graph's static output is that output cast to float32 inside the graph: the host copy reads
# float32, and a cast launched after each replay would cost a launch and an allocation per batch.
Forward = Callable[..., torch.Tensor]


class BucketGraphs:
    """The graphs of one runner: ``plain[bucket] = (graph, static output)`` and
    ``timed[bucket] = (graph, static output, events)``, the same launches with an external CUDA
    event recorded before each layer and after the last (a replay hides single kernels; the
    events split them apart for sampled timings); ``served[bucket] = (graph, static output)``, the
    same launches between the staging's copy in and copy out (what ``run`` replays where it can).

    Every graph shares one memory pool: the runner replays one at a time, and each kept graph's
    output stays referenced, so no capture reuses another's output. Capture only after every
    kernel of the bucket is tuned: timing configs inside a capture would break it.
    """

    def __init__(self, name: str, device: torch.device, num_layers: int):
        self.name = name
        self.device = device
        self.num_layers = num_layers
        self.plain: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.timed: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        self.served: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def clear(self) -> None:
        self.plain.clear()
        self.timed.clear()
        self.served.clear()

    def record(self, forward: Forward, hook=None, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``(graph, static output)`` of ``forward(hook)``; raises what the capture raises. ``pool``:
        another memory pool than the shared one, for graphs captured while others replay (``retune``):
        captured by hand on a side stream, without what ``torch.cuda.graph`` does on entry (a device
        synchronization and emptying the caching allocator, which would stall the serving thread)."""
        graph = torch.cuda.CUDAGraph()
        if pool is not None:
            return graph, self._record_beside(graph, forward, hook, pool)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: a stats reader collecting timings on another thread must not break it.
        with torch.no_grad(), gc_paused(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = forward(hook).float()
        return graph, out

    def _record_beside(self, graph, forward: Forward, hook, pool) -> torch.Tensor:
        side, current = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.no_grad(), gc_paused(), torch.cuda.stream(side):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = forward(hook).float()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return out

    def capture(self, bucket: int, path: str, forward: Forward):
        """``(graph, static output)`` of ``forward`` (the ``path`` at ``bucket``), or None when the
        capture fails: then every graph is dropped (the runner launches eagerly from now on)."""
        try:
            return self.record(forward)
        except Exception:  # any failure: eager launches give the same answers, only slower
            log.warning("CUDA graph capture failed for %r at M=%d (%s path); it runs eager launches "
                        "from now on", self.name, bucket, path, exc_info=True)
            self.clear()
            return None

    def served_twin(self, bucket: int, forward: Forward, pool=None):
        """``(graph, static output)`` of ``forward`` (which copies its rows in and out itself), or
        None where that cannot be captured: ``run`` then copies around the plain graph."""
        try:
            return self.record(forward, pool=pool)
        except Exception:
            log.warning("the CUDA graph of %r at M=%d with its copies could not be captured; its batches "
                        "copy around the plain graph", self.name, bucket, exc_info=True)
            torch.cuda.current_stream(self.device).synchronize()
            return None

    def capture_timed(self, bucket: int, forward: Forward) -> bool:
        """Capture ``forward`` at ``bucket`` with events between layers into ``timed``; False (timed
        batches then launch eagerly) where that cannot be captured."""
        twin = self.timed_twin(bucket, forward)
        if twin is not None:
            self.timed[bucket] = twin
        return twin is not None

    def timed_twin(self, bucket: int, forward: Forward, pool=None):
        """``(graph, static output, events)`` of ``forward`` with events between layers, or None
        where that cannot be captured: torch < 2.8 has no external events."""
        try:
            marks = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(self.num_layers + 1)]
        except TypeError:
            log.info("this torch cannot record CUDA events inside a graph; timed batches of %r run "
                     "eagerly", self.name)
            return None
        try:
            graph, out = self.record(forward, lambda i: marks[i].record(), pool)
        except Exception:
            log.warning("the timed CUDA graph of %r at M=%d could not be captured; its timed batches run "
                        "eagerly", self.name, bucket, exc_info=True)
            torch.cuda.current_stream(self.device).synchronize()
            return None
        return graph, out, marks
