"""The on-disk tune cache."""

import json
import logging
import multiprocessing
import os

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


BROKEN = {"garbage": b"{not json", "truncated": b'{"k": {"BLOCK_M": 6', "not UTF-8": b'{"k": "\xff\xfe"}',
          "not an object": b"[1, 2]", "entry not an object": b'{"k": 5}'}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_cache_is_a_warning_and_is_replaced_at_the_next_write(tmp_path, caplog, name):
    cache = tune_cache.TuneCache("gpu", tmp_path)
    cache.path.write_bytes(BROKEN[name])
    with caplog.at_level(logging.WARNING):
        cache = tune_cache.TuneCache("gpu", tmp_path)
    assert cache.get("k") is None
    assert any("gpu-triton" in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
    cache.put("k", {"BLOCK_M": 64})
    assert tune_cache.TuneCache("gpu", tmp_path).get("k") == {"BLOCK_M": 64}


def test_an_unwritable_cache_keeps_tuning_in_memory(tmp_path, caplog):
    (tmp_path / "file").write_text("")  # a file where the cache directory should be: every write fails
    cache = tune_cache.TuneCache("gpu", tmp_path / "file" / "cache")
    with caplog.at_level(logging.WARNING):
        cache.put("a", {"BLOCK_M": 16})
        cache.put("b", {"BLOCK_M": 32})
    assert cache.get("a") == {"BLOCK_M": 16} and cache.get("b") == {"BLOCK_M": 32}
    warnings = [r for r in caplog.records if "cannot write tune cache" in r.getMessage()]
    assert len(warnings) == 1, "the fallback is announced once, not at every tuning"


def test_writes_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    tune_cache.TuneCache("gpu", tmp_path).put("k", {"BLOCK_M": 64})
    assert events == ["fsync", "replace", "fsync"], events  # the file, then the directory's entry


def _tune_in_another_process(directory: str, worker: int, count: int) -> None:
    cache = tune_cache.TuneCache("gpu", directory)
    for i in range(count):
        cache.put(f"w{worker}-{i}", {"BLOCK_M": i})


def test_processes_sharing_a_cache_keep_each_others_entries(tmp_path):
    # Each process starts from an empty cache and writes only its own keys; without the merge under
    # a lock, each rewrite drops the keys the other processes wrote since it read the file.
    workers, count = 4, 15
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_tune_in_another_process, args=(str(tmp_path), w, count)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    on_disk = json.loads(tune_cache.TuneCache("gpu", tmp_path).path.read_text())
    missing = sorted({f"w{w}-{i}" for w in range(workers) for i in range(count)} - set(on_disk))
    assert not missing, f"{len(missing)} entries lost: {missing[:5]}"


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
