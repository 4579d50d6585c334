"""Run a loaded MLP batch by batch: buckets, padding, CUDA graphs and per-layer timings.

``ModelRunner`` orchestrates one piece per job: ``staging`` (rows in, padded, outputs out), ``paths``
(fused, layers, vendor; the timed choice), ``graphs`` (per bucket), ``timing`` (timed batches and
their records), ``warming`` (warm-up, tuning and swaps, the runner's other half).
"""

from __future__ import annotations

import threading

import torch

from fusedserve.kernels import rules
from fusedserve.models.graphs import BucketGraphs
from fusedserve.models.mlp import MLP
from fusedserve.models.paths import candidate_paths
from fusedserve.models.staging import Staging
from fusedserve.models.threads import CpuThreads
from fusedserve.models.timing import EagerClock, LayerRecords, LayerTiming, PendingEvents, TimingSampler, TimingSink
from fusedserve.models.warming import Warming


class ModelRunner(Warming):
    """Computes batches of one model, one batch at a time, and times every layer launch.

    ``run(x)``: ``[M, in_features]`` float32 CPU -> ``[M, out_features]`` float32 CPU. On CUDA ``x``
    is padded to its bucket (``kernels.rules.bucket``) in a preallocated device buffer (padded rows
    are computed and dropped): one replay of the bucket's graph that copies the rows in and out itself
    (``graph_copies``, the default; a third graph per bucket), where the padding is a few KB
    (``Staging.pads_cheaply``), else copies around the plain graph (timed batches too); on the CPU rows
    run unpadded, on the bucket's path and threads. The copies inside save the host two launches a
    batch (``bench/host_path.py``'s ``staged``).

    Warm-up, tuning and swaps (``warmup``, ``warm``, ``tune``, ``retune``, ``choice_states``,
    ``startup_seconds``) come from ``models.warming.Warming``.

    Paths (``models.paths``): "fused", "layers" and "vendor" with the triton backend on CUDA, timed
    per bucket as ``compute`` runs them (``path(bucket)``, ``path_seconds``); "fused" under the CPU
    interpreter; "layers" with the torch backend. ``fused=True``/``False`` forces "fused"/"layers".

    Timings (one ``LayerTiming`` per layer launch, to ``timing_sink``, layers named ``layers.<i>``):
    - CPU: ``time.perf_counter`` around each layer (the CPU computes synchronously).
    - CUDA, eager: CUDA events around each layer, kept pending and resolved once the GPU has passed
      them: at the next ``run``, or whenever ``collect_timings()`` is called (a non-blocking sweep
      a stats reader can trigger). Nothing synchronizes just for timing.
    - CUDA graphs: a replay hides single kernels, so timings are sampled from a timed twin of each
      bucket's graph (the same launches with external CUDA events between layers): the first batch
      of a bucket, then every ``timing_sample_every``-th at least ``timing_min_interval_s`` after
      the last timed one. A timed batch costs about one replay more; where no twin can be captured
      (a torch without external events) timed batches launch eagerly with events, the interval
      bounding how often. ``bench/model.py`` measures the cost with the sink on and off.
    Only on the "fused" path is the input normalization in layer 0's time. ``flush_timings()`` waits for all.
    """

    def __init__(self, model: MLP, *, max_batch_size: int, timing_sink: TimingSink | None = None,
                 cuda_graphs: bool | None = None, timing_sample_every: int = 16,
                 timing_min_interval_s: float = 0.02, fused: bool | None = None, provisional: bool = True,
                 graph_copies: bool = True):
        if not isinstance(model, MLP):
            raise TypeError(f"model must be a models.MLP, got {type(model).__name__}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self._sampler = TimingSampler(timing_sample_every, timing_min_interval_s)
        self.model = model.eval()
        self.name = model.name
        self.in_features = model.config.in_features
        self.out_features = model.config.out_features
        self.max_batch_size = max_batch_size
        self.device = model.device
        self.backend = model.backend
        self.dtype = model.config.torch_dtype
        self.timing_sink = timing_sink
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a model on CUDA; {self.name!r} is on {self.device}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.graph_copies = bool(graph_copies)
        self.buckets = rules.batch_buckets(max_batch_size)
        self._bucket_of = [0] + [rules.bucket(rows, max_batch_size) for rows in range(1, max_batch_size + 1)]
        self._paths = candidate_paths(model, fused)  # name -> path, each built once
        self.fused = "fused" in self._paths  # whether the fused path is a candidate
        self._candidates = tuple(self._paths)  # the paths still in the running
        self._staging = Staging(self.name, max_batch_size, self.in_features, self.out_features, self.device)
        self._graphs = BucketGraphs(self.name, self.device, len(model.layers))
        self._chosen: dict[int, str] = {}  # bucket -> the path it runs
        self.path_seconds: dict[int, dict[str, float]] = {}  # bucket -> {path: seconds per call}
        self._pending = PendingEvents()
        self._records = LayerRecords(model, lambda path, index, bucket: self._paths[path].kernel(index, bucket))
        self._clock = EagerClock(self._records, self._pending, self._emit, self.device)
        self._threads = CpuThreads()  # CPU only: threads per bucket
        self.provisional = provisional
        self.choice_states: dict[int, str] = {}  # bucket -> "provisional", "tuned" or "fixed"
        self.startup_seconds = dict.fromkeys(("compile", "tune", "capture", "path_choice"), 0.0)
        # Held for a whole batch (run, compute) and for a swap (retune): a swap lands between batches.
        self._lock = threading.RLock()

    # -- public API --------------------------------------------------------------------------

    @property
    def timing_sample_every(self) -> int:
        return self._sampler.every

    @timing_sample_every.setter
    def timing_sample_every(self, every: int) -> None:
        self._sampler.every = every

    @property
    def timing_min_interval_s(self) -> float:
        return self._sampler.min_interval_s

    @timing_min_interval_s.setter
    def timing_min_interval_s(self, seconds: float) -> None:
        self._sampler.min_interval_s = seconds

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, in_features]`` float32 CPU -> ``[M, out_features]`` float32 CPU."""
        with self._lock:
            return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._staging.check(x)
        bucket = self._bucket_of[rows]
        if self._pending:  # eager timed batches' events (a lock and a query each; most runs have none)
            self._emit(self._pending.ready())
        if bucket not in self._chosen:
            self._warm_any(bucket)
        if self.device.type != "cuda":
            return self._run_on_cpu(x, rows, bucket)
        timed = self.timing_sink is not None and self._sampler.due(bucket, bucket not in self._graphs.plain)
        served = None if timed else self._graphs.served.get(bucket)
        if served is not None and self._staging.pads_cheaply(rows, bucket):  # one launch, copies inside
            self._staging.fill(x, rows)
            served[0].replay()
            return self._staging.take(rows)
        self._staging.copy_in(x, rows)
        marks = None
        if timed and bucket in self._graphs.timed:
            graph, out, marks = self._graphs.timed[bucket]
            graph.replay()
        elif not timed and bucket in self._graphs.plain:
            graph, out = self._graphs.plain[bucket]
            graph.replay()
        else:  # eager launches, each layer timed when ``timed``
            path = self._chosen[bucket]
            with torch.no_grad():
                out = self._forward(bucket, path, self._clock.hook(path, rows, bucket) if timed else None)
        result = self._staging.copy_out(out, rows)  # synchronizes on CUDA
        if marks is not None:  # the replay is done: its events read without waiting
            path = self._chosen[bucket]
            self._emit([self._records.timing(path, i, rows, bucket, marks[i].elapsed_time(marks[i + 1]) / 1e3)
                        for i in range(len(marks) - 1)])  # elapsed_time is in ms
        return result

    def _run_on_cpu(self, x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor:
        """The rows as they came, unpadded: no graph needs a fixed shape on the CPU, and staging
        copies cost a digits batch more than a tenth of its time. ``bucket`` picks the path and threads."""
        path = self._chosen[bucket]
        self._threads.use(bucket)
        timed = self.timing_sink is not None and self._sampler.due(bucket, False)
        with torch.no_grad():
            out = self._paths[path].forward(x, self._clock.hook(path, rows, bucket) if timed else None)
        return out.float()

    def path(self, bucket: int) -> str | None:
        """The path ("fused" or "layers") that ``bucket`` runs; None until the bucket is warmed."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket must be one of {self.buckets}, got {bucket!r}")
        return self._chosen.get(bucket)

    def graphed(self, bucket: int) -> bool:
        """Whether ``bucket`` replays a CUDA graph (False: eager launches, or not warmed yet)."""
        return bucket in self._graphs.plain

    @property
    def timing_method(self) -> str:
        """How timed batches run: "perf_counter" (CPU), "events" (eager launches with CUDA events) or
        "timed_graph" (the bucket's graph with events between layers; "events" where none captured)."""
        if self.device.type != "cuda":
            return "perf_counter"
        return "timed_graph" if self._graphs.timed else "events"

    @property
    def input_buffer(self) -> torch.Tensor:
        """The preallocated ``[max_batch_size, in_features]`` float32 device input ``run`` pads into."""
        return self._staging.input

    def compute(self, bucket: int) -> torch.Tensor:
        """The model on the first ``bucket`` rows of ``input_buffer``, as ``run`` computes it (graph
        replay when captured), without copies or timings: what a benchmark measures. Returns the
        device output ``[bucket, out_features]`` in float32, as the host copy reads it; with graphs
        it is the graph's static buffer, which the next call overwrites."""
        with self._lock:
            return self._compute(bucket)

    def _compute(self, bucket: int) -> torch.Tensor:
        captured = self._graphs.plain.get(bucket)
        if captured is not None:  # the hot path: one replay, nothing else
            captured[0].replay()
            return captured[1]
        if bucket not in self.buckets:
            raise ValueError(f"bucket must be one of {self.buckets}, got {bucket!r}")
        if bucket not in self._chosen:
            self._warm_any(bucket)
            if bucket in self._graphs.plain:
                return self._compute(bucket)
        with torch.no_grad():
            return self._forward(bucket, self._chosen[bucket]).float()

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

    def layer_fields(self, path: str, layer_index: int, bucket: int) -> dict:
        """What a timing of layer ``layer_index`` on ``path`` at ``bucket`` records besides its time:
        model, layer, M, N, K, dtype, backend, and the kernel and config that run it."""
        return dict(self._records.fields(path, layer_index, bucket))

    # -- internals ---------------------------------------------------------------------------

    def _forward(self, bucket: int, path: str, hook=None) -> torch.Tensor:
        """The model on the first ``bucket`` input rows by ``path``; ``hook`` as ``MLP.forward`` takes it."""
        return self._paths[path].forward(self._staging.input[:bucket], hook)  # [bucket, in] -> [bucket, out]

    def _emit(self, timings: list[LayerTiming]) -> None:
        if self.timing_sink is not None:
            for timing in timings:
                self.timing_sink.record_layer(timing)
