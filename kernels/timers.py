"""How one tuning candidate is timed: CUDA-graph replays of back-to-back calls, so Python launch
cost is not counted and each call finds its weights out of L2 when the caller rotates over copies
of them. A replay lasts a few hundred microseconds, so event resolution does not matter."""

import contextvars
import warnings

import triton.testing
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

from fusedserve.kernels.device import gc_paused

# Errors of a config that does not fit the GPU (shared memory, registers): skipped quietly.
DOES_NOT_FIT = (OutOfResources, CompileTimeAssertionFailure, PTXASError)
_REPLAY_TARGET_MS = 0.3
_MAX_CALLS = 64

# The candidate being timed, for the fallback warning to name it.
timing_candidate = contextvars.ContextVar("fusedserve_timing_candidate", default=None)


def graph_timer(run, calls_hint):
    """A sampler for ``run()``: ``repeats -> [ms per call, ...]``, one sample per graph replay.

    ``run()`` is called eagerly first (compiling, and raising what a bad config raises), once per
    argument set, then captured ``calls`` times into one CUDA graph, ``calls`` a multiple of
    ``calls_hint`` (the caller's number of rotating argument sets) sized so a replay lasts
    ~``_REPLAY_TARGET_MS``."""
    import torch

    # A copy may differ from the caller's tensors in what Triton specializes on (16-byte
    # alignment), and compiling must not happen inside a capture.
    for _ in range(max(1, calls_hint)):
        run()
    torch.cuda.synchronize()
    # Captured by hand on a side stream: torch.cuda.graph() empties the caching allocator on entry.
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
        graph.replay()  # the first replay uploads the graph
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
    per_call = replay_ms(graph) / calls
    wanted = min(_MAX_CALLS, max(calls, int(_REPLAY_TARGET_MS / max(per_call, 1e-4))))
    wanted = -(-wanted // calls) * calls
    if wanted != calls:
        del graph
        calls, graph = wanted, capture(wanted)
    return lambda repeats: [replay_ms(graph) / calls for _ in range(repeats)]


def bench_timer(run):
    """A sampler like ``graph_timer``'s from ``triton.testing.do_bench`` (flushes L2 itself, counts
    launch gaps): the fallback where a candidate cannot be captured into a CUDA graph."""
    run()
    return lambda repeats: [triton.testing.do_bench(run, warmup=1, rep=5, return_mode="median")
                            for _ in range(max(1, repeats // 2))]


def default_timer(calls_hint=1):
    """``graph_timer`` with ``calls_hint`` argument sets, falling back to ``bench_timer`` with a
    warning naming the candidate when the capture fails for a reason other than the config not
    fitting the GPU."""
    def timer(run):
        try:
            return graph_timer(run, calls_hint)
        except DOES_NOT_FIT:
            raise
        except Exception as e:
            what = timing_candidate.get()
            warnings.warn(f"CUDA-graph timing failed{f' for {what}' if what is not None else ''} "
                          f"({type(e).__name__}: {e}); timing with do_bench", RuntimeWarning, stacklevel=2)
            return bench_timer(run)
    return timer
