"""bench/servers.py (specs, /proc process trees) and bench/load_profile.py (py-spy stacks by area)."""

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bench.load_profile import area, parse_stacks, summarize_by_process, summarize_stacks, thread_split, thread_ticks
from bench.servers import (
    ServerProcess,
    ServerSpec,
    default_servers,
    parse_server,
    read_procs,
    settled,
    stat_fields,
    tree,
)


def test_default_servers_are_issue_22s_peers_and_fusedserve_takes_extra_flags():
    specs = default_servers(12, ["--workers", "4"])
    assert list(specs) == ["fusedserve", "naive_fastapi_1w", "naive_fastapi_12w", "litserve"]
    assert specs["fusedserve"].argv[-2:] == ("--workers", "4")
    assert "--workers" in specs["naive_fastapi_12w"].argv and specs["litserve"].needs == "litserve"
    assert list(default_servers(1, [])) == ["fusedserve", "naive_fastapi_1w", "litserve"]


def test_devices_start_fusedserve_once_per_value():
    specs = default_servers(1, ["--workers", "4"], ["cuda:0", "all", "cuda:0,cuda:1"])
    assert list(specs) == ["fusedserve", "fusedserve_all", "fusedserve_cuda_0_cuda_1", "naive_fastapi_1w", "litserve"]
    assert specs["fusedserve"].argv[-4:] == ("--workers", "4", "--devices", "cuda:0")
    assert specs["fusedserve_cuda_0_cuda_1"].argv[-2:] == ("--devices", "cuda:0,cuda:1")


def test_parse_server_splits_name_and_command_and_refuses_a_bare_name():
    spec = parse_server("fs_w4=python -m fusedserve serve --port {port} --workers 4")
    assert spec.name == "fs_w4" and spec.argv == ("python", "-m", "fusedserve", "serve", "--port", "{port}",
                                                   "--workers", "4")
    with pytest.raises(ValueError, match="NAME=COMMAND"):
        parse_server("fusedserve")


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses():
    # /proc/<pid>/stat: pid (comm) state ppid ... utime stime cutime cstime (fields 14-17)
    line = "42 (my (odd) name) S 7 42 42 0 -1 0 0 0 0 0 150 25 3 2 20 0 1 0 100 0 0"
    assert stat_fields(line) == (42, 7, 150 + 25 + 3 + 2)


def test_tree_finds_every_descendant_and_nothing_else():
    procs = {1: (0, 0), 10: (1, 5), 11: (10, 5), 12: (11, 5), 13: (10, 5), 20: (1, 5)}
    assert sorted(tree(10, procs)) == [10, 11, 12, 13]
    assert tree(99, procs) == []


def test_a_servers_cpu_time_counts_its_children(tmp_path):
    # A parent that idles while its child burns ~0.3 s of CPU: the tree's time includes the child's.
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\ntime.sleep(30)']); "
            "time.sleep(30)")
    spec = ServerSpec("burner", ("{python}", "-c", code))
    server = ServerProcess(spec, "cpu", tmp_path, tmp_path)
    try:
        end = time.monotonic() + 20
        while server.cpu_seconds() < 0.25 and time.monotonic() < end:
            time.sleep(0.1)
        assert len(server.pids()) == 2 and server.cpu_seconds() >= 0.25
    finally:
        children = server.pids()[1:]
        server.stop(timeout_s=5)
    assert server.proc.poll() is not None
    # The child the server left is ended too: gone, or a zombie until its new parent reaps it
    # (init may take a moment on a loaded machine).
    end = time.monotonic() + 5
    while (left := [pid for pid in children if _running(pid)]) and time.monotonic() < end:
        time.sleep(0.05)
    assert not left, left


def test_cpu_by_process_names_each_role_and_its_busiest_process(tmp_path):
    # Two children run the same module (two front ends), busy or idle: the role sums them, and its
    # busiest one is the burner alone.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    (tmp_path / "busy.py").write_text(burn)
    (tmp_path / "idle.py").write_text("import time\ntime.sleep(30)")
    code = ("import subprocess, sys, time; [subprocess.Popen([sys.executable, '-m', m], cwd=sys.argv[1]) "
            "for m in ('busy', 'idle', 'busy')]; time.sleep(30)")
    server = ServerProcess(ServerSpec("roles", ("{python}", "-c", code, str(tmp_path))), "cpu", tmp_path, tmp_path)
    try:
        before, t0 = read_procs(), time.monotonic()
        end = t0 + 20
        while server.cpu_seconds() < 0.75 and time.monotonic() < end:
            time.sleep(0.1)
        roles = server.cpu_by_process(before, read_procs(), time.monotonic() - t0)
    finally:
        server.stop(timeout_s=5)
    assert {r: v["processes"] for r, v in roles.items()} == {"root": 1, "busy": 2, "idle": 1}
    assert roles["busy"]["cores"] >= roles["busy"]["busiest_cores"] > roles["idle"]["busiest_cores"]


def test_summarize_by_process_keys_samples_by_the_innermost_process_module():
    text = ('process 5:"python -m fusedserve serve";'
            'process 6:"python -m fusedserve.service.workers.engine_process --x 1";'
            "Batcher._loop (service/engine/batcher.py:238) 3\n"
            'process 5:"python -m fusedserve serve";process 7:"python -m fusedserve.service.workers.frontend --fd 3";'
            "thread (0x1);Runner.run (asyncio/runners.py:118) 1\n"
            'process 5:"python -m fusedserve serve";Runner.run (asyncio/runners.py:118) 2\n')
    summary = summarize_by_process(text)
    assert {role: s["samples"] for role, s in summary.items()} == {"engine_process": 3, "frontend": 1, "fusedserve": 2}
    assert summary["engine_process"]["top_self_frames"][0]["what"].startswith("Batcher._loop")


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_area_goes_by_the_first_folder_and_stdlib_frames_defer_to_their_caller():
    assert area("infer_route (service/http/routes/infer.py:30)").startswith("fusedserve service")
    assert area("relu (torch/nn/functional.py:1771)") == "torch"
    assert area("_Environ.__getitem__ (<frozen os>:676)") is None
    assert area("something (mypkg/mod.py:1)") == "other"


def test_summarize_stacks_shares_samples_by_innermost_area_and_inclusively():
    text = ('process 5:"python -m fusedserve serve";Runner.run (asyncio/runners.py:118);'
            "infer_route (service/http/routes/infer.py:30);forward (torch/nn/functional.py:1) 3\n"
            'process 5:"python -m fusedserve serve";Runner.run (asyncio/runners.py:118);'
            "get_tracer_provider (trace/__init__.py:569);_Environ.__getitem__ (<frozen os>:676) 1\n"
            "garbage line\n")
    stacks = parse_stacks(text)
    assert sum(stacks.values()) == 4 and all(not f.startswith("process") for s in stacks for f in s)
    summary = summarize_stacks(stacks)
    self_shares = {r["what"]: r["share"] for r in summary["self_by_area"]}
    assert self_shares == {"torch": 0.75, "opentelemetry (FastAPI's telemetry check)": 0.25}
    inclusive = {r["what"]: r["share"] for r in summary["inclusive_by_area"]}
    assert inclusive["asyncio/uvloop (event loop)"] == 1.0
    assert inclusive["fusedserve service (routes, batcher, stats, middleware)"] == 0.75
    assert summarize_stacks(Counter()) == {"samples": 0}


def test_thread_split_puts_the_main_thread_apart_from_the_rest():
    hz = os.sysconf("SC_CLK_TCK")
    before = {(5, 5): 0, (5, 6): 0}
    after = {(5, 5): 2 * hz, (5, 6): hz, (9, 9): hz // 2}
    assert thread_split(before, after, root=5) == {"main_thread_s": 2.0, "other_threads_s": 1.0,
                                                   "child_processes_s": round((hz // 2) / hz, 3)}


def test_thread_ticks_reads_this_process():
    ticks = thread_ticks([os.getpid()])
    assert (os.getpid(), os.getpid()) in ticks


def test_litserve_app_groups_a_batch_by_model():
    pytest.importorskip("litserve")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "peers"))
    try:
        from litserve_app import RepositoryAPI
    finally:
        sys.path.pop(0)
    from fusedserve.models import DEFAULT_REPOSITORY, load_model

    api = RepositoryAPI(str(DEFAULT_REPOSITORY), max_batch_size=8, batch_timeout=0.001, api_path="/infer")
    api.setup("cpu")
    rows = [[float(i % 17) for i in range(64)], [float(i % 5) for i in range(64)]]
    batch = [api.decode_request({"model": "digits", "inputs": rows[:1]}), api.decode_request({"inputs": rows})]
    out = [api.encode_response(o) for o in api.unbatch(api.predict(api.batch(batch)))]
    reference = load_model(DEFAULT_REPOSITORY / "digits", device="cpu", backend="torch")
    import torch

    expected = reference(torch.tensor(rows)).tolist()
    assert out[0]["model"] == out[1]["model"] == "digits"
    np.testing.assert_allclose(out[0]["outputs"], expected[:1], atol=1e-5)
    np.testing.assert_allclose(out[1]["outputs"], expected, atol=1e-5)


def test_read_procs_and_tree_see_this_process_and_its_child():
    procs = read_procs()
    assert procs[os.getpid()][0] == os.getppid()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert child.pid in tree(os.getpid(), read_procs())
    finally:
        child.kill()
        child.wait()


def test_a_fusedserve_server_is_settled_once_no_bucket_is_provisional():
    stats = {"served": {"a": {"choices": {"1": "tuned", "2": "fixed"}}, "b": {"choices": {"1": "provisional"}}}}
    assert not settled(stats)
    stats["served"]["b"]["choices"]["1"] = "tuned"
    assert settled(stats) and settled({"served": {}})
