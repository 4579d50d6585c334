"""``--devices all --workers 2`` on a GPU host: one CUDA engine per visible GPU behind two front ends,
with the checks of tests/service/workers/test_devices_server.py (right answers under load, per-device and
total stats, an engine killed under load, a drain that loses nothing). On a one-GPU host that is one
CUDA engine; on several GPUs the load spreads over them all."""

import pytest
import torch

from ..conftest import Server, write_repository
from .test_devices_server import (
    FLAGS,
    check_balanced_and_counted,
    check_drain,
    check_engine_killed_under_load,
    engine_pids,
    want_output,
)

READY_S = 420  # a cold Triton cache compiles every bucket of both models (tests/service/test_gpu_server.py)


@pytest.fixture
def gpu_server(tmp_path):
    repo = write_repository(tmp_path / "repo")
    # Background tuning off: the checks are about processes, not kernel choices, and tuning would
    # share the GPU with the load.
    s = Server(repo, tmp_path / "server.log", "--devices", "all", "--background-tuning", "off", *FLAGS,
               device="cuda")
    try:
        s.wait_ready(timeout_s=READY_S)
        s.repo = repo
        yield s
    finally:
        s.stop()


@pytest.mark.gpu
@pytest.mark.timeout(READY_S + 120)
def test_cuda_engines_serve_under_load_survive_a_kill_and_drain(gpu_server):
    engines = sorted(engine_pids(gpu_server.proc.pid))
    assert len(engines) == torch.cuda.device_count(), engines  # one per GPU ("engine" when there is one)
    labels = engines if len(engines) > 1 else ["cuda:0"]
    want = want_output(gpu_server.repo)
    check_balanced_and_counted(gpu_server, labels, want)
    check_engine_killed_under_load(gpu_server, engines[0], len(engines) > 1, want)
    check_drain(gpu_server)
