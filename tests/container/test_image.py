"""The CPU image that tests/container/build.sh builds, run with podman the way an operator runs it.

``make container-test`` builds the image and runs this module with FUSEDSERVE_TEST_IMAGE naming it;
without that every test here is skipped. Containers share the host's network and are told a free
loopback port through FUSEDSERVE_HOST and FUSEDSERVE_PORT, so the image's HEALTHCHECK and CMD must
follow those settings for anything here to pass.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import torch

from fusedserve.models import DEFAULT_REPOSITORY, MLP, MLPConfig, save_model
from fusedserve.service.settings import Settings
from tools.train_digits import TRAINING_FILE, held_out_split

IMAGE = os.environ.get("FUSEDSERVE_TEST_IMAGE")
pytestmark = pytest.mark.skipif(not IMAGE, reason="make container-test builds the image and names it here")

# The CPU image reported healthy ~3 s after `podman run` on the 2-core dev machine; a cold page
# cache (first import of torch from the image) takes several times that.
READY_TIMEOUT_S = 120
DEFAULTS = Settings.model_fields


@dataclass
class Container:
    name: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()

    def wait_healthy(self) -> float:
        """Run the image's HEALTHCHECK until it passes; the seconds that took."""
        start = time.monotonic()
        while podman("healthcheck", "run", self.name, check=False).returncode != 0:
            assert self.inspect("{{.State.Running}}") == "true", podman("logs", self.name).stderr[-3000:]
            assert time.monotonic() - start < READY_TIMEOUT_S, f"not healthy after {READY_TIMEOUT_S} s"
            time.sleep(0.25)
        return time.monotonic() - start


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(*options: str):
    """A container of IMAGE on the host's network, on free loopback ports (HTTP, and gRPC rather than
    8001, which another server may hold); removed afterwards."""
    box = Container(f"fusedserve-test-{uuid.uuid4().hex[:8]}", free_port())
    env = ["-e", "FUSEDSERVE_HOST=127.0.0.1", "-e", f"FUSEDSERVE_PORT={box.port}",
           "-e", f"FUSEDSERVE_GRPC_PORT={free_port()}"]
    podman("run", "--detach", "--name", box.name, "--network", "host", *env, *options, IMAGE)
    try:
        yield box
    finally:
        podman("rm", "--force", "--time", "0", box.name, check=False)


@pytest.fixture(scope="module")
def served():
    with running() as box:
        box.wait_healthy()
        yield box


def test_healthcheck_turns_healthy_on_the_configured_host_and_port(served):
    assert served.inspect("{{.State.Health.Status}}") == "healthy"
    # uvicorn names where it listens: the environment's host and port, no flag in CMD overriding them.
    logs = podman("logs", served.name).stderr
    assert f"Uvicorn running on http://127.0.0.1:{served.port}" in logs, logs[-2000:]


def test_infer_classifies_the_held_out_digits_as_recorded(served):
    record = json.loads((DEFAULT_REPOSITORY / "digits" / TRAINING_FILE).read_text())
    _, x_test, _, y_test = held_out_split(record["seed"], record["split"]["test_size"])
    rows = DEFAULTS["max_batch_size"].default  # one request may carry a batch's rows at most
    predicted = []
    with httpx.Client(base_url=served.url, timeout=30) as client:
        for chunk in torch.split(x_test, rows):
            response = client.post("/infer", json={"model": "digits", "inputs": chunk.tolist()})
            assert response.status_code == 200, response.text
            predicted.append(torch.tensor(response.json()["outputs"]).argmax(dim=1))
    accuracy = (torch.cat(predicted) == y_test).float().mean().item()
    # The image computes what the repository recorded at training: one digit of 360 is 0.0028.
    assert accuracy == pytest.approx(record["held_out_accuracy"], abs=1e-5)


def test_the_live_page_ships_in_the_image(served):
    # A plain `pip install .`: the page's assets must come with the package data, not the checkout.
    with httpx.Client(base_url=served.url, timeout=30, follow_redirects=True) as client:
        page = client.get("/")
        assert page.status_code == 200 and str(page.url).endswith("/dashboard"), (page.status_code, page.url)
        for asset in ("dashboard.js", "dashboard.css"):
            assert client.get(f"/dashboard/{asset}").status_code == 200, asset
        assert "digits" in client.get("/model-stats").json()["models"]


def test_server_process_is_not_root(served):
    lines = podman("top", served.name, "user", "args").stdout.splitlines()[1:]
    servers = [line.split(maxsplit=1) for line in lines if "fusedserve serve" in line]
    assert servers and all(user != "root" for user, _ in servers), lines
    assert podman("exec", served.name, "id", "-u").stdout.strip() != "0"


def _tiny_repository(path) -> tuple[MLP, torch.Tensor]:
    """A one-model repository unlike the shipped one, readable by the image's non-root user."""
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=5, hidden_features=(7,), out_features=3), name="tiny")
    save_model(model, path / "tiny")
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return model, torch.rand(3, 5)


def test_a_mounted_repository_replaces_the_shipped_one(tmp_path):
    model, x = _tiny_repository(tmp_path)
    with running("--volume", f"{tmp_path}:/models:ro") as box:
        box.wait_healthy()
        with httpx.Client(base_url=box.url, timeout=30) as client:
            assert client.get("/v2/models/digits").status_code == 404
            response = client.post("/infer", json={"model": "tiny", "inputs": x.tolist()})
    assert response.status_code == 200, response.text
    with torch.no_grad():
        want = model(x)
    # float32 on both sides; only the summation order may differ.
    torch.testing.assert_close(torch.tensor(response.json()["outputs"]), want, rtol=1e-5, atol=1e-6)


def _wait_draining(client: httpx.Client, limit_s: float) -> httpx.Response:
    deadline = time.monotonic() + limit_s
    while (response := client.get("/v2/health/ready")).status_code == 200:
        assert time.monotonic() < deadline, "readiness never turned false after podman stop"
        time.sleep(0.05)
    return response


def test_podman_stop_drains_then_exits_zero_within_the_grace_period():
    drain_s = DEFAULTS["drain_grace_s"].default
    digit = [[0.0] * 64]
    with running() as box:
        box.wait_healthy()
        grace_s = int(box.inspect("{{.Config.StopTimeout}}"))
        with httpx.Client(base_url=box.url, timeout=10) as client:
            client.get("/v2/health/live")
            start = time.monotonic()
            stop = subprocess.Popen(["podman", "stop", box.name], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            not_ready = _wait_draining(client, grace_s)  # on the connection opened before the stop
            try:  # that answer closed it; a new connection is refused while the drain finishes
                after = client.post("/infer", json={"model": "digits", "inputs": digit})
            except httpx.TransportError as exc:
                after = exc
            stop.wait(timeout=grace_s + 10)
            elapsed = time.monotonic() - start
        exit_code = box.inspect("{{.State.ExitCode}}")
    assert (not_ready.status_code, not_ready.json()["error"]) == (503, "draining")
    assert not_ready.headers.get("connection") == "close", not_ready.headers
    assert isinstance(after, httpx.TransportError), f"a new connection was served during the drain: {after}"
    assert stop.returncode == 0, stop.stderr.read()
    # Killed at the grace period's end it would exit 137; it exits once every open connection is
    # answered, at most drain_s after the stop.
    assert exit_code == "0"
    assert elapsed < min(grace_s, drain_s + 5), f"stopped after {elapsed:.1f} s: drain {drain_s} s, grace {grace_s} s"


# In the image, as its user: every cubin under TRITON_CACHE_DIR with the target it was compiled for.
_LIST_KERNELS = """
import json, os, pathlib
cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
print(json.dumps([[p.stem, json.loads(p.with_suffix(".json").read_text())["target"]["arch"]]
                  for p in cache.glob("*/*.cubin")]))
"""


@pytest.mark.timeout(300)
def test_the_image_holds_the_shipped_models_sm90_kernels():
    kernels = json.loads(podman("run", "--rm", IMAGE, "python", "-c", _LIST_KERNELS).stdout)
    assert kernels and {arch for _, arch in kernels} == {90}, kernels
    # Compiling the shipped repository again finds every kernel its warm-up launches already there
    # (a buckets' worth of the image's default batch size; the build compiled up to 256 rows).
    again = podman("run", "--rm", IMAGE, "fusedserve", "precompile", "--jobs", "1", "--no-launchers",
                   "--max-batch-size", "8", check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(0 new)" in again.stdout, again.stdout + again.stderr[-2000:]
