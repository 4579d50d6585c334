"""tools/provisional_table.py: the shipped tables are what the stored runs they name make of them."""

import json
from pathlib import Path

import pytest

from tools.provisional_table import build, parse_config, stored_runs, winners

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "kernels" / "tables"


@pytest.mark.parametrize("gpu, name", [("NVIDIA H200", "NVIDIA_H200-triton-3.6.0.json"),
                                       ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3-triton-3.6.0.json")])
def test_the_shipped_table_rebuilds_from_the_runs_it_names(tmp_path, gpu, name):
    shipped = json.loads((TABLES / name).read_text())
    named = {source: run for source, run in stored_runs(gpu).items() if source in shipped["sources"]}
    assert sorted(named) == shipped["sources"], "a run the table was built from is missing from kernels.jsonl"
    (path,) = build(named, tmp_path)
    assert path.read_text() == (TABLES / name).read_text()


def test_a_vendor_config_with_its_note_parses():
    assert parse_config("op=linear (cuBLASLt addmm, then the activation)") == {"op": "linear"}
    assert parse_config("BLOCK_M=64,FMA=True") == {"BLOCK_M": 64, "FMA": True}
    assert parse_config("BM128_BN256") is None


def _run(date, rows):
    return dict(gpu="G", triton="3.6.0", date=date, rows=[
        dict(impl="fusedserve", M=M, N=64, K=64, dtype="bfloat16", median_us=1.0, kernel=kernel, config=config)
        for M, kernel, config in rows])


def test_runs_before_the_vendor_competed_keep_only_small_batches():
    old = _run("2026-01-01", [(8, "gluon_small_m", "BLOCK_N=64"), (512, "gluon_ws", "BLOCK_M=128")])
    new = _run("2026-01-02", [(1024, "torch_cublas", "op=addmm_act (cuBLASLt)")])
    table = winners([old, new])[("G", "3.6.0")]
    assert {key[1]: kernel for key, (_, kernel, _) in table.items()} == {8: "gluon_small_m", 1024: "torch_cublas"}
    alone = winners([old])[("G", "3.6.0")]  # no run of this GPU had the vendor: every winner counts
    assert {key[1] for key in alone} == {8, 512}


def test_runs_that_searched_near_the_table_are_left_out():
    full = _run("2026-01-01", [(8, "gluon_small_m", "BLOCK_N=64")])
    near = dict(_run("2026-01-02", [(8, "triton_small_m", "BLOCK_N=32")]), search="near")
    table = winners([full, near])[("G", "3.6.0")]
    assert [kernel for _, kernel, _ in table.values()] == ["gluon_small_m"]


def test_float32_winners_at_k_off_sixteen_from_before_the_aligned_loads_are_left_out():
    def fp32(date, K):
        return dict(_run(date, []), rows=[dict(impl="fusedserve", M=300, N=64, K=K, dtype="float32", median_us=1.0,
                                               kernel="torch_cublas", config="op=addmm_act")])
    table = winners([fp32("2026-12-06", 1016), fp32("2026-12-06", 1024), fp32("2026-12-07T01:00", 1000)])
    assert sorted(key[3] for key in table[("G", "3.6.0")]) == [1000, 1024]
