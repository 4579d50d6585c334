"""The kernel dispatch rules and the on-disk tune cache, without a GPU."""

import json

import pytest
import torch

from kernels import autotune_cache
from kernels.dispatch import (GLUON, GLUON_MIN_M, SMALL_M, SMALL_M_MAX, TILED, TMA_PERSISTENT, choose_kernel,
                              m_bucket)

HOPPER = (9, 0)
AMPERE = (8, 0)


def choose(M, dtype=torch.bfloat16, capability=HOPPER, tma_aligned=True, gluon_ok=False, N=4096, K=4096):
    return choose_kernel(M, N, K, dtype, capability=capability, tma_aligned=tma_aligned, gluon_ok=gluon_ok)


@pytest.mark.parametrize("M", [1, 3, 16, 17, SMALL_M_MAX])
@pytest.mark.parametrize("capability", [None, AMPERE, HOPPER])
def test_small_batches_stream_weights_everywhere(M, capability):
    assert choose(M, capability=capability, gluon_ok=True) == SMALL_M


@pytest.mark.parametrize("M", [SMALL_M_MAX + 1, 100, 130, 4096])
def test_hopper_16bit_aligned_large_batches_use_tma(M):
    assert choose(M, torch.bfloat16) == TMA_PERSISTENT
    assert choose(M, torch.float16) == TMA_PERSISTENT


def test_gluon_only_from_its_threshold_when_it_accepts_the_shape():
    assert choose(GLUON_MIN_M, gluon_ok=True) == GLUON
    assert choose(GLUON_MIN_M - 1, gluon_ok=True) == TMA_PERSISTENT
    assert choose(GLUON_MIN_M, gluon_ok=False) == TMA_PERSISTENT
    assert choose(GLUON_MIN_M, gluon_ok=True, tma_aligned=False) == TILED
    assert choose(GLUON_MIN_M, torch.float32, gluon_ok=True) == TILED


@pytest.mark.parametrize("kwargs", [
    dict(dtype=torch.float32),  # fp32 stays on the portable kernel (TF32 only if torch allows it)
    dict(capability=AMPERE),  # no TMA/WGMMA before Hopper
    dict(capability=(10, 0)),  # Hopper-only paths are for 9.x only
    dict(capability=None),  # the interpreter
    dict(tma_aligned=False),  # misaligned rows or views
])
def test_everything_else_gets_the_portable_kernel(kwargs):
    assert choose(1000, **kwargs) == TILED


@pytest.mark.parametrize("M,bucket", [(1, 1), (2, 2), (3, 4), (17, 32), (64, 64), (65, 128), (4096, 4096),
                                      (4097, 4096), (100000, 4096)])
def test_m_bucket_is_next_power_of_two_capped(M, bucket):
    assert m_bucket(M) == bucket


def test_m_bucket_rejects_empty():
    with pytest.raises(ValueError, match="M"):
        m_bucket(0)


def test_tune_cache_directory_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path / "tc"))
    assert autotune_cache.cache_dir() == tmp_path / "tc"
    monkeypatch.delenv(autotune_cache.ENV_VAR)
    assert autotune_cache.cache_dir().parts[-2:] == (".cache", "fusedserve")


def test_tune_cache_survives_a_restart(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path))
    first = autotune_cache.TuneCache("NVIDIA H200 (test)")
    assert first.get("k") is None
    first.put("k", {"BLOCK_M": 64, "num_warps": 4})
    again = autotune_cache.TuneCache("NVIDIA H200 (test)")
    assert again.get("k") == {"BLOCK_M": 64, "num_warps": 4}
    assert first.path == again.path and first.path.parent == tmp_path
    assert json.loads(first.path.read_text()) == {"k": {"BLOCK_M": 64, "num_warps": 4}}
    assert list(tmp_path.glob("*.tmp")) == [], "atomic write left a temporary file"
    # Another GPU model gets its own file.
    assert autotune_cache.TuneCache("other gpu").get("k") is None


def test_corrupt_tune_cache_says_which_file(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path))
    autotune_cache.TuneCache("gpu").path.write_text("{not json")
    with pytest.raises(ValueError, match="tune cache .*gpu-triton.*delete it"):
        autotune_cache.TuneCache("gpu")


def test_config_str():
    assert autotune_cache.config_str({"BLOCK_M": 64, "num_warps": 4}) == "BLOCK_M=64,num_warps=4"
