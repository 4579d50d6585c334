"""Fixtures for the service tests: a tiny model repository written with models.save_model, and an
in-memory app with its lifespan running, and the app with gRPC on a free port (`_serve`, `served`)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
import torch
import tritonclient.grpc.aio as triton_grpc
from tritonclient.grpc import service_pb2_grpc

from fusedserve import models
from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings

IN, HIDDEN, OUT = 3, (17,), 2
ROOT = Path(__file__).resolve().parents[2]


def write_repository(root):
    """Two float32 models: "tiny" (3 -> 17 -> 2) and "wide" (5 -> 7 -> 4), seeded weights."""
    torch.manual_seed(0)
    models.save_model(models.MLP(models.MLPConfig(IN, HIDDEN, OUT)), root / "tiny")
    models.save_model(models.MLP(models.MLPConfig(5, (7,), 4)), root / "wide")
    return root


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """An app serving CPU models sets torch's process-wide thread count: undo it for later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def held_warmup(monkeypatch):
    """Every model's warm-up waits for ``release`` (``started`` says one began); then the model
    named ``fail``, if any, fails its warm-up."""
    hold = SimpleNamespace(started=threading.Event(), release=threading.Event(), fail=None)
    real_warmup = models.ModelRunner.warmup

    def warmup(self):
        hold.started.set()
        hold.release.wait(timeout=10)
        if self.name == hold.fail:
            raise RuntimeError("autotune exploded")
        return real_warmup(self)

    monkeypatch.setattr(models.ModelRunner, "warmup", warmup)
    yield hold
    hold.release.set()


@pytest.fixture
def repository(tmp_path):
    return write_repository(tmp_path / "repo")


def reference(repository, name, rows):
    """What the model itself computes, in float32 on the CPU."""
    model = models.load_model(repository / name, device="cpu", backend="torch")
    with torch.no_grad():
        return model(torch.tensor(rows, dtype=torch.float32)).float().numpy()


async def wait_ready(client, timeout_s=60.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        r = await client.get("/v2/health/ready")
        if r.status_code == 200:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not ready after {timeout_s} s: {r.status_code} {r.text}")


@pytest.fixture
def settings(repository):
    # gc_freeze=False: freezing is process-wide, and this process is the whole test session.
    # inline_batch_ms=0: batches in the worker thread, so a test can hold the model busy (a gate in
    # the runner) while the event loop takes more requests; the inline path has its own tests.
    return Settings(model_repository=repository, device="cpu", max_batch_size=8, max_delay_ms=5.0,
                    gc_freeze=False, inline_batch_ms=0.0)


@pytest.fixture
async def client(settings):
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await wait_ready(c)
            c.app = app
            yield c


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (all held at once while choosing, so none repeats)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Server:
    """``python -m fusedserve serve`` on free loopback ports (HTTP and gRPC; a ``--grpc-port`` among
    ``flags`` wins); ``repository`` None serves the shipped one."""

    def __init__(self, repository: Path | None, log: Path, *flags: str, device: str = "cpu"):
        self.port, self.grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fusedserve", "serve", "--port", str(self.port), "--grpc-port",
                 str(self.grpc_port), "--device", device, *flags,
                 *(["--model-repository", str(repository)] if repository is not None else [])],
                cwd=ROOT, env=env, stdout=out, stderr=out)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _serve(settings: Settings, wait_ready: bool = True):
    """The app's lifespan (gRPC on a free port) and a stub and a tritonclient on a channel to it."""
    port = free_port()
    app = create_app(settings.model_copy(update={"grpc_port": port}))
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    served = SimpleNamespace(app=app, port=port, state=app.state.service, lifespan=lifespan, channel=channel,
                             stub=service_pb2_grpc.GRPCInferenceServiceStub(channel),
                             triton=triton_grpc.InferenceServerClient(f"127.0.0.1:{port}"))
    while wait_ready and not served.state.ready:
        assert served.state.startup_error is None, served.state.startup_error
        await asyncio.sleep(0.01)
    return served


async def _close(served) -> None:
    await served.triton.close()
    await served.channel.close()
    await served.lifespan.__aexit__(None, None, None)


@pytest.fixture
async def served(settings):
    s = await _serve(settings)
    try:
        yield s
    finally:
        await _close(s)
