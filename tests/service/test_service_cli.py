"""The CLI: flags, environment variables and their precedence; settings validation."""

import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

import fusedserve
from fusedserve.service.cli import parser, settings_from_args
from fusedserve.service.settings import Settings, default_workers, usable_cores

from .conftest import ROOT, Server, free_ports


def test_flags_override_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("FUSEDSERVE_PORT", "9001")
    monkeypatch.setenv("FUSEDSERVE_MODEL_REPOSITORY", str(tmp_path))
    settings = settings_from_args(parser().parse_args(["serve", "--port", "9100", "--max-delay-ms", "0.5"]))
    assert (settings.port, settings.max_batch_size, settings.max_delay_ms) == (9100, 7, 0.5)
    assert settings.model_repository == tmp_path and settings.host == "127.0.0.1"


def test_grpc_port_flag_and_environment(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_GRPC_PORT", "9002")
    assert settings_from_args(parser().parse_args(["serve"])).grpc_port == 9002
    assert settings_from_args(parser().parse_args(["serve", "--grpc-port", "0"])).grpc_port == 0, "0 turns it off"
    monkeypatch.delenv("FUSEDSERVE_GRPC_PORT")
    assert Settings().grpc_port == 8001, "Triton's default port"


def test_workers_flag_environment_and_default_from_the_cores(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDSERVE_WORKERS", "3")
    assert settings_from_args(parser().parse_args(["serve"])).workers == 3
    assert settings_from_args(parser().parse_args(["serve", "--workers", "1"])).workers == 1
    with pytest.raises(ValidationError, match="workers"):
        Settings(workers=0)
    # One process up to 3 cores (measured on the 2-core box: one beats two), then half, at most 8.
    assert [default_workers(n) for n in (1, 2, 3, 4, 6, 16, 64)] == [1, 1, 1, 2, 3, 8, 8]
    monkeypatch.delenv("FUSEDSERVE_WORKERS")
    assert Settings().workers == default_workers(usable_cores())
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")  # a container limited to one CPU
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text("max 100000\n")  # no limit: the CPUs it may run on
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0)) == usable_cores(tmp_path / "missing")


def test_defaults_serve_the_shipped_repository_on_loopback(monkeypatch):
    from fusedserve import models

    for name in [n for n in os.environ if n.startswith("FUSEDSERVE_")]:
        monkeypatch.delenv(name)
    settings = Settings()
    assert (settings.host, settings.port, settings.device, settings.backend) == ("127.0.0.1", 8000, "auto", "auto")
    assert settings.model_repository == models.DEFAULT_REPOSITORY
    assert settings.rows_per_request == settings.max_batch_size == 64


def test_inline_threshold_defaults_by_device():
    assert Settings().inline_ms("cpu") == 25.0, "a CPU model's batches under 25 ms run on the event loop"
    assert Settings().inline_ms("cuda") == 1.0
    assert Settings(inline_batch_ms=0).inline_ms("cpu") == 0.0, "an explicit threshold holds for every device"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"torch_threads": -1}, "torch_threads"),
    ({"device": "gpu"}, "device must be"),
    ({"backend": "cuda"}, "backend must be"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_batch_size": 64, "max_queue_rows": 3}, "max_queue_rows"),
])
def test_bad_settings_name_the_field(kwargs, fragment):
    with pytest.raises(ValidationError, match=fragment):
        Settings(**kwargs)


def test_python_dash_m_service_help_lists_every_flag():
    out = subprocess.run([sys.executable, "-m", "fusedserve", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    for flag in ("--host", "--port", "--model-repository", "--device", "--max-batch-size", "--max-delay-ms",
                 "--max-queue-rows", "--request-timeout-ms", "FUSEDSERVE_PORT", "--grpc-port", "FUSEDSERVE_GRPC_PORT"):
        assert flag in out.stdout, f"{flag} missing from help:\n{out.stdout}"


def test_bad_flag_value_exits_with_usage_not_a_traceback():
    out = subprocess.run([sys.executable, "-m", "fusedserve", "serve", "--device", "gpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert "device must be auto, cpu, cuda or cuda:<index>" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_tuning_search_reaches_the_kernels_and_the_processes_they_start(monkeypatch):
    from fusedserve.kernels import choosing
    from fusedserve.models import DEFAULT_REPOSITORY
    from fusedserve.service.engine import startup

    monkeypatch.setenv(choosing.SEARCH_ENV, "near")  # restored after the test, whatever start-up sets
    assert Settings().tuning_search == "near"
    settings = settings_from_args(parser().parse_args(["serve", "--tuning-search", "full", "--device", "cpu",
                                                       "--model-repository", str(DEFAULT_REPOSITORY)]))
    startup._load_runners(settings, {})
    assert os.environ[choosing.SEARCH_ENV] == "full" and choosing.search() == "full"
    with pytest.raises(ValidationError, match="tuning_search"):
        settings_from_args(parser().parse_args(["serve", "--tuning-search", "wide"]))


def test_background_tuning_flag_and_environment(monkeypatch, capsys):
    assert Settings().background_tuning is True
    monkeypatch.setenv("FUSEDSERVE_BACKGROUND_TUNING", "0")
    assert settings_from_args(parser().parse_args(["serve"])).background_tuning is False
    assert settings_from_args(parser().parse_args(["serve", "--background-tuning", "on"])).background_tuning is True
    assert parser().parse_args(["serve", "--background-tuning", "off"]).background_tuning is False
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--background-tuning", "maybe"])
    assert "expected on or off" in capsys.readouterr().err
    assert Settings().parallel_compile is True
    assert settings_from_args(parser().parse_args(["serve", "--parallel-compile", "off"])).parallel_compile is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("taken", ["--port", "--grpc-port"])
def test_one_process_with_a_taken_port_exits_at_once_in_one_line(repository, tmp_path, taken):
    port, grpc_port = free_ports(2)
    held = port if taken == "--port" else grpc_port
    with socket.create_server(("127.0.0.1", held)):  # another program listening there
        start = time.monotonic()
        server = Server(repository, tmp_path / "server.log", "--workers", "1", "--port", str(port),
                        "--grpc-port", str(grpc_port))
        try:
            code = server.proc.wait(timeout=30)
        finally:
            server.stop()
    log = server.log.read_text()
    # Checked before anything loads: no model line, no traceback, within seconds.
    assert code == 1 and time.monotonic() - start < 20, log
    assert len(log.strip().splitlines()) == 1 and "Traceback" not in log, log
    assert f"127.0.0.1:{held}" in log and f"Choose another with {taken}" in log, log


@pytest.mark.timeout(60)
def test_version_prints_the_installed_version():
    version = importlib.metadata.version("fusedserve")
    declared = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert version == declared, "the installed metadata is stale: reinstall (pip install -e .)"
    assert fusedserve.__version__ == version
    script = os.path.join(os.path.dirname(sys.executable), "fusedserve")
    for argv in ([sys.executable, "-m", "fusedserve", "--version"], [script, "--version"]):
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
        assert (out.returncode, out.stdout) == (0, f"fusedserve {version}\n"), (argv, out.stdout, out.stderr)
