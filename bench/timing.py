"""Wall-clock timing of two ways to do one thing, side by side in one process.

``alternate`` calls them in pairs whose order flips every pair (A B, B A, A B, ...): a call that
comes first in a pair can pay for what the other left behind (its host buffers freed, the GPU idle
since its synchronize), and fixed A B pairs put all of that on A. ``order_penalty`` measures it:
one callable against itself in fixed pairs, the first call's median minus the second's.
"""

import statistics
import time


def alternate(a, b, calls: int, warmup: int = 20) -> tuple[float, float]:
    """Wall-clock microseconds per call of ``a()`` and ``b()``, ``calls`` each after ``warmup``
    pairs, the order of each pair flipped from the last: for each, the mean of its median as the
    first of a pair and its median as the second, so a cost of going first falls on both alike."""
    for _ in range(warmup):
        a(), b()
    times = {(f, place): [] for f in (0, 1) for place in (0, 1)}  # (callable, place in its pair)
    for i in range(calls):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for place, which in enumerate(order):
            start = time.perf_counter()
            (a, b)[which]()
            times[which, place].append(time.perf_counter() - start)
    return tuple(_mean_of_medians(times[which, 0], times[which, 1]) * 1e6 for which in (0, 1))


def _mean_of_medians(first: list, second: list) -> float:
    both = [statistics.median(t) for t in (first, second) if t]
    return sum(both) / len(both)


def order_penalty(f, calls: int) -> float:
    """Microseconds by which ``f()`` called first in a fixed pair is slower than ``f()`` called
    second (median of each position): what fixed A B pairs charge A."""
    first, second = [], []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        middle = time.perf_counter()
        f()
        first.append(middle - start)
        second.append(time.perf_counter() - middle)
    return (statistics.median(first) - statistics.median(second)) * 1e6
