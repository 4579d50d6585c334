"""Run a loaded MLP batch by batch: buckets, padding, warm-up, CUDA graphs and per-layer timings.

``ModelRunner`` orchestrates one piece per job: ``staging`` (rows in, padded, outputs out), ``paths``
(fused, layers, vendor; the timed choice), ``graphs`` (per bucket), ``sampling`` (timed batches).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from fusedserve.kernels import provisional, rules
from fusedserve.models.graphs import BucketGraphs
from fusedserve.models.mlp import MLP
from fusedserve.models.paths import candidate_paths, choose, current_is_faster, provisional_path
from fusedserve.models.sampling import EagerClock, LayerRecords, TimingSampler
from fusedserve.models.staging import Staging
from fusedserve.models.threads import CpuThreads
from fusedserve.models.timing import LayerTiming, PendingEvents, TimingSink

log = logging.getLogger(__name__)


class ModelRunner:
    """Computes batches of one model, one batch at a time, and times every layer launch.

    ``run(x)``: ``[M, in_features]`` float32 CPU -> ``[M, out_features]`` float32 CPU. On CUDA ``x``
    is padded to its bucket (``kernels.rules.bucket``) in a preallocated device buffer (padded rows
    are computed and dropped) and copied in and out around the bucket's graph; on the CPU rows run
    unpadded, on the bucket's path and threads. ``graph_copies=True`` (an experiment, off until
    measured on a GPU: ``bench/host_path.py``) captures each bucket's graph a third time with the
    copies inside, and ``run`` replays that one where the padding is a few KB
    (``Staging.pads_cheaply``): one launch per batch instead of three.

    ``warmup()`` warms every bucket. A bucket whose kernels the tune cache holds: each candidate
    path runs once, one CUDA graph per path is captured and the fastest kept. Any other bucket (with
    ``provisional``, the default) runs provisional choices (``kernels.provisional``) on the path its
    rule picks (``paths.provisional_path``), one compile per layer, no kernel timed; on CUDA its graph
    is timed against the "vendor" path's and the faster kept. ``choice_states[bucket]`` says
    "provisional" until ``retune(bucket)`` (``models.background``) times its kernels and paths and
    swaps the result in between two batches, unless the current graph times faster; then "tuned"
    ("fixed" where nothing is ever timed: the CPU, the torch backend). With ``provisional=False``
    warm-up tunes every bucket itself. If a capture fails the runner launches eagerly.
    ``startup_seconds`` splits warm-up into compile, tune, capture and path-choice seconds.

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
                 graph_copies: bool = False):
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

    def warmup(self) -> dict[int, float]:
        """Warm every bucket not warm yet (see the class docstring); seconds per bucket."""
        seconds = {}
        for bucket in self.buckets:
            if bucket not in self._chosen:
                seconds[bucket] = self.warm(bucket)
        split = ", ".join(f"{phase} {s:.2f} s" for phase, s in self.startup_seconds.items())
        log.info("start-up %r: warm in %.2f s (%s); %d of %d buckets provisional", self.name, sum(seconds.values()),
                 split, len(self.provisional_buckets()), len(self.buckets))
        return seconds

    def warm(self, bucket: int) -> float:
        """Warm one bucket now (as ``warmup`` does); its seconds."""
        start = time.perf_counter()
        with self._lock:
            self._warm_any(bucket)
        seconds = time.perf_counter() - start
        log.info("warm-up %r: bucket M=%d (%d/%d) took %.3f s, path %s, %s choices%s", self.name, bucket,
                 self.buckets.index(bucket) + 1, len(self.buckets), seconds, self._chosen[bucket],
                 self.choice_states[bucket], " (CUDA graph captured)" if bucket in self._graphs.plain else "")
        return seconds

    def needs_tuning(self, bucket: int) -> bool:
        """Whether warming ``bucket`` now would take provisional choices (the tune cache lacks some)."""
        return self.provisional and not all(self._paths[p].tuned(bucket) for p in self._candidates)

    def provisional_buckets(self) -> list[int]:  # the buckets still on provisional choices
        return [b for b in self.buckets if self.choice_states.get(b) == "provisional"]

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

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Adds the block's seconds to ``startup_seconds[name]`` (warm-up's split)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.startup_seconds[name] += time.perf_counter() - start

    def _warm_any(self, bucket: int) -> None:
        """Warm ``bucket``: provisionally where something is left to tune, else as tuned."""
        if self.needs_tuning(bucket):
            self._warm_provisional(bucket)
        else:
            tunable = self.device.type == "cuda" and self.backend == "triton"
            self._warm_bucket(bucket, "tune" if self.provisional is False and tunable else "compile")
            self.choice_states[bucket] = "tuned" if tunable else "fixed"
        if self.device.type == "cpu":  # the thread count that times faster there (models.threads)
            self._threads.choose(bucket, self._step(bucket, self._chosen[bucket], None))

    def _warm_provisional(self, bucket: int) -> None:
        """Run and capture ``bucket`` on its rule's path with provisional choices, no kernel timed;
        where "vendor" is a candidate too, both graphs are timed and the faster kept. A path that
        fails leaves the running when another remains (as in ``_tune_candidates``)."""
        path = provisional_path(self._candidates, self.model, bucket)
        names = tuple(dict.fromkeys((path, "vendor"))) if "vendor" in self._candidates else (path,)
        with provisional.choosing_mode("provisional"), torch.no_grad():
            for name in names:
                try:
                    with self._phase("compile"):  # the first launch of each layer compiles its one config
                        self._forward(bucket, name)
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                except Exception:
                    self._leave_out(name, bucket)
                    return self._warm_provisional(bucket)
            with self._phase("capture"):
                graphs = self._capture_candidates(bucket, names) if self.cuda_graphs else {}
            if len(graphs) > 1:
                with self._phase("path_choice"):
                    path, self.path_seconds[bucket] = choose({name: graphs[name][0].replay for name in graphs})
            with self._phase("capture"):
                self._install(bucket, path, graphs.get(path))
        self.choice_states[bucket] = "provisional"

    def _install(self, bucket: int, path: str, captured) -> None:
        """``path`` is what ``bucket`` runs, replaying ``captured`` (and its timed twin) if given."""
        self._chosen[bucket] = path
        if captured is not None:
            self._graphs.plain[bucket] = captured
            self._graphs.capture_timed(bucket, lambda hook: self._forward(bucket, path, hook))
            if self.graph_copies:
                served = self._graphs.served_twin(bucket, self._with_copies(bucket, path))
                if served is not None:
                    self._graphs.served[bucket] = served

    def _with_copies(self, bucket: int, path: str):
        """``path`` at ``bucket`` as a forward that copies its rows in and out itself (the staging's
        pinned buffers), for the graph ``run`` replays with one launch."""
        def forward(hook=None):
            self._staging.copy_in_captured(bucket)
            out = self._forward(bucket, path, hook).float()
            self._staging.copy_out_captured(out)
            return out
        return forward

    def _warm_bucket(self, bucket: int, phase: str = "tune") -> None:
        """Tune every candidate path at ``bucket``, capture their graphs, keep the fastest path.
        ``phase``: where ``startup_seconds`` counts the first launches (nothing to time: "compile")."""
        with self._phase(phase):
            self._tune_candidates(bucket)
        with self._phase("capture"):
            graphs = self._capture_candidates(bucket, self._candidates) if self.cuda_graphs else {}
        chosen = self._candidates[0]
        if len(self._candidates) > 1:
            with self._phase("path_choice"):
                chosen, self.path_seconds[bucket] = choose(
                    {path: self._step(bucket, path, graphs.get(path)) for path in self._candidates})
            log.info("%r at M=%d runs the %s path (%s)", self.name, bucket, chosen,
                     ", ".join(f"{p} {s * 1e6:.1f} us" for p, s in self.path_seconds[bucket].items()))
        with self._phase("capture"):
            self._install(bucket, chosen, graphs.get(chosen))

    def tune(self, bucket: int) -> None:
        """Time every candidate path's kernels at ``bucket`` into the tune cache, on the input
        buffer as it is; nothing captured or swapped (``models.tune_worker``: tuning in a process
        of its own, whose results ``retune`` in the serving process then finds in the cache)."""
        with self._lock, provisional.choosing_mode("tune"):
            self._tune_candidates(bucket)

    def retune(self, bucket: int) -> str:
        """Tune ``bucket`` on the calling thread while ``run`` goes on serving it, then swap the
        result in between two batches; returns the path chosen. Every candidate path's kernels are
        timed (tune mode) on a copy of the input rows, on a stream of its own; their graphs are
        captured into a memory pool of their own (the graphs serving replays meanwhile keep theirs),
        the faster path is kept, and its graph pair replaces the bucket's under the runner's lock."""
        on_cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        with provisional.choosing_mode("tune"), torch.no_grad(), \
                (torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext()):
            # A copy, made on this stream: serving keeps writing the input buffer meanwhile.
            x = self._staging.input[:bucket].clone()
            for name in self._candidates:
                self._paths[name].tune(x)
                self._paths[name].forward(x)
            if on_cuda:
                stream.synchronize()
            pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
            graphs = {name: self._graphs.record(lambda hook, name=name: self._forward(bucket, name, hook), pool=pool)
                      for name in (self._candidates if self.cuda_graphs else ())}
            chosen, seconds = self._candidates[0], None
            if len(self._candidates) > 1:
                chosen, seconds = choose({p: self._step(bucket, p, graphs.get(p)) for p in self._candidates})
            timed = served = None
            if chosen in graphs:
                timed = self._graphs.timed_twin(bucket, lambda hook: self._forward(bucket, chosen, hook), pool)
                if self.graph_copies:
                    served = self._graphs.served_twin(bucket, self._with_copies(bucket, chosen), pool)
            if on_cuda:
                stream.synchronize()
        if self._keeps_current(bucket, graphs.get(chosen)):
            return self._chosen[bucket]
        self._swap(bucket, chosen, (graphs.get(chosen), timed, served), seconds)
        return chosen

    def _keeps_current(self, bucket: int, tuned) -> bool:
        """Whether ``bucket``'s provisional graph stays, faster than ``tuned`` (timed under the lock)."""
        current = self._graphs.plain.get(bucket)
        with self._lock:
            if current is None or tuned is None or not current_is_faster(current[0].replay, tuned[0].replay):
                return False
            self.choice_states[bucket] = "tuned"
        log.info("%r at M=%d keeps its provisional graph, faster than the tuned one", self.name, bucket)
        return True

    def _swap(self, bucket: int, path: str, captured, seconds) -> None:
        """Make ``path`` with graphs ``captured`` (plain, timed, served; each None: not captured) what
        ``bucket`` runs, under the lock a batch holds: no batch sees half of it. The replaced graphs
        are freed after."""
        kinds = (self._graphs.plain, self._graphs.timed, self._graphs.served)
        with self._lock:
            old = [kind.pop(bucket, None) for kind in kinds]
            self._chosen[bucket] = path
            for kind, graph in zip(kinds, captured, strict=True):
                if graph is not None:
                    kind[bucket] = graph
            if seconds is not None:
                self.path_seconds[bucket] = seconds
            self._records.forget(bucket)  # timings name the new configs from the next batch on
            self.choice_states[bucket] = "tuned"
        del old

    def _step(self, bucket: int, path: str, captured):
        """One call of ``path`` at ``bucket`` as ``compute`` makes it: a replay of its graph when captured."""
        if captured is not None:
            return captured[0].replay
        return lambda: self._forward(bucket, path)

    def _tune_candidates(self, bucket: int) -> None:
        """Run each candidate path once at ``bucket`` (the first launch at a shape autotunes or
        compiles; the fused path tunes its chain first). A path that fails leaves the running when
        another remains: an automatic choice, and the other computes the same model."""
        x = self._staging.input[:bucket]
        with torch.no_grad():
            for name in tuple(self._candidates):
                try:
                    self._paths[name].tune(x)
                    self._forward(bucket, name)
                except Exception:
                    self._leave_out(name, bucket)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _leave_out(self, path: str, bucket: int) -> None:
        """Called in an ``except`` block: the failed ``path`` leaves the running where another
        remains (an automatic choice, and the other computes the same model); else re-raises."""
        if len(self._candidates) == 1:
            raise
        log.warning("the %s path of %r failed at M=%d; the runner leaves it out from now on",
                    path, self.name, bucket, exc_info=True)
        self._candidates = tuple(p for p in self._candidates if p != path)

    def _capture_candidates(self, bucket: int, names) -> dict:
        """``{path: (graph, static output)}`` for each of ``names`` at ``bucket``; empty (and eager
        launches from now on) once a capture fails."""
        graphs = {}
        for name in names:
            captured = self._graphs.capture(bucket, name, lambda hook, name=name: self._forward(bucket, name, hook))
            if captured is None:
                self.cuda_graphs = False
                # A broken device (not just a refused capture) must surface here, not in a later batch.
                torch.cuda.synchronize(self.device)
                return {}
            graphs[name] = captured
        return graphs

    def _emit(self, timings: list[LayerTiming]) -> None:
        if self.timing_sink is not None:
            for timing in timings:
                self.timing_sink.record_layer(timing)
