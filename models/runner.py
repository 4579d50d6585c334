"""Run a loaded MLP batch by batch: buckets, padding, warm-up, CUDA graphs and per-layer timings."""

from __future__ import annotations

import logging
import time

import torch

from fusedserve.kernels.common import gc_paused
from fusedserve.models.timing import LayerTiming, PendingEvents, TimingSink
from fusedserve.kernels import rules
from fusedserve.kernels.rules import batch_buckets
from fusedserve.models.mlp import MLP

# The two ways to compute a batch. "fused": kernels.fused_mlp, one launch per layer with the input
# normalization fused into the first; "layers": the normalization (kernels.normalize with the
# triton backend, MLP.normalize with torch's), then each layer's own module.
PATHS = ("fused", "layers")
# Warm-up times each candidate path with this many rounds of back-to-back calls (best round wins).
CHOICE_ROUNDS, CHOICE_CALLS = 3, 10

log = logging.getLogger(__name__)


class ModelRunner:
    """Computes batches of one model, one batch at a time, and times every layer launch.

    ``run(x)`` takes ``[M, in_features]`` float32 on the CPU, pads it to the smallest bucket
    (``batch_buckets``) in a preallocated device buffer, computes and returns ``[M, out_features]``
    float32 on the CPU. Rows are independent, so padded rows (whatever an earlier batch left
    there) never change real rows; they are computed and dropped.

    ``warmup()`` warms every bucket: each candidate path runs once (autotuning its kernels at that
    shape; the fused path's layers are tuned together first, ``kernels.fused_mlp.tune_chain``), then
    on CUDA one CUDA graph per path is captured (only after tuning: timing configs inside a capture
    would break it). If a capture fails, the runner logs why and launches eagerly.

    Paths (``PATHS``): with the triton backend a bucket runs either "fused" (``kernels.fused_mlp``:
    one launch per layer, the input normalization fused into the first) or "layers" (normalization,
    then each layer's ``kernels.fused_linear``). ``fused=None`` measures both on CUDA at warm-up
    (CUDA events around back-to-back graph replays, as ``compute`` runs them) and keeps the faster
    per bucket (``path(bucket)``, ``path_seconds``); on the CPU interpreter it takes "fused".
    ``fused=True``/``False`` forces one path. The torch backend always runs "layers".

    Timings (one ``LayerTiming`` per layer launch, to ``timing_sink``, layers named ``layers.<i>``):
    - CPU: ``time.perf_counter`` around each layer (the CPU computes synchronously).
    - CUDA, eager: CUDA events around each layer, kept pending and resolved once the GPU has passed
      them: at the next ``run``, or whenever ``collect_timings()`` is called (a non-blocking sweep
      a stats reader can trigger). Nothing synchronizes just for timing.
    - CUDA graphs: a replay hides individual kernels, so timings are sampled. Each bucket has a
      second graph, captured with the first: the same launches with a CUDA event recorded between
      layers (external event nodes). The first batch of each bucket replays that timed graph, then
      every ``timing_sample_every``-th batch of that bucket that is at least
      ``timing_min_interval_s`` seconds after the last timed one. The event nodes split the layers
      apart (no layer overlaps the next there), so a timed batch costs about one replay more than
      an untimed one, not eager launches. Where the timed graph cannot be captured (a torch
      without external events) timed batches run layer by layer eagerly with events, which costs
      ~0.5-1 ms of Python per batch on the H200 host: the interval bounds how often.
      ``bench/model.py`` measures the cost with the sink on and off.
    On the "layers" path the input normalization is not part of any layer's time; on the "fused"
    path it is part of layer 0's. ``flush_timings()`` waits for every pending timing.
    """

    def __init__(self, model: MLP, *, max_batch_size: int, timing_sink: TimingSink | None = None,
                 cuda_graphs: bool | None = None, timing_sample_every: int = 16,
                 timing_min_interval_s: float = 0.02, fused: bool | None = None):
        if not isinstance(model, MLP):
            raise TypeError(f"model must be a models.MLP, got {type(model).__name__}")
        for name, value in (("max_batch_size", max_batch_size), ("timing_sample_every", timing_sample_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(timing_min_interval_s, bool) or not isinstance(timing_min_interval_s, (int, float)) \
                or not timing_min_interval_s >= 0:
            raise ValueError(f"timing_min_interval_s must be a number >= 0, got {timing_min_interval_s!r}")
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
        self.timing_min_interval_s = float(timing_min_interval_s)
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a model on CUDA; {self.name!r} is on {self.device}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.buckets = batch_buckets(max_batch_size)
        self.fused = self._use_fused(fused)  # whether the fused path is a candidate
        if not self.fused:
            self._candidates = ("layers",)
        elif fused is None and on_cuda:
            self._candidates = PATHS
        else:
            self._candidates = ("fused",)
        self._packed = None
        if self.fused:
            from fusedserve.kernels.fused_mlp import pack_mlp

            layers = model.layers
            self._packed = pack_mlp([l.weight.detach() for l in layers], [l.bias.detach() for l in layers],
                                    model.config.activation)
        self._input = torch.zeros(max_batch_size, self.in_features, device=self.device)
        # Page-locked staging on CUDA: copies from/to pageable memory cost a driver bounce each.
        self._host_in = self._host_out = None
        if on_cuda:
            self._host_in = torch.empty(max_batch_size, self.in_features, pin_memory=True)
            self._host_out = torch.empty(max_batch_size, self.out_features, pin_memory=True)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # bucket -> (graph, output, events): the chosen path with an event before each layer and
        # one after the last, for sampled timings (see the class docstring).
        self._timed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list]] = {}
        self._pool = None
        self._paths: dict[int, str] = {}
        self.path_seconds: dict[int, dict[str, float]] = {}  # bucket -> {path: seconds per call}
        self._pending = PendingEvents()
        self._untimed_left: dict[int, int] = {}  # bucket -> batches to run before the clock is read
        self._last_timed: dict[int, float] = {}  # bucket -> monotonic time of its last timed batch
        self._fields: dict[tuple[str, int, int], dict] = {}  # (path, layer, bucket) -> LayerTiming fields

    # -- public API --------------------------------------------------------------------------

    def warmup(self) -> dict[int, float]:
        """Warm every bucket (autotuning, path choice, CUDA-graph capture); seconds per bucket."""
        seconds = {}
        for i, bucket in enumerate(self.buckets, 1):
            start = time.perf_counter()
            self._warm_bucket(bucket)
            seconds[bucket] = time.perf_counter() - start
            log.info("warm-up %r: bucket %d/%d (M=%d) took %.3f s, path %s%s", self.name, i,
                     len(self.buckets), bucket, seconds[bucket], self._paths[bucket],
                     " (CUDA graph captured)" if bucket in self._graphs else "")
        return seconds

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, in_features]`` float32 CPU -> ``[M, out_features]`` float32 CPU."""
        rows = self._check_input(x)
        bucket = rules.bucket(rows, self.max_batch_size)
        if self._pending:  # eager timed batches' events (a lock and a query each; most runs have none)
            self._emit(self._pending.ready())
        if bucket not in self._paths:
            self._warm_bucket(bucket)
        if self._host_in is None:
            self._input[:rows].copy_(x)
        else:  # the previous run synchronized, so no copy still reads the staging buffer
            self._host_in[:rows].copy_(x)
            self._input[:rows].copy_(self._host_in[:rows], non_blocking=True)
        timed = self.timing_sink is not None and self._timing_due(bucket)
        marks = None
        if timed and bucket in self._timed_graphs:
            graph, out, marks = self._timed_graphs[bucket]
            graph.replay()
        elif not timed and bucket in self._graphs:
            graph, out = self._graphs[bucket]
            graph.replay()
        else:  # eager launches, each layer timed with events when ``timed``
            with torch.no_grad():
                out = self._forward(bucket, rows if timed else None, self._paths[bucket])
        if self._host_out is None:
            return out[:rows].float().cpu()
        self._host_out[:rows].copy_(out[:rows].float(), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        if marks is not None:  # the replay is done: its events read without waiting
            path = self._paths[bucket]
            self._emit([self._timing(path, i, rows, bucket, marks[i].elapsed_time(marks[i + 1]) / 1e3)
                        for i in range(len(marks) - 1)])  # elapsed_time is in ms
        return self._host_out[:rows].clone()  # the staging buffer is the next batch's

    def path(self, bucket: int) -> str | None:
        """The path ("fused" or "layers") that ``bucket`` runs; None until the bucket is warmed."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket must be one of {self.buckets}, got {bucket!r}")
        return self._paths.get(bucket)

    @property
    def timing_method(self) -> str:
        """How timed batches run: "perf_counter" (CPU), "events" (eager launches with CUDA events),
        or "timed_graph" (a replay of the bucket's graph with events between layers; buckets whose
        timed graph could not be captured fall back to "events")."""
        if self.device.type != "cuda":
            return "perf_counter"
        return "timed_graph" if self._timed_graphs else "events"

    @property
    def input_buffer(self) -> torch.Tensor:
        """The preallocated ``[max_batch_size, in_features]`` float32 device input ``run`` pads into."""
        return self._input

    def compute(self, bucket: int) -> torch.Tensor:
        """The model on the first ``bucket`` rows of ``input_buffer``, as ``run`` computes it (graph
        replay when captured), without copies or timings: what a benchmark measures. Returns the
        device output ``[bucket, out_features]``; with graphs it is the graph's static buffer, which
        the next call overwrites."""
        captured = self._graphs.get(bucket)
        if captured is not None:  # the hot path: one replay, nothing else
            captured[0].replay()
            return captured[1]
        if bucket not in self.buckets:
            raise ValueError(f"bucket must be one of {self.buckets}, got {bucket!r}")
        if bucket not in self._paths:
            self._warm_bucket(bucket)
            if bucket in self._graphs:
                return self.compute(bucket)
        with torch.no_grad():
            return self._forward(bucket, None, self._paths[bucket])

    def pending_timings(self) -> int:
        """Layer timings whose CUDA events the GPU has not reached (or nobody has read) yet."""
        return len(self._pending)

    def collect_timings(self) -> int:
        """Hand every timing whose events the GPU has passed to the sink, without waiting for the
        rest; returns how many. Safe to call from another thread than ``run``'s (a stats reader)."""
        done = self._pending.ready()
        self._emit(done)
        return len(done)

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

    def _timing_due(self, bucket: int) -> bool:
        """Whether this batch of ``bucket`` runs with per-layer events (see the class docstring).
        Most batches cost one dict lookup here: the clock is read every ``timing_sample_every``
        batches only (a graph replay takes microseconds, so this runs on the serving path's budget)."""
        if bucket not in self._graphs:
            return True  # eager launches anyway: events cost next to nothing
        left = self._untimed_left.get(bucket, 0)
        if left:
            self._untimed_left[bucket] = left - 1
            return False
        self._untimed_left[bucket] = self.timing_sample_every - 1
        now = time.monotonic()
        last = self._last_timed.get(bucket)
        if last is not None and now - last < self.timing_min_interval_s:
            return False  # due by count, not by time: the clock is read again that many batches on
        self._last_timed[bucket] = now
        return True

    def _forward(self, bucket: int, rows: int | None, path: str, marks: list | None = None) -> torch.Tensor:
        """The model on the first ``bucket`` input rows by ``path``; each launch timed when ``rows``
        is set; ``marks`` (events, one more than layers): recorded before each layer and after the last."""
        x = self._input[:bucket]  # [bucket, in], raw float32
        if path == "fused":
            from fusedserve.kernels.fused_mlp import fused_mlp_layer

            model, packed, h = self.model, self._packed, x
            for i in range(packed.num_layers):  # [bucket, in] -> [bucket, hidden[i]] ... -> [bucket, out]
                if marks is not None:
                    marks[i].record()
                h = self._launch(path, i, bucket, rows, lambda i=i, h=h: fused_mlp_layer(
                    h, packed, i, model.input_shift, model.input_scale))
        else:
            h = self._normalize(x)  # [bucket, in], model dtype
            for i, layer in enumerate(self.model.layers):
                if marks is not None:
                    marks[i].record()
                h = self._launch(path, i, bucket, rows, lambda layer=layer, h=h: self._layer(layer, h))
        if marks is not None:
            marks[-1].record()
        return h  # [bucket, out]

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend != "triton":
            return self.model.normalize(x)
        from fusedserve.kernels.normalize import normalize

        # One launch instead of torch's two or three elementwise ones, and the same bits.
        return normalize(x, self.model.input_shift, self.model.input_scale, self.dtype)

    def _layer(self, layer, h: torch.Tensor) -> torch.Tensor:
        if self.backend != "triton":
            return layer(h)
        from fusedserve import kernels

        # The runner serves weights that nothing writes while it runs (loaded, then synchronized in
        # warm-up), so each layer may start streaming its weights before the previous layer ends.
        return kernels.fused_linear(h, layer.weight, layer.bias, layer.activation, static_weight=True)

    def _launch(self, path: str, layer_index: int, bucket: int, rows: int | None, compute):
        """``compute()``, timed as layer ``layer_index`` of ``path`` when ``rows`` is set."""
        if rows is None:
            return compute()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = compute()
            end.record()
            self._pending.add(self._timing(path, layer_index, rows, bucket, 0.0), start, end)
            return out
        start = time.perf_counter()
        out = compute()
        self._emit([self._timing(path, layer_index, rows, bucket, time.perf_counter() - start)])
        return out

    def _use_fused(self, fused: bool | None) -> bool:
        if fused is False or (fused is None and self.backend != "triton"):
            return False
        from fusedserve.kernels.fused_mlp import fused_mlp_supported

        fits = self.backend == "triton" and fused_mlp_supported(self.model.config.widths, self.dtype,
                                                                self.device)
        if fused and not fits:
            raise ValueError(f"fused=True but model {self.name!r} ({self.dtype}, backend "
                             f"{self.backend}, {self.device}) cannot run kernels.fused_mlp: it needs "
                             "the triton backend")
        return fits

    def _warm_bucket(self, bucket: int) -> None:
        on_cuda = self.device.type == "cuda"
        with torch.no_grad():
            for path in tuple(self._candidates):
                try:
                    if path == "fused":  # its layers' configs, timed in the whole chain
                        from fusedserve.kernels.fused_mlp import tune_chain

                        tune_chain(self._input[:bucket], self._packed, self.model.input_shift,
                                   self.model.input_scale)
                    self._forward(bucket, None, path)  # the first launch at this shape autotunes/compiles
                except Exception:
                    if len(self._candidates) == 1:
                        raise
                    # An automatic choice: the other path computes the same model.
                    log.warning("the %s path of %r failed at M=%d; the runner leaves it out from now on",
                                path, self.name, bucket, exc_info=True)
                    self._candidates = tuple(p for p in self._candidates if p != path)
            if on_cuda:
                torch.cuda.synchronize(self.device)
        graphs = {}
        for path in self._candidates if self.cuda_graphs else ():
            captured = self._capture(bucket, path)
            if captured is None:
                graphs = {}
                break
            graphs[path] = captured
        chosen = self._candidates[0]
        if len(self._candidates) > 1:
            seconds = {path: self._time_path(bucket, path, graphs.get(path)) for path in self._candidates}
            self.path_seconds[bucket] = seconds
            chosen = min(seconds, key=seconds.get)
            log.info("%r at M=%d runs the %s path (%s)", self.name, bucket, chosen,
                     ", ".join(f"{p} {s * 1e6:.1f} us" for p, s in seconds.items()))
        self._paths[bucket] = chosen
        if chosen in graphs:
            self._graphs[bucket] = graphs[chosen]
            timed = self._capture_timed(bucket, chosen)
            if timed is not None:
                self._timed_graphs[bucket] = timed

    def _time_path(self, bucket: int, path: str, captured) -> float:
        """Seconds per call of ``path`` at ``bucket`` (graph replays when captured), best of a few rounds."""
        if captured is not None:
            step = captured[0].replay
        else:
            def step():
                self._forward(bucket, None, path)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        with torch.no_grad():
            step()
            for _ in range(CHOICE_ROUNDS):
                start.record()
                for _ in range(CHOICE_CALLS):
                    step()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3 / CHOICE_CALLS)  # elapsed_time is in ms
        return best

    def _record(self, bucket: int, path: str, marks: list | None = None):
        """``(graph, static output)`` of ``path`` at ``bucket`` (``marks``: events recorded between
        layers, as ``_forward`` takes them); raises what the capture raises."""
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            # One memory pool for every graph of this runner: they never replay at the same time, and
            # each kept graph's output stays referenced, so no capture reuses another's output.
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: a stats reader collecting timings on another thread must not break it.
        with torch.no_grad(), gc_paused(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(bucket, None, path, marks)
        return graph, out

    def _capture(self, bucket: int, path: str):
        """``(graph, static output)`` of ``path`` at ``bucket``, or None (and eager from now on) if capture fails."""
        try:
            return self._record(bucket, path)
        except Exception:  # any failure: eager launches give the same answers, only slower
            log.warning("CUDA graph capture failed for %r at M=%d (%s path); it runs eager launches "
                        "from now on", self.name, bucket, path, exc_info=True)
            self.cuda_graphs = False
            self._graphs.clear()
            self._timed_graphs.clear()
            # A broken device (not just a refused capture) must surface here, not in a later batch.
            torch.cuda.synchronize(self.device)
            return None

    def _capture_timed(self, bucket: int, path: str):
        """``(graph, output, events)``: ``path`` at ``bucket`` with an external CUDA event before each
        layer and after the last; None (timed batches then launch eagerly) where that cannot be
        captured: torch < 2.8 has no external events."""
        try:
            marks = [torch.cuda.Event(enable_timing=True, external=True)
                     for _ in range(len(self.model.layers) + 1)]
        except TypeError:
            log.info("this torch cannot record CUDA events inside a graph; timed batches of %r run "
                     "eagerly", self.name)
            return None
        try:
            graph, out = self._record(bucket, path, marks)
        except Exception:
            log.warning("the timed CUDA graph of %r at M=%d could not be captured; its timed batches run "
                        "eagerly", self.name, bucket, exc_info=True)
            torch.cuda.synchronize(self.device)
            return None
        return graph, out, marks

    def _timing(self, path: str, layer_index: int, rows: int, bucket: int, seconds: float) -> LayerTiming:
        return LayerTiming(rows=rows, seconds=seconds, **self._timing_fields(path, layer_index, bucket))

    def layer_fields(self, path: str, layer_index: int, bucket: int) -> dict:
        """What a timing of layer ``layer_index`` on ``path`` at ``bucket`` records besides its time:
        model, layer, M, N, K, dtype, backend, and the kernel and config that run it."""
        return dict(self._timing_fields(path, layer_index, bucket))

    def _timing_fields(self, path: str, layer_index: int, bucket: int) -> dict:
        """What every timing of this layer at this bucket shares: its shape, dtype and the kernel and
        config that run it. Built once (timings are recorded per batch on the CPU); before its
        bucket is tuned a Triton layer's config reads "", and is asked for again next time."""
        key = (path, layer_index, bucket)
        fields = self._fields.get(key)
        if fields is not None:
            return fields
        layer = self.model.layers[layer_index]
        if path == "fused":
            from fusedserve.kernels import fused_mlp

            config = fused_mlp.layer_config(bucket, self._packed, layer_index, self.device)
            kernel, config = fused_mlp.NAME, fused_mlp.config_str(config)
        elif self.backend == "torch":
            kernel, config = ("torch.linear" if layer.activation == "none" else f"torch.linear+{layer.activation}", "")
        else:
            from fusedserve import kernels

            kernel, config = kernels.kernel_choice(bucket, layer.out_features, layer.in_features, self.dtype,
                                                   self.device, static_weight=True)
        fields = dict(model=self.name, layer=f"layers.{layer_index}", M=bucket, N=layer.out_features,
                      K=layer.in_features, dtype=str(self.dtype).removeprefix("torch."), backend=self.backend,
                      kernel=kernel, config=config)
        if config or self.backend == "torch":
            self._fields[key] = fields
        return fields

    def _emit(self, timings: list[LayerTiming]) -> None:
        if self.timing_sink is not None:
            for timing in timings:
                self.timing_sink.record_layer(timing)
