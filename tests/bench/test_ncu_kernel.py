"""bench/ncu_kernel.py, the launcher Nsight Compute profiles: choosing the config and reading the
shape (CPU; the launches themselves need a GPU)."""

import argparse
import json

import pytest
import torch

from bench import ncu_kernel
from fusedserve.kernels.gluon import ws as gluon_ws


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


def test_the_peer_has_no_configs_to_list():
    with pytest.raises(SystemExit):
        ncu_kernel.main(["--kernel", "cublaslt", "--shape", "256x11008x4096", "--list"])


def _raw_csv(path, rows):
    """A file shaped like ``ncu --csv --page raw``: ncu's log lines, names, units, one row per launch."""
    names = ["ID", "Kernel Name", "launch__grid_size", "gpu__time_duration.sum",
             "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
             "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "unrelated__metric.sum"]
    units = ["", "", "", "ns", "%", "ratio", "ratio", ""]
    lines = ["==PROF== Connected to process 1", ",".join(f'"{v}"' for v in names),
             ",".join(f'"{v}"' for v in units)]
    lines += [",".join(f'"{v}"' for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def test_summary_keeps_the_telling_counters_and_orders_the_stalls(tmp_path, capsys):
    from bench import ncu_summary

    path = tmp_path / "ncu.csv"
    _raw_csv(path, [["0", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "132", "34,100", "81.5", "0.5", "2.25", "7"]])
    assert ncu_summary.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "nvjet_tst_128x256" in out and "34,100 ns" in out and "81.5 %" in out
    assert "unrelated__metric" not in out
    assert "stalls per issued instruction: barrier 2.25, wait 0.50" in out


def test_summary_of_a_file_without_a_kernel_fails(tmp_path, capsys):
    from bench import ncu_summary

    path = tmp_path / "empty.csv"
    path.write_text("==PROF== Disconnected\n")
    assert ncu_summary.main([str(path)]) == 1
    assert "no profiled kernel" in capsys.readouterr().err


def test_summary_json_holds_the_same_selection(tmp_path):
    from bench import ncu_summary

    path = tmp_path / "ncu.csv"
    _raw_csv(path, [["0", "gluon_ws_kernel", "116", "40,192", "78.3", "1.5", "7.3", "7"],
                    ["1", "gluon_ws_kernel", "116", "40,100", "78.4", "1.4", "7.2", "7"]])
    out = tmp_path / "ncu.json"
    assert ncu_summary.main([str(path), "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["launch"] for r in records] == [0, 1]
    assert records[0]["metrics"]["gpu__time_duration.sum"] == "40,192 ns"
    assert list(records[0]["stalls"]) == ["barrier", "wait"]
