"""Run a loaded MLP batch by batch: buckets, padding, warm-up, CUDA graphs and per-layer timings."""

from __future__ import annotations

import logging
import time

import torch

from kernels.timing import LayerTiming, PendingEvents, TimingSink
from models.mlp import MLP

FUSED_LAYER = "fused_mlp"  # the launch-site name of the one-launch whole-model kernel

log = logging.getLogger(__name__)


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself: ``10 -> [1, 2, 4, 8, 10]``."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch_size]


class ModelRunner:
    """Computes batches of one model, one batch at a time, and times every layer launch.

    ``run(x)`` takes ``[M, in_features]`` float32 on the CPU, pads it to the smallest bucket
    (``batch_buckets``) in a preallocated device buffer, computes and returns ``[M, out_features]``
    float32 on the CPU. Rows are independent, so padded rows (whatever an earlier batch left
    there) never change real rows; they are computed and dropped.

    ``warmup()`` runs every bucket once, which autotunes the kernels for each shape, and on CUDA
    then captures one CUDA graph per bucket (capturing only after tuning: timing configs inside a
    capture would break it). If a capture fails, the runner logs why and launches eagerly.

    ``fused``: with the triton backend, a small model (``kernels.fused_mlp.fused_mlp_supported``:
    narrow layers, little weight in all) runs as one launch of the whole-model kernel (normalization
    included) instead of one launch per layer. ``None`` = whenever it fits; its timings then come as one
    ``LayerTiming`` per batch with layer ``"fused_mlp"``, ``N = out_features``, ``K = in_features``.

    Timings (one ``LayerTiming`` per layer launch, to ``timing_sink``):
    - CPU: ``time.perf_counter`` around each layer (the CPU computes synchronously).
    - CUDA, eager: CUDA events around each layer, kept pending and resolved at a later ``run`` once
      the GPU has passed them (``event.query()``); nothing synchronizes just for timing.
    - CUDA graphs: a replay hides individual kernels, so timings are sampled: every
      ``timing_sample_every``-th batch runs layer by layer with events instead of the graph. The
      stats then describe 1 batch in ``timing_sample_every``, eager-launched (the same kernels and
      configs, without the graph's saved launch overhead, which events do not measure anyway).
    On the per-layer path the input normalization (a few elementwise ops) is not part of any
    layer's time. ``pending_timings()`` counts timings still waiting on their events; ``flush_timings()`` waits
    for them and hands them to the sink.
    """

    def __init__(self, model: MLP, *, max_batch_size: int, timing_sink: TimingSink | None = None,
                 cuda_graphs: bool | None = None, timing_sample_every: int = 16,
                 fused: bool | None = None):
        if not isinstance(model, MLP):
            raise TypeError(f"model must be a models.MLP, got {type(model).__name__}")
        for name, value in (("max_batch_size", max_batch_size), ("timing_sample_every", timing_sample_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model = model.eval()
        self.name = model.name
        self.in_features = model.config.in_features
        self.out_features = model.config.out_features
        self.max_batch_size = max_batch_size
        self.device = model.device
        self.backend = model.backend
        self.dtype = model.config.torch_dtype
        self.timing_sink = timing_sink
        self.timing_sample_every = timing_sample_every
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a model on CUDA; {self.name!r} is on {self.device}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.buckets = batch_buckets(max_batch_size)
        self.fused = self._use_fused(fused)
        self._packed = None
        if self.fused:
            from kernels.fused_mlp import pack_mlp

            layers = model.layers
            self._packed = pack_mlp([l.weight.detach() for l in layers], [l.bias.detach() for l in layers],
                                    model.config.activation)
        self._input = torch.zeros(max_batch_size, self.in_features, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._warm: set[int] = set()
        self._pending = PendingEvents()
        self._batches = 0
        self._kernels: dict[tuple[int, int], tuple[str, str]] = {}

    # -- public API --------------------------------------------------------------------------

    def warmup(self) -> dict[int, float]:
        """Run every bucket once (autotuning) and capture its CUDA graph; seconds per bucket."""
        seconds = {}
        for i, bucket in enumerate(self.buckets, 1):
            start = time.perf_counter()
            self._warm_bucket(bucket)
            seconds[bucket] = time.perf_counter() - start
            log.info("warm-up %r: bucket %d/%d (M=%d) took %.3f s%s", self.name, i, len(self.buckets),
                     bucket, seconds[bucket], " (CUDA graph captured)" if bucket in self._graphs else "")
        return seconds

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, in_features]`` float32 CPU -> ``[M, out_features]`` float32 CPU."""
        rows = self._check_input(x)
        bucket = next(b for b in self.buckets if b >= rows)
        self._emit(self._pending.ready())
        if bucket not in self._warm:
            self._warm_bucket(bucket)
        self._input[:rows].copy_(x)
        self._batches += 1
        sampled = self.timing_sink is not None and self._batches % self.timing_sample_every == 0
        with torch.no_grad():
            if bucket in self._graphs and not sampled:
                graph, out = self._graphs[bucket]
                graph.replay()
            else:
                out = self._forward(bucket, rows if self.timing_sink is not None else None)
        return out[:rows].float().cpu()

    @property
    def input_buffer(self) -> torch.Tensor:
        """The preallocated ``[max_batch_size, in_features]`` float32 device input ``run`` pads into."""
        return self._input

    def compute(self, bucket: int) -> torch.Tensor:
        """The model on the first ``bucket`` rows of ``input_buffer``, as ``run`` computes it (graph
        replay when captured), without copies or timings: what a benchmark measures. Returns the
        device output ``[bucket, out_features]``; with graphs it is the graph's static buffer, which
        the next call overwrites."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket must be one of {self.buckets}, got {bucket!r}")
        if bucket not in self._warm:
            self._warm_bucket(bucket)
        with torch.no_grad():
            if bucket in self._graphs:
                graph, out = self._graphs[bucket]
                graph.replay()
                return out
            return self._forward(bucket, None)

    def pending_timings(self) -> int:
        """Layer timings whose CUDA events the GPU has not reached (or nobody has read) yet."""
        return len(self._pending)

    def flush_timings(self) -> int:
        """Wait for every pending timing and hand it to the sink; returns how many."""
        done = self._pending.drain()
        self._emit(done)
        return len(done)

    # -- internals ---------------------------------------------------------------------------

    def _check_input(self, x) -> int:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"x must be float32, got {x.dtype}")
        if x.device.type != "cpu":
            raise ValueError(f"x must be a CPU tensor, got one on {x.device}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must have shape [M, {self.in_features}] for model {self.name!r}, "
                             f"got {list(x.shape)}")
        rows = x.shape[0]
        if not 1 <= rows <= self.max_batch_size:
            raise ValueError(f"x must have 1 to {self.max_batch_size} rows (max_batch_size), got {rows}")
        return rows

    def _forward(self, bucket: int, rows: int | None) -> torch.Tensor:
        """The model on the first ``bucket`` input rows; each launch timed when ``rows`` is set."""
        x = self._input[:bucket]  # [bucket, in], raw float32
        if self.fused:
            from kernels.fused_mlp import fused_mlp

            model = self.model
            return self._launch(None, bucket, rows, lambda: fused_mlp(
                x, self._packed, model.input_shift, model.input_scale))  # [bucket, out]
        h = self.model.normalize(x)  # [bucket, in], model dtype
        for i, layer in enumerate(self.model.layers):
            h = self._launch(i, bucket, rows, lambda layer=layer, h=h: layer(h))
        return h  # [bucket, out]

    def _launch(self, layer_index: int | None, bucket: int, rows: int | None, compute):
        """``compute()``, timed as layer ``layer_index`` (None: the fused kernel) when ``rows`` is set."""
        if rows is None:
            return compute()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = compute()
            end.record()
            self._pending.add(self._timing(layer_index, rows, bucket, 0.0), start, end)
            return out
        start = time.perf_counter()
        out = compute()
        self._emit([self._timing(layer_index, rows, bucket, time.perf_counter() - start)])
        return out

    def _use_fused(self, fused: bool | None) -> bool:
        if fused is False or (fused is None and self.backend != "triton"):
            return False
        from kernels.fused_mlp import fused_mlp_supported

        fits = self.backend == "triton" and fused_mlp_supported(self.model.config.widths, self.dtype,
                                                                self.device)
        if fused and not fits:
            raise ValueError(f"fused=True but model {self.name!r} (widths {self.model.config.widths}, "
                             f"{self.dtype}, backend {self.backend}, {self.device}) does not fit the "
                             "fused MLP kernel: it needs the triton backend and narrow layers")
        return fits

    def _warm_bucket(self, bucket: int) -> None:
        with torch.no_grad():
            self._forward(bucket, None)  # first launch of each kernel at this shape autotunes it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._warm.add(bucket)
        if self.cuda_graphs:
            self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            # One memory pool for every bucket's graph: they never replay at the same time, and each
            # graph's output stays referenced, so no capture reuses another's output.
            self._pool = torch.cuda.graph_pool_handle()
        try:
            # thread_local: a stats reader flushing timings on another thread must not break it.
            with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._forward(bucket, None)
        except Exception:  # any failure: eager launches give the same answers, only slower
            log.warning("CUDA graph capture failed for %r at M=%d; it runs eager launches from now on",
                        self.name, bucket, exc_info=True)
            self.cuda_graphs = False
            self._graphs.clear()
            # A broken device (not just a refused capture) must surface here, not in a later batch.
            torch.cuda.synchronize(self.device)
            return
        self._graphs[bucket] = (graph, out)

    def _timing(self, layer_index: int | None, rows: int, bucket: int, seconds: float) -> LayerTiming:
        kernel, config = self._kernel(layer_index, bucket)
        if layer_index is None:
            name, N, K = FUSED_LAYER, self.out_features, self.in_features
        else:
            layer = self.model.layers[layer_index]
            name, N, K = f"layers.{layer_index}", layer.out_features, layer.in_features
        return LayerTiming(model=self.name, layer=name, rows=rows, M=bucket, N=N, K=K,
                           dtype=str(self.dtype).removeprefix("torch."), backend=self.backend,
                           kernel=kernel, config=config, seconds=seconds)

    def _kernel(self, layer_index: int | None, bucket: int) -> tuple[str, str]:
        key = (layer_index, bucket)
        if key in self._kernels:
            return self._kernels[key]
        if layer_index is None:
            from kernels import fused_mlp

            choice = (fused_mlp.NAME, fused_mlp.config_str(fused_mlp.fused_mlp_config(bucket)))
        elif self.backend == "torch":
            activation = self.model.layers[layer_index].activation
            choice = ("torch.linear" if activation == "none" else f"torch.linear+{activation}", "")
        else:
            import kernels

            layer = self.model.layers[layer_index]
            choice = kernels.kernel_choice(bucket, layer.out_features, layer.in_features, self.dtype,
                                           self.device)
        if choice[1] or self.backend == "torch":  # "" = not tuned yet: ask again next time
            self._kernels[key] = choice
        return choice

    def _emit(self, timings: list[LayerTiming]) -> None:
        if self.timing_sink is not None:
            for timing in timings:
                self.timing_sink.record_layer(timing)
