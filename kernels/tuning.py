"""Picking the fastest of several candidates by timing them: one candidate config among many
(``time_configs``), one config per layer of a chain (``descend_chain``), and the rotating copies of
a layer's arguments that keep its weights out of L2 while it is timed."""

import contextlib
import contextvars
import warnings

import torch

from fusedserve.kernels.timers import DOES_NOT_FIT, default_timer, timing_candidate

# Every candidate gets a few replays; the best few are timed again, interleaved (so clock or
# thermal drift hits them alike) over more replays, and the fastest median of that round wins.
_FIRST_REPEATS = 5
_FINALISTS = 3
_FINAL_ROUNDS = 4
_FINAL_REPEATS = 5
# Per candidate, the milliseconds of its calls the first round, and the final rounds together, sample
# at most (one sample at least, and one per final round): a first call on a large layer timed 20
# samples of ~10 ms calls per finalist (2.4 s at M=3024 N=16040 K=4216 fp32), whose spread is small.
_SAMPLE_BUDGET_MS = 20.0
# Copies of a layer's arguments together exceed an H200's 50 MB L2, so each timed call reads its
# weights from HBM, as a layer does when other layers run in between (small layers get at most
# _MAX_SETS copies; together they may still fit in L2, as they would in serving).
_COLD_BYTES = 128 * 2**20
_MAX_SETS = 32
# Set where launches only compile (models.aot): two argument sets key every kernel alike.
_rotating_bytes = contextvars.ContextVar("fusedserve_rotating_bytes", default=_COLD_BYTES)


# Called between two candidates' timings (``yielding``): a background tuner pauses there, or stops.
_between = contextvars.ContextVar("fusedserve_between_candidates", default=None)


@contextlib.contextmanager
def yielding(between):
    """Within the block, this thread's tuning calls ``between()`` after timing each candidate (a
    background tuner sleeps there so serving gets the GPU and the GIL; what it raises stops tuning)."""
    token = _between.set(between)
    try:
        yield
    finally:
        _between.reset(token)


def _pause():
    between = _between.get()
    if between is not None:
        between()


def _median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _sampler(timer, run, candidate):
    """``timer``'s sampler for ``run(candidate)``, built with the candidate named for its warnings."""
    naming = timing_candidate.set(candidate)
    try:
        return timer(lambda: run(candidate))
    finally:
        timing_candidate.reset(naming)


def _within_budget(samples: int, ms_per_call: float) -> int:
    """``samples``, or fewer (at least 1) where that many calls of ``ms_per_call`` exceed the budget."""
    return max(1, min(samples, int(_SAMPLE_BUDGET_MS / max(ms_per_call, 1e-9))))


def _first_round(candidates, run, timer):
    """``[(median ms, candidate)]`` of every candidate that runs, and the last failure."""
    timings, failure = [], None
    for candidate in candidates:
        try:
            sampler = _sampler(timer, run, candidate)
            samples = sampler(1)
            samples += sampler(_within_budget(_FIRST_REPEATS, samples[0]) - 1)
            timings.append((_median(samples), candidate))
        except DOES_NOT_FIT as e:
            failure = e
        except Exception as e:
            warnings.warn(f"tuning candidate {candidate} failed and was skipped: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)
            failure = e
        _pause()
    return timings, failure


def time_configs(candidates, run, timer=None):
    """Median milliseconds of ``run(candidate)`` for each candidate, and the fastest candidate.

    ``timer(fn)`` builds a sampler ``repeats -> [ms, ...]`` for a zero-argument call (default:
    CUDA-graph replays). Each candidate gets ``_FIRST_REPEATS`` samples (fewer for long calls, see
    ``_SAMPLE_BUDGET_MS``); the ``_FINALISTS`` fastest are timed again with fresh samplers in
    interleaved rounds, and the best median of those wins.
    Returns ``([(ms, candidate), ...] first-round medians, best candidate)``.

    A candidate that does not fit the GPU is skipped quietly, one that fails otherwise (say an
    optional kernel that does not build here) with a warning naming it, so one broken candidate
    cannot take a layer down; if every candidate fails, the last error is raised."""
    if not candidates:
        raise ValueError("no candidate configs to time")
    timer = timer or default_timer()
    timings, failure = _first_round(candidates, run, timer)
    if not timings:
        raise failure
    finalists = [c for _, c in sorted(timings, key=lambda t: t[0])[:_FINALISTS]]
    if len(finalists) == 1:
        return timings, finalists[0]
    samplers = [_sampler(timer, run, c) for c in finalists]
    samples = [[] for _ in finalists]
    fastest_ms = min(ms for ms, _ in timings)
    repeats = max(1, _within_budget(_FINAL_ROUNDS * _FINAL_REPEATS, fastest_ms) // _FINAL_ROUNDS)
    for _ in range(_FINAL_ROUNDS):
        for sampler, into in zip(samplers, samples, strict=True):
            into += sampler(repeats)
        _pause()
    medians = [_median(s) for s in samples]
    return timings, finalists[medians.index(min(medians))]


def descend_chain(candidates, run, timer=None):
    """One choice per layer of a chain, by coordinate descent on the whole chain's time.

    ``candidates[i]``: layer i's options, its default first; ``run(choices)`` runs the chain once
    with one option per layer. From every layer's default, each layer in turn times each of its
    options in its place, the others at their current choice (``time_configs``), and keeps the
    fastest; a layer with one option is not timed. One pass: each step times the current choice
    too, so the chain never ends slower than the defaults (as timed)."""
    chosen = [layer[0] for layer in candidates]
    for index, layer in enumerate(candidates):
        if len(layer) > 1:
            _, chosen[index] = time_configs(
                layer, lambda option, index=index: run([*chosen[:index], option, *chosen[index + 1:]]), timer)
    return chosen


def rotating_sets(*tensors):
    """``tensors`` (None allowed) plus copies with the same strides (so the same kernel variant is
    timed), enough that together they exceed ``_COLD_BYTES``."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    count = max(2, min(_MAX_SETS, -(-_rotating_bytes.get() // max(nbytes, 1))))
    return [tensors] + [tuple(None if t is None else _same_layout_copy(t) for t in tensors) for _ in range(count - 1)]


def _same_layout_copy(t):
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t.detach())  # a parameter's copy need not join autograd
