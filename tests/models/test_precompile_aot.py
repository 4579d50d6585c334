"""``fusedserve precompile`` (models.aot) on the CPU: which GPU models it compiles for, and that it
writes sm_90 cubins and launcher stubs into Triton's cache. Whether those are exactly what a server
launches is checked on a GPU (test_precompile_gpu.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from fusedserve.models import MLP, MLPConfig, aot, precompile, save_model


def test_targets_default_to_the_known_gpus_of_the_capability():
    assert [t.name for t in aot.targets("9.0")] == list(aot.KNOWN_GPUS)
    assert all(t.capability == (9, 0) and t.sms == 132 for t in aot.targets())


def test_targets_take_names_and_sm_counts():
    h100, pcie = aot.targets("9.0", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe:114"])
    assert (h100.sms, pcie.name, pcie.sms, pcie.capability) == (132, "NVIDIA H100 PCIe", 114, (9, 0))
    assert aot.targets("8.0", ["NVIDIA A100-SXM4-80GB:108"])[0].triton_target.arch == 80


@pytest.mark.parametrize("capability, gpus, says", [
    ("9", None, "must look like 9.0"), ("7.5", None, "no known GPU model has capability 7.5"),
    ("9.0", ["Some GPU"], "give its SM count as NAME:SMS")])
def test_bad_targets_say_what_to_pass(capability, gpus, says):
    with pytest.raises(ValueError, match=says):
        aot.targets(capability, gpus)


def test_interpreted_kernels_cannot_be_precompiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        with aot.virtual_gpu(aot.targets()[0]):
            pass


def test_the_vendors_gemms_compute_nothing_on_the_virtual_gpu(h100_compiles):
    # As a Triton launch there, they leave their output unwritten: computed on host tensors they
    # took half of each compile process's time.
    import torch

    from fusedserve.kernels.vendor import cublas

    x, w, b = torch.ones(300, 512), torch.ones(256, 512), torch.ones(256)
    out = torch.full((300, 256), -7.0)
    with aot.virtual_gpu(h100_compiles):
        for config in cublas.CANDIDATES:
            assert cublas.launch(x, w, b, "none", out, config) is out
        made = torch.mm(x, w.t())
    assert bool((out == -7.0).all())  # not x @ w^T + b (513 everywhere)
    assert made.shape == (300, 256) and made.dtype == x.dtype


@pytest.mark.timeout(600)
def test_the_command_writes_sm90_cubins_and_launcher_stubs(tmp_path):
    # One fp16 model of awkward widths, one bucket: every kernel of its warm-up (the normalization
    # and each layer's provisional choice) compiles for the H100. In a process of its own: this
    # one's kernels are interpreted (conftest), and the interpreter compiles nothing.
    save_model(MLP(MLPConfig(70, (100,), 17, dtype="float16"), name="tiny"), tmp_path / "repo" / "tiny")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSEDSERVE_TUNE_CACHE"] = str(tmp_path / "tune")
    cache = tmp_path / "triton"
    result = subprocess.run([sys.executable, "-m", "fusedserve", "precompile", "--model-repository",
                             str(tmp_path / "repo"), "--max-batch-size", "1", "--gpu", "NVIDIA H100 80GB HBM3",
                             "--cache-dir", str(cache), "--jobs", "1"],
                            env=env, capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-3000:]
    cubins = sorted(cache.glob("*/*.cubin"))
    kernels = {p.stem for p in cubins}
    # The provisional path of a Hopper GPU: the chained fused_mlp kernel (normalization folded into the
    # first layer), or the normalization and each layer's kernel.
    assert kernels and kernels & {"_fused_mlp_layer_kernel", "_normalize_kernel"}, kernels
    for cubin in cubins:  # compiled for sm_90, as a launch on the H100 would key and build them
        meta = json.loads(cubin.with_suffix(".json").read_text())
        assert meta["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}, meta["target"]
    assert f"{len(list(cache.iterdir()))} kernels and launcher stubs" in result.stdout, result.stdout
    stubs = list(cache.glob("*/__triton_launcher*.so"))
    if stubs:  # (built where a C compiler is present) linked to the driver the node will have
        needed = subprocess.run(["readelf", "-d", str(stubs[0])], capture_output=True, text=True).stdout
        assert "libcuda.so.1" in needed, needed


@pytest.fixture
def h100_compiles(tmp_path, monkeypatch):
    """Compiles for an H100 in spawned processes (not interpreted), into ``tmp_path/triton``; yields
    the target, then checks the real tune cache (``tmp_path/tune``) was left alone: a candidate
    compile's winners are meaningless."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("FUSEDSERVE_TUNE_CACHE", str(tmp_path / "tune"))
    yield aot.targets("9.0", ["NVIDIA H100 80GB HBM3"])[0]
    assert not (tmp_path / "tune").exists() or not any((tmp_path / "tune").iterdir())


@pytest.mark.timeout(300)
def test_the_tuners_candidates_compile_ahead_without_a_gpu(tmp_path, h100_compiles):
    # What the background tuner does before its worker times: every candidate of the bucket
    # compiled, far more kernels than the provisional warm-up.
    config = MLPConfig(64, (256,), 16, "relu", "bfloat16").to_dict()
    launches, _ = aot.compile_candidates(h100_compiles, "m", config, 8, [8], jobs=1)
    provisional, _ = aot._compile_in_pool([(h100_compiles, "m", config)], [8], 8, 1, False)
    assert launches > 3 * provisional > 0, (launches, provisional)
    assert len(aot.cache_entries(tmp_path / "triton")) > 2 * provisional  # (layers may share a kernel)


@pytest.mark.timeout(300)
def test_a_layer_shapes_candidates_compile_ahead_without_a_gpu(tmp_path, h100_compiles, monkeypatch):
    # bench/kernels.py --precompile, searching full as by default: every candidate kernels.tune would
    # time, served and not.
    import torch

    from fusedserve.kernels import choosing

    monkeypatch.setenv(choosing.SEARCH_ENV, "full")
    launches = aot.compile_layer_candidates(h100_compiles, [(3, 256, 128, torch.bfloat16)], jobs=1)
    assert launches >= 2 * 8, launches  # 9 Triton and Gluon candidates at M=3, with and without prefetch
    assert len(aot.cache_entries(tmp_path / "triton")) >= 8


@pytest.mark.timeout(300)
def test_candidates_compiled_ahead_mark_each_bucket_of_each_share(tmp_path, h100_compiles):
    # What a tuner waits on before it times a bucket (tune_worker.CompileProgress).
    config = MLPConfig(64, (256,), 16, "relu", "bfloat16").to_dict()
    (tmp_path / "marks").mkdir()
    progress, compiled = aot.compile_candidates_ahead(h100_compiles, "m", config, 8, [1, 8], tmp_path / "marks",
                                                      jobs=2)
    launches, _, seconds = compiled.result(timeout=280)
    assert launches > 0 and seconds > 0 and progress.shares == 2
    assert sorted(p.name for p in (tmp_path / "marks").iterdir()) == ["1.0", "1.1", "8.0", "8.1", "done"]


@pytest.mark.timeout(300)
def test_shares_of_a_model_compile_each_kernel_once(tmp_path, h100_compiles):
    # Two processes trace the same buckets and compile disjoint halves of the kernels: together the
    # same cache entries as one process compiling them all, and no launch counted twice.
    config = MLPConfig(64, (256,), 16, "relu", "bfloat16").to_dict()
    task = (h100_compiles, "m", config, 8, [1, 8], False, False)
    [(whole, _)] = precompile.run_in_pool(aot.compile_task, [(*task, (0, 1))], 1, precompile.log_to_stderr)
    entries = aot.cache_entries(tmp_path / "triton")
    shutil.rmtree(tmp_path / "triton")
    halves = precompile.run_in_pool(aot.compile_task, [(*task, (i, 2)) for i in range(2)], 2, precompile.log_to_stderr)
    assert sum(launches for launches, _ in halves) == whole > 0, (halves, whole)
    assert aot.cache_entries(tmp_path / "triton") == entries


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_background_compile_processes_and_their_children_run_at_idle_priority():
    # In a child interpreter: the class cannot be left again without privileges.
    code = ("import os, subprocess, sys; from fusedserve.models import precompile; precompile.idle_priority(); "
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'], "
            "capture_output=True, text=True, check=True).stdout.strip(); "
            "print(os.sched_getscheduler(0), child)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(os.SCHED_IDLE)] * 2  # ptxas, started by Triton, inherits it


@pytest.mark.timeout(120)
def test_compile_processes_run_torch_on_one_thread():
    # Their tensor ops only stand in for GPU ones: 8 processes each running torch's threads on
    # every core starved each other (35 s of CPU per process on a 16-core host, for 9 s of work).
    import torch

    for initializer in (precompile.log_to_stderr, precompile.throwaway_tune_cache):
        assert precompile.run_in_pool(torch.get_num_threads, [()], 1, initializer) == [1]


@pytest.mark.timeout(120)
def test_compile_processes_fork_from_one_server_and_see_todays_environment(monkeypatch):
    # The compile server imports torch once (4.7 s per process on a fresh GPU host) and every pool
    # forks from it; a variable set after it started still reaches the compile processes.
    precompile.start_compile_server()
    precompile.start_compile_server()  # again: the one already running serves
    monkeypatch.setenv("FUSEDSERVE_PROBE", "set after the server started")
    [(seen, parent)] = precompile.run_in_pool(_probe, [()], 1, precompile.log_to_stderr)
    assert seen == "set after the server started"
    assert parent != os.getpid(), "a process of its own"
    [(_, parent_again)] = precompile.run_in_pool(_probe, [()], 1, precompile.log_to_stderr)
    assert parent_again == parent, "forked from the same server"


def _probe():
    return os.environ.get("FUSEDSERVE_PROBE"), os.getppid()
