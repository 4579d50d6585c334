"""One engine per device on real processes: ``--devices cpu,cpu --workers 2`` (a supervisor, two CPU
engines, two front ends) on loopback. Requests spread over both engines, every answer right; the
stats and metrics say per device and in total; an engine killed or stopped under load leaves
rotation at once (its requests get a clear 503, none hangs, readiness holds) and is restarted; a
SIGTERM under load loses nothing. The checks take the server and its engines' labels, so the GPU
tests (tests/service/workers/test_devices_gpu.py) run them on CUDA engines."""

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import Server, reference, write_repository
from .test_drain_under_load import CLIENTS as DRAIN_CLIENTS, load_then_sigterm
from .test_workers import BODY, CLIENTS, HANG_S, load

CPU_ENGINES = ["cpu:0", "cpu:1"]
FLAGS = ("--workers", "2", "--max-batch-size", "16", "--max-delay-ms", "5", "--drain-grace-s", "0.5")


def engine_pids(supervisor: int) -> dict[str, int]:
    """The supervisor's engine processes by device label ("engine" for a lone one), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else 0
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == supervisor and "fusedserve.service.workers.engine_process" in argv:
            found[argv[argv.index("--label") + 1] if "--label" in argv else "engine"] = int(entry.name)
    return found


def want_output(repository: Path) -> np.ndarray:
    return reference(repository, "tiny", json.loads(BODY)["inputs"])


def signal_then_probe(server: Server, pid: int, sig: int, at_s: float, settle_s: float, probes: list):
    """A ``during`` for ``load``: ``sig`` to ``pid`` after ``at_s``, then, ``settle_s`` later, readiness
    asked three times, each on a new connection (both front ends answer some), into ``probes``."""

    async def during() -> None:
        await asyncio.sleep(at_s)
        os.kill(pid, sig)
        await asyncio.sleep(settle_s)
        for _ in range(3):
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as c:
                probes.append((await c.get("/v2/health/ready")).status_code)

    return during


def check_answers(record: list, want: np.ndarray, why: tuple[str, ...] = ("engine process",)) -> list:
    """Every answer is the right output or a 503 that says why (one of ``why``); none hung. Returns the 503s."""
    assert all(isinstance(r[2], int) for r in record), [r for r in record if not isinstance(r[2], int)][:5]
    assert {r[2] for r in record} <= {200, 503}, {r[2] for r in record}
    for r in record:
        if r[2] == 200:  # float32 on either side; batching changes the summation order only
            np.testing.assert_allclose(json.loads(r[3])["outputs"], want, rtol=1e-4, atol=1e-5)
    refused = [r for r in record if r[2] == 503]
    assert all(any(w in json.loads(r[3])["error"] for w in why) for r in refused), {r[3] for r in refused}
    assert max(seconds for _, seconds, _, _ in record) < HANG_S
    return refused


def _served(stats: dict) -> dict[str, int]:
    return {label: part["models"].get("tiny", {}).get("requests", {}).get("success", 0)
            for label, part in stats["by_device"].items()}


def check_balanced_and_counted(server: Server, labels: list[str], want: np.ndarray) -> None:
    """Load spreads over every engine; /kernel-stats, /model-stats and /metrics agree per device and in total."""
    record: list = []
    asyncio.run(load(server.port, 2.0, record))
    assert not check_answers(record, want) and len(record) > 100, len(record)
    stats = httpx.get(server.url + "/kernel-stats", timeout=10).json()
    assert stats["models"]["tiny"]["requests"]["success"] == len(record)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    family = {f.name: f for f in text_string_to_metric_families(text)}["fusedserve_requests"]
    ok = [s for s in family.samples if s.labels["model"] == "tiny" and s.labels["outcome"] == "ok"]
    page = httpx.get(server.url + "/model-stats", timeout=10).json()
    assert page["models"]["tiny"]["requests"] == len(record), page["models"]["tiny"]
    if len(labels) == 1:  # one engine: no device label, nothing per device
        assert [s.value for s in ok] == [len(record)] and "by_device" not in stats
        return
    served = _served(stats)
    assert sorted(served) == sorted(labels) and sum(served.values()) == len(record), served
    fair = len(record) / len(labels)
    assert min(served.values()) >= 0.4 * fair, f"load not spread over the engines: {served}"
    assert {s.labels["device"]: s.value for s in ok} == served, ok
    assert {label: part["models"]["tiny"]["requests"] for label, part in page["by_device"].items()} == served
    assert page["models"]["tiny"]["device"] == ",".join(labels)


def check_engine_killed_under_load(server: Server, victim: str, several: bool, want: np.ndarray) -> None:
    """SIGKILL one engine under load: right answers or a clear 503, none lost or hung; with several
    engines readiness holds and the rest serve on; the killed one is restarted and serves again."""
    pid = engine_pids(server.proc.pid)[victim]
    record: list = []
    probes: list = []
    killed_at = time.monotonic() + 0.7
    asyncio.run(load(server.port, 3.0, record, signal_then_probe(server, pid, signal.SIGKILL, 0.7, 0.2, probes)))
    # A lone engine's restart answers 503 "warming up" until it is ready again.
    refused = check_answers(record, want, ("engine process",) if several else ("engine process", "warming up"))
    if several:  # only what was in flight on the killed engine: at most one request per client
        assert 0 < len(refused) <= CLIENTS, len(refused)
        assert probes == [200] * 3, f"readiness with one engine left: {probes}"
        assert sum(r[2] == 200 and r[0] > killed_at + 0.2 for r in record) > 50, "no answers after the kill"
    end = time.monotonic() + 60
    while time.monotonic() < end and engine_pids(server.proc.pid).get(victim) in (pid, None):
        time.sleep(0.1)
    assert engine_pids(server.proc.pid).get(victim) not in (pid, None), "the killed engine was not restarted"
    server.wait_ready(timeout_s=120)
    if several:
        _until_served(server, victim, want)


def _until_served(server: Server, label: str, want: np.ndarray) -> None:
    """Send requests until engine ``label`` has answered some (it is back in rotation)."""
    end = time.monotonic() + 30
    with httpx.Client(base_url=server.url, timeout=10) as c:
        while time.monotonic() < end:
            r = c.post("/infer", content=BODY, headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["outputs"], want, rtol=1e-4, atol=1e-5)
            if _served(c.get("/kernel-stats").json()).get(label):
                return
    raise AssertionError(f"engine {label} never served again")


def check_drain(server: Server) -> None:
    """SIGTERM under load (tests/service/workers/test_drain_under_load.py's clients): every request answered 200."""
    record, refused = [], []
    asyncio.run(load_then_sigterm(server, BODY, record, refused))
    assert record and {status for status, _, _ in record} == {200}, sorted({s for s, _, _ in record})
    assert len(refused) == DRAIN_CLIENTS, f"{len(refused)} of {DRAIN_CLIENTS} clients were refused at the end"
    server.proc.wait(timeout=30)
    assert server.proc.returncode in (0, -signal.SIGTERM), server.log.read_text()[-2000:]


@pytest.fixture
def repo(tmp_path):
    return write_repository(tmp_path / "repo")


@pytest.fixture
def server(tmp_path, repo):
    s = Server(repo, tmp_path / "server.log", "--devices", ",".join(["cpu"] * len(CPU_ENGINES)), *FLAGS)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(90)
def test_load_spreads_over_the_engines_and_stats_say_per_device(server, repo):
    assert sorted(engine_pids(server.proc.pid)) == CPU_ENGINES
    check_balanced_and_counted(server, CPU_ENGINES, want_output(repo))
    assert httpx.post(server.url + "/kernel-stats/reset", timeout=10).json() == {"reset": True}
    after = httpx.get(server.url + "/kernel-stats", timeout=10).json()
    assert "tiny" not in after["models"] and not any(_served(after).values()), after["by_device"]


@pytest.mark.timeout(120)
def test_an_engine_killed_under_load_leaves_rotation_and_comes_back(server, repo):
    check_engine_killed_under_load(server, "cpu:0", True, want_output(repo))


@pytest.mark.timeout(90)
def test_a_stopped_engine_leaves_rotation_while_the_other_serves(tmp_path, repo):
    # SIGSTOP: its socket accepts but nothing answers. Heartbeat timeout 1 s: what it held gets 503
    # within ~1 s, and from then on the other engine takes every request; readiness holds.
    s = Server(repo, tmp_path / "server.log", "--devices", "cpu,cpu", "--engine-heartbeat-timeout-s", "1", *FLAGS)
    pid = None
    try:
        s.wait_ready()
        pid = engine_pids(s.proc.pid)["cpu:1"]
        record: list = []
        probes: list = []
        stopped_at = time.monotonic() + 0.5
        asyncio.run(load(s.port, 5.0, record, signal_then_probe(s, pid, signal.SIGSTOP, 0.5, 1.5, probes)))
        refused = check_answers(record, want_output(repo))
        assert len(refused) <= CLIENTS, len(refused)
        assert probes == [200] * 3, probes
        # Found by each front end's heartbeat within 1-1.5 s, or by the supervisor's kill at ~2 s (a
        # busy box may delay either a little); after that, only cpu:0 answers.
        late = [r for r in record if r[0] > stopped_at + 3.0]
        assert late and all(r[2] == 200 for r in late), "requests after the stop was found did not all succeed"
        end = time.monotonic() + 10  # the supervisor kills it at twice the timeout and starts another
        while time.monotonic() < end and "sent no heartbeat" not in s.log.read_text():
            time.sleep(0.1)
        assert "sent no heartbeat" in s.log.read_text()
        s.wait_ready(timeout_s=60)
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)  # else a failed test leaves it stopped
            except ProcessLookupError:
                pass
        s.stop()


@pytest.mark.timeout(60)
def test_sigterm_under_load_loses_no_request_across_engines(server):
    check_drain(server)
