"""Autotuning with results kept on disk, so a restarted server does not time configs again.

Tuned configs live in one JSON file per GPU model and Triton version, in the directory named by the
``FUSEDSERVE_TUNE_CACHE`` environment variable (default ``~/.cache/fusedserve``). Delete the file
to re-tune. Keys name the kernel, the batch bucket, N, K, the dtype and the fp32 dot precision.
(Triton's own ``autotune(cache_results=True)`` stores timings under Triton's kernel cache keyed by
its compiler hash, with no directory of its own to point at; hence this small store.)

Timing (``time_configs``) replays CUDA graphs of back-to-back calls over rotating copies of the
arguments, so it sees what serving sees: weights read from HBM, no Python launch gaps.
"""

import contextvars
import functools
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

import triton
import triton.testing
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

ENV_VAR = "FUSEDSERVE_TUNE_CACHE"
# Part of the file name: bumped when candidates or the timing method change, so choices made by an
# older tuner are not reused (their files stay, unread).
TUNER_VERSION = 12


def cache_dir():
    """The directory tuned configs are written to (``$FUSEDSERVE_TUNE_CACHE`` or the default)."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "fusedserve")


def config_str(config):
    """A config dict as the short string shown in kernel stats, e.g. ``BLOCK_M=64,...,num_warps=4``."""
    return ",".join(f"{k}={v}" for k, v in config.items())


@functools.cache
def device_cache(device_name):
    """The one ``TuneCache`` of this process for a device model (every kernel family shares it)."""
    return TuneCache(device_name)


class TuneCache:
    """Tuned configs for one device model: in memory, backed by a JSON file."""

    def __init__(self, device_name, directory=None):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name)
        self.path = Path(directory or cache_dir()) / f"{slug}-triton-{triton.__version__}-tuner{TUNER_VERSION}.json"
        self._lock = threading.Lock()
        self._configs = self._read()

    def _read(self):
        if not self.path.exists():
            return {}
        try:
            with open(self.path) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"tune cache {self.path} is not valid JSON ({e}); delete it to re-tune") from e

    def get(self, key):
        return self._configs.get(key)

    def put(self, key, config):
        """Store a config and rewrite the file atomically (a crash never leaves half a file)."""
        with self._lock:
            self._configs[key] = dict(config)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self._configs, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)


# Timing (see time_configs): a CUDA graph of back-to-back calls is replayed, so Python launch cost is
# not counted and each call finds its weights out of L2 when the caller rotates over copies of them.
# A replay should last a few hundred microseconds so event resolution does not matter.
_REPLAY_TARGET_MS = 0.3
_MAX_CALLS = 64
# Every candidate is timed over a few replays; the best few are timed again, interleaved (so clock
# or thermal drift hits them alike) over more replays, and the fastest median of that round wins.
_FIRST_REPEATS = 5
_FINALISTS = 3
_FINAL_ROUNDS = 4
_FINAL_REPEATS = 5


def graph_timer(run, calls_hint):
    """A timer for one candidate: returns ``repeats -> [ms per call, ...]`` (one sample per replay).

    ``run()`` is called eagerly first (compiling, and raising what a bad config raises) and then
    captured ``calls`` times into one CUDA graph, ``calls`` a multiple of ``calls_hint`` (the
    caller's number of rotating argument sets) sized so one replay lasts ~``_REPLAY_TARGET_MS``.
    """
    import torch

    from fusedserve.kernels.common import gc_paused

    # Once per argument set before capturing: a copy may differ from the caller's tensors in what
    # Triton specializes on (16-byte alignment), and compiling must not happen inside a capture.
    for _ in range(max(1, calls_hint)):
        run()
    torch.cuda.synchronize()

    # Captured by hand on a side stream rather than with torch.cuda.graph(), whose entry empties
    # the caching allocator (and, in some torch versions, runs gc.collect) on every capture.
    side = torch.cuda.Stream()

    def capture(calls):
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), gc_paused():
            # thread_local: other threads (stats flushes, other models) may use CUDA meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(calls):
                    run()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        return graph

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_ms(graph):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    calls = max(1, calls_hint)
    graph = capture(calls)
    graph.replay()  # the first replay uploads the graph
    per_call = replay_ms(graph) / calls
    wanted = min(_MAX_CALLS, max(calls, int(_REPLAY_TARGET_MS / max(per_call, 1e-4))))
    wanted = -(-wanted // calls) * calls
    if wanted != calls:
        del graph
        calls, graph = wanted, capture(wanted)
        graph.replay()

    def sample(repeats):
        return [replay_ms(graph) / calls for _ in range(repeats)]

    return sample


def bench_timer(run):
    """A timer like ``graph_timer`` built on ``triton.testing.do_bench`` (flushes L2 itself, counts
    launch gaps): the fallback where a candidate cannot be captured into a CUDA graph."""
    run()
    return lambda repeats: [triton.testing.do_bench(run, warmup=1, rep=5, return_mode="median")
                            for _ in range(max(1, repeats // 2))]


# The candidate ``time_configs`` is timing, for the fallback warning below to name it.
_timing = contextvars.ContextVar("fusedserve_timing_candidate", default=None)


def default_timer(calls_hint=1):
    """``graph_timer`` with ``calls_hint`` argument sets, falling back to ``bench_timer`` with a
    warning (naming the candidate) when the capture fails for a reason other than the config not
    fitting the GPU."""
    def timer(run):
        try:
            return graph_timer(run, calls_hint)
        except (OutOfResources, CompileTimeAssertionFailure, PTXASError):
            raise
        except Exception as e:
            what = _timing.get()
            warnings.warn(f"CUDA-graph timing failed{f' for {what}' if what is not None else ''} "
                          f"({type(e).__name__}: {e}); timing with do_bench", RuntimeWarning, stacklevel=2)
            return bench_timer(run)
    return timer


def _median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _sampler(timer, run, config):
    """``timer``'s sampler for ``run(config)``, built with ``config`` named for its warnings."""
    naming = _timing.set(config)
    try:
        return timer(lambda: run(config))
    finally:
        _timing.reset(naming)


def time_configs(candidates, run, timer=None):
    """Median milliseconds of ``run(config)`` for each candidate, and the fastest config.

    ``timer(fn)`` builds a sampler ``repeats -> [ms, ...]`` for a zero-argument call (default:
    ``default_timer()``, CUDA-graph replays). Each candidate gets ``_FIRST_REPEATS`` samples; the
    ``_FINALISTS`` fastest are then timed again (fresh samplers) in interleaved rounds and the best
    median of those wins. Returns ``([(ms, config), ...] first-round medians, best config)``.

    Configs that do not fit the GPU (too much shared memory, too many registers) are skipped
    quietly; a candidate that fails otherwise (say an optional kernel that does not build here) is
    skipped with a warning naming it, so one broken candidate cannot take the layer down. If every
    candidate fails, the last error is raised.
    """
    if not candidates:
        raise ValueError("no candidate configs to time")
    timer = timer or default_timer()
    timings = []
    failure = None
    for config in candidates:
        try:
            ms = _median(_sampler(timer, run, config)(_FIRST_REPEATS))
        except (OutOfResources, CompileTimeAssertionFailure, PTXASError) as e:
            failure = e
            continue
        except Exception as e:
            warnings.warn(f"tuning candidate {config} failed and was skipped: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
            failure = e
            continue
        timings.append((ms, config))
    if not timings:
        raise failure
    finalists = [config for _, config in sorted(timings, key=lambda t: t[0])[:_FINALISTS]]
    if len(finalists) == 1:
        return timings, finalists[0]
    samplers = [_sampler(timer, run, config) for config in finalists]
    samples = [[] for _ in finalists]
    for _ in range(_FINAL_ROUNDS):
        for sampler, into in zip(samplers, samples):
            into += sampler(_FINAL_REPEATS)
    medians = [_median(s) for s in samples]
    return timings, finalists[medians.index(min(medians))]
