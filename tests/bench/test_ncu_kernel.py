"""bench/ncu_kernel.py, the launcher Nsight Compute profiles: choosing the config and reading the
shape (CPU; the launches themselves need a GPU)."""

import argparse

import pytest
import torch

from bench import ncu_kernel
from kernels import gluon_ws


def test_default_is_a_candidate_and_pick_numbers_them():
    configs = gluon_ws.candidates(256, 11008, 4096, torch.bfloat16)
    assert ncu_kernel.choose(gluon_ws, 256, 11008, 4096, torch.bfloat16) == configs[0]
    assert ncu_kernel.choose(gluon_ws, 256, 11008, 4096, torch.bfloat16, pick=6) == configs[6]


def test_a_json_config_is_taken_as_given():
    config = ncu_kernel.choose(gluon_ws, 256, 11008, 4096, torch.bfloat16, '{"BLOCK_M": 64, "STAGES": 2}')
    assert config == {"BLOCK_M": 64, "STAGES": 2}


@pytest.mark.parametrize("text, match", [("[1, 2]", "JSON object"), (None, "has .* candidates")])
def test_bad_choices_say_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        ncu_kernel.choose(gluon_ws, 256, 11008, 4096, torch.bfloat16, text, pick=99)


@pytest.mark.parametrize("text", ["256x11008", "0x1x1", "axbxc"])
def test_shape_must_be_three_positive_numbers(text):
    with pytest.raises(argparse.ArgumentTypeError):
        ncu_kernel._shape(text)


def test_list_prints_numbered_candidates(capsys):
    assert ncu_kernel.main(["--kernel", "gluon_ws", "--shape", "128x11008x4096", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(gluon_ws.candidates(128, 11008, 4096, torch.bfloat16))
    assert lines[0].startswith("0 {")
