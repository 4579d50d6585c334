"""A runner's warm-up, tuning and swaps: what ``ModelRunner`` does to a bucket before and between
the batches it computes (``models.runner``)."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from fusedserve.kernels import provisional
from fusedserve.models.paths import choose, current_is_faster, provisional_path

log = logging.getLogger(__name__)


class Warming:
    """``ModelRunner``'s warm-up, tuning and swaps, on the runner's own state (paths, staging,
    graphs, lock: see its ``__init__``).

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
    """

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
