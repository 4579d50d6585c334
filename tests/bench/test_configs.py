"""bench/configs.py: its arguments, and the summary's ratios (the timing itself needs a GPU)."""

import argparse

import pytest
import torch

from bench.configs import parse_shape, parse_vary, summary


def test_a_shape_is_m_by_n_by_k_in_bf16_unless_named():
    assert parse_shape("33x3752x10224") == (33, 3752, 10224, torch.bfloat16)
    assert parse_shape("34x4816x1736:float16") == (34, 4816, 1736, torch.float16)


@pytest.mark.parametrize("text", ["33x3752", "33x3752x0", "axbxc", "3x4x5:float32", "3x4x5:int8"])
def test_a_bad_shape_is_refused_saying_the_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match="MxNxK"):
        parse_shape(text)


def test_a_vary_set_reads_ints_and_booleans():
    assert parse_vary("BLOCK_N=128,num_warps=8,TMA=True") == {"BLOCK_N": 128, "num_warps": 8, "TMA": True}
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        parse_vary("BLOCK_N")
    with pytest.raises(ValueError):
        parse_vary("BLOCK_N=wide")


def _row(kind, us, M=33):
    return dict(M=M, N=3752, K=10224, dtype="bfloat16", kind=kind, median_us=us)


def test_the_summary_is_the_librarys_best_over_ours_per_shape():
    rows = [_row("own", 20.0), _row("own", 18.0), _row("library", 16.0), _row("library", 17.0),
            _row("varied", 15.0), _row("own", 10.0, M=40), _row("library", 12.0, M=40)]
    assert summary(rows) == [dict(M=33, N=3752, K=10224, dtype="bfloat16", own=0.889, varied=1.067),
                             dict(M=40, N=3752, K=10224, dtype="bfloat16", own=1.2, varied=None)]
