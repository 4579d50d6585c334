"""bench/timing.py: pairs whose order flips spread a first-in-pair cost over both callables, and
order_penalty measures that cost."""

import time

import pytest

from bench.timing import alternate, order_penalty

FIRST_COST_S = 0.002


class PairRecorder:
    """Two callables that log their calls; whichever starts a pair sleeps ``FIRST_COST_S`` more."""

    def __init__(self):
        self.calls = []

    def call(self, name):
        def f():
            if len(self.calls) % 2 == 0:
                time.sleep(FIRST_COST_S)
            self.calls.append(name)
        return f


@pytest.mark.timeout(30)
def test_alternate_flips_the_order_of_every_pair():
    rec = PairRecorder()
    alternate(rec.call("a"), rec.call("b"), calls=6, warmup=0)
    assert rec.calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]


@pytest.mark.timeout(30)
def test_a_cost_of_going_first_falls_on_both_alike():
    rec = PairRecorder()
    a_us, b_us = alternate(rec.call("a"), rec.call("b"), calls=41, warmup=2)
    # Each goes first in about half the pairs: neither median carries the whole cost.
    assert abs(a_us - b_us) < FIRST_COST_S * 1e6 * 0.9, (a_us, b_us)


@pytest.mark.timeout(30)
def test_order_penalty_measures_what_the_first_of_a_fixed_pair_pays():
    rec = PairRecorder()
    penalty = order_penalty(rec.call("a"), calls=20)
    assert FIRST_COST_S * 1e6 * 0.8 < penalty < FIRST_COST_S * 1e6 * 3, penalty
    assert order_penalty(lambda: None, calls=50) < 50
