"""bench/host_path.py: its cases, and the changes it makes to a runner undone after each call (the
timing itself needs a GPU)."""

import argparse
import contextlib
import threading

import pytest

from bench.host_path import no_lock, parse_case, replaced, savings, staged, without_pdl


def test_a_case_is_widths_dtype_and_batch():
    assert parse_case("8-160-736:float32:44") == (("host_8-160-736", 8, (160,), 736, "float32"), 44)


@pytest.mark.parametrize("text", ["8-160-736:float32", "8:float32:4", "8-16:int8:4", "8-16:float16:0", "a-b:float16:1"])
def test_a_bad_case_is_refused_saying_the_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match=":BATCH"):
        parse_case(text)


class _Staging:
    def copy_out(self, out, rows):
        return "the class's"


def test_a_replaced_method_comes_back_after_the_block():
    staging = _Staging()
    with replaced(staging, "copy_out", lambda out, rows: "the variant's"):
        assert staging.copy_out(None, 1) == "the variant's"
    assert staging.copy_out(None, 1) == "the class's" and "copy_out" not in vars(staging)


def test_no_lock_puts_the_runners_lock_back():
    class Runner:
        _lock = threading.RLock()

    runner = Runner()
    lock = runner._lock
    with no_lock(runner):
        assert isinstance(runner._lock, contextlib.nullcontext)
    assert runner._lock is lock


def test_staged_sets_the_graphs_with_copies_aside_for_the_block():
    class Graphs:
        served = {4: "graph with copies"}

    class Runner:
        _graphs = Graphs()

    runner = Runner()
    with staged(runner):
        assert runner._graphs.served == {}
    assert runner._graphs.served == {4: "graph with copies"}


def test_savings_are_medians_with_the_rounds_spread():
    # Three rounds: the variant saved 2, 5 and -1 us; the medians are taken side by side.
    row = savings([(50.0, 48.0), (60.0, 55.0), (52.0, 53.0)])
    assert row == dict(run_us=52.0, variant_us=53.0, saved_us=-1.0, saved_spread_us=[-1.0, 5.0])


def test_without_pdl_makes_every_launch_plain_then_puts_the_rule_back(monkeypatch):
    import torch

    from fusedserve.kernels import choosing, device
    from fusedserve.kernels.triton import fused_mlp, normalize

    modules = (device, choosing, fused_mlp, normalize)
    monkeypatch.setattr(device, "capability", lambda dev: (9, 0))  # as on a Hopper GPU: PDL everywhere
    x = torch.empty(3, 8)
    assert choosing.launch_options(x, False)["pdl"] is True
    with without_pdl():
        assert not any(m.pdl_supported(x.device) for m in modules[1:])
        assert choosing.launch_options(x, False)["pdl"] is False
    assert all(m.pdl_supported is device.pdl_supported for m in modules[1:])
    assert choosing.launch_options(x, False)["pdl"] is True
