"""The on-disk tune cache."""

import json

import pytest

from fusedserve.kernels import tune_cache
from fusedserve.kernels.family import config_str


def test_tune_cache_directory_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(tune_cache.ENV_VAR, str(tmp_path / "tc"))
    assert tune_cache.cache_dir() == tmp_path / "tc"
    monkeypatch.delenv(tune_cache.ENV_VAR)
    assert tune_cache.cache_dir().parts[-2:] == (".cache", "fusedserve")


def test_tune_cache_survives_a_restart(monkeypatch, tmp_path):
    monkeypatch.setenv(tune_cache.ENV_VAR, str(tmp_path))
    first = tune_cache.TuneCache("NVIDIA H200 (test)")
    assert first.get("k") is None
    first.put("k", {"BLOCK_M": 64, "num_warps": 4})
    again = tune_cache.TuneCache("NVIDIA H200 (test)")
    assert again.get("k") == {"BLOCK_M": 64, "num_warps": 4}
    assert first.path == again.path and first.path.parent == tmp_path
    assert json.loads(first.path.read_text()) == {"k": {"BLOCK_M": 64, "num_warps": 4}}
    assert list(tmp_path.glob("*.tmp")) == [], "atomic write left a temporary file"
    # Another GPU model gets its own file.
    assert tune_cache.TuneCache("other gpu").get("k") is None


def test_corrupt_tune_cache_says_which_file(monkeypatch, tmp_path):
    monkeypatch.setenv(tune_cache.ENV_VAR, str(tmp_path))
    tune_cache.TuneCache("gpu").path.write_text("{not json")
    with pytest.raises(ValueError, match="tune cache .*gpu-triton.*delete it"):
        tune_cache.TuneCache("gpu")


def test_config_str():
    assert config_str({"BLOCK_M": 64, "num_warps": 4}) == "BLOCK_M=64,num_warps=4"
    assert config_str(None) == ""


def test_reload_adds_what_another_process_wrote(monkeypatch, tmp_path):
    monkeypatch.setenv(tune_cache.ENV_VAR, str(tmp_path))
    ours = tune_cache.device_cache("gpu (reload test)")
    ours.put("mine", {"BLOCK_M": 16})
    theirs = tune_cache.TuneCache("gpu (reload test)")  # another process's view of the same file
    theirs.put("theirs", {"BLOCK_M": 64})
    assert ours.get("theirs") is None
    tune_cache.reload_all()
    assert ours.get("theirs") == {"BLOCK_M": 64} and ours.get("mine") == {"BLOCK_M": 16}
