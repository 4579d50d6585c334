"""On a GPU: the kernels compiled ahead of a server's warm-up are exactly those it launches.

- ``fusedserve precompile``, run with CUDA hidden for this GPU's name, capability and SMs, fills a
  fresh Triton cache from which a server's warm-up then compiles nothing (no cache miss, no new
  cache entry: kernels and launcher stubs).
- The compile workers of a cold start (``models.precompile.compile_ahead``) leave nothing for the
  serving process's warm-up to compile.
Each step runs in a process of its own (a fresh interpreter holds no compiled kernel in memory);
a miss is printed with its kernel, specialization and constants, to show what differed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from fusedserve.models import DEFAULT_REPOSITORY, MLP, MLPConfig, load_model, save_model

pytestmark = pytest.mark.gpu

MAX_BATCH = 256  # buckets 1..256: the weight-streaming and the persistent TMA families both run

# Warm every model of a repository as the server does (optionally after the cold start's compile
# workers), counting Triton's compiles that missed its cache; prints them as JSON.
# What tells two compiles of one kernel apart: its argument types, specializations, constants
# and compile options (a line of each script below).
KEY = """
def KEY(src, metadata):
    return {"hash": metadata["hash"], "name": src.name, "signature": str(src.signature), "attrs": str(src.attrs),
            "constants": str(sorted(src.constants.items(), key=str)),
            "options": {k: str(v) for k, v in metadata.items() if k not in ("hash", "shared", "name")}}
"""
WARM = KEY + """
import json, sys
import triton
from fusedserve.models import ModelRunner, latest_version, load_model, model_directories
from fusedserve.models.precompile import compile_ahead
runners = [ModelRunner(load_model(latest_version(d)[1], device="cuda", name=d.name), max_batch_size=int(sys.argv[2]))
           for d in model_directories(sys.argv[1])]
if sys.argv[3] == "workers":
    compile_ahead(runners, max_workers=8)
misses = []
def listen(src, metadata, cache_hit, **_):
    if not cache_hit:
        misses.append(KEY(src, metadata))
triton.knobs.compilation.listener = listen
for runner in runners:
    runner.warmup()
print(json.dumps({"misses": misses, "compile_s": {r.name: r.startup_seconds["compile"] for r in runners}}))
"""


# The same repository compiled on a virtual GPU, as ``fusedserve precompile`` does, each compile's KEY.
VIRTUAL = KEY + """
import json, sys
import triton
from fusedserve.kernels.rules import batch_buckets
from fusedserve.models import aot
keys = []
triton.knobs.compilation.listener = lambda src, metadata, cache_hit, **_: keys.append(KEY(src, metadata))
name, capability, sms = sys.argv[3].rsplit(":", 2)
target = aot.Target(name, tuple(int(c) for c in capability.split(".")), int(sms))
for model, config in aot.repository_models(sys.argv[1]):
    aot.compile_task(target, model, config, int(sys.argv[2]), batch_buckets(int(sys.argv[2])), launchers=False)
print(json.dumps(keys))
"""


def _explain(misses: list, repo, tmp_path) -> str:
    """Every miss in a line (whether the virtual GPU compiles the same hash: if so the kernel was
    left out ahead, else its key differs), then the first misses beside the virtual GPU's compile
    of the same kernel and constants, with the fields that differ: what the next fix needs to know."""
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    env = _env(tmp_path / "explain", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", VIRTUAL, str(repo), str(MAX_BATCH), f"{name}:{major}.{minor}:{sms}"],
                            env=env, capture_output=True, text=True, timeout=900)
    virtual = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else []
    lines = [f"{len(misses)} kernels compiled at warm-up (virtual compile: {len(virtual)} keys"
             f"{'' if result.returncode == 0 else ', failed: ' + result.stderr[-500:]})"]
    hashes = {v["hash"] for v in virtual}
    for miss in misses:
        lines.append(f"  {miss['name']} {miss['constants']}: hash {miss['hash'][:12]} "
                     f"{'in' if miss['hash'] in hashes else 'NOT in'} the virtual compile")
    for miss in misses[:3]:
        same = [v for v in virtual if v["name"] == miss["name"] and v["constants"] == miss["constants"]]
        near = same or [v for v in virtual if v["name"] == miss["name"]]
        lines.append(f"miss: {json.dumps(miss)}")
        if near:
            lines.append("  differs from the virtual compile in: " + json.dumps(
                {k: (miss[k], near[0][k]) for k in miss if k != "hash" and miss[k] != near[0][k]}))
    return "\n".join(lines)


def _check_no_misses(warmed: dict, repo, tmp_path) -> None:
    if warmed["misses"]:
        pytest.fail(_explain(warmed["misses"], repo, tmp_path), pytrace=False)


@pytest.fixture
def repository(tmp_path):
    """The shipped digits and a bf16 MLP of awkward widths."""
    repo = tmp_path / "repo"
    save_model(load_model(DEFAULT_REPOSITORY / "digits", device="cpu", backend="torch"), repo / "digits")
    torch.manual_seed(0)
    save_model(MLP(MLPConfig(520, (1000, 2048), 136, dtype="bfloat16"), name="bf16"), repo / "bf16")
    return repo


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), FUSEDSERVE_TUNE_CACHE=str(tmp_path / "tune"), **extra)
    return env


def _warm(repo, tmp_path, mode: str) -> dict:
    result = subprocess.run([sys.executable, "-c", WARM, str(repo), str(MAX_BATCH), mode], env=_env(tmp_path),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _entries(tmp_path) -> set:
    return {p.name for p in (tmp_path / "triton").iterdir()}


@pytest.mark.timeout(1800)
def test_a_precompiled_cache_leaves_warm_up_nothing_to_compile(repository, tmp_path):
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = subprocess.run([sys.executable, "-m", "fusedserve", "precompile", "--model-repository", str(repository),
                             "--max-batch-size", str(MAX_BATCH), "--capability", f"{major}.{minor}",
                             "--gpu", f"{name}:{sms}", "--jobs", "8"],
                            env=_env(tmp_path, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    before = _entries(tmp_path)
    warmed = _warm(repository, tmp_path, "alone")
    _check_no_misses(warmed, repository, tmp_path)
    assert _entries(tmp_path) == before, sorted(_entries(tmp_path) - before)  # no kernel, no launcher stub


@pytest.mark.timeout(1800)
def test_the_compile_workers_leave_warm_up_nothing_to_compile(repository, tmp_path):
    warmed = _warm(repository, tmp_path, "workers")
    _check_no_misses(warmed, repository, tmp_path)
