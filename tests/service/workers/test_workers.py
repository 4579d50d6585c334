"""``--workers 2`` on real processes (a supervisor, one engine process, two front ends) on loopback:
batches merge rows from both front ends, the stats and metrics cover every process, and a front end
or the engine killed under load is restarted without any request left hanging."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from fusedserve.service.workers.frontend import FAULT_ENV

from ..conftest import Server, write_repository

CLIENTS = 16
HANG_S = 5.0  # a request unanswered this long counts as hung
BODY = json.dumps({"model": "tiny", "inputs": [[0.5, -1.0, 2.0]]}).encode()


def children(pid: int) -> dict[str, list[int]]:
    """The supervisor's children by role ("engine", "frontend"), read from /proc."""
    found: dict[str, list[int]] = {"engine": [], "frontend": []}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != pid:
            continue
        for role, module in (("engine", "service.workers.engine_process"), ("frontend", "service.workers.frontend")):
            if module in cmdline:
                found[role].append(int(entry.name))
    return found


async def client(port: int, stop_at: float, record: list) -> None:
    """Requests on a keep-alive connection until ``stop_at``; a broken connection is recorded and
    replaced. Each record: (time sent, seconds taken, status or the exception's name, body)."""
    request = (f"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            record.append((time.monotonic(), 0.0, type(exc).__name__, b""))
            await asyncio.sleep(0.05)
            continue
        try:
            while time.monotonic() < stop_at:
                sent = time.monotonic()
                try:
                    status, payload = await asyncio.wait_for(exchange(reader, writer, request), HANG_S)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                    record.append((sent, time.monotonic() - sent, type(exc).__name__, b""))
                    break
                record.append((sent, time.monotonic() - sent, status, payload))
                await asyncio.sleep(0.005 if status == 200 else 0.05)
        finally:
            writer.close()


async def exchange(reader, writer, request: bytes) -> tuple[int, bytes]:
    writer.write(request)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower().split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split(" ", 2)[1]), await reader.readexactly(int(fields["content-length"]))


async def load(port: int, seconds: float, record: list, during=None) -> None:
    """``CLIENTS`` clients for ``seconds``; ``during`` (a coroutine function) runs meanwhile."""
    stop_at = time.monotonic() + seconds
    tasks = [asyncio.create_task(client(port, stop_at, record)) for _ in range(CLIENTS)]
    if during is not None:
        await during()
    await asyncio.wait_for(asyncio.gather(*tasks), seconds + 2 * HANG_S)


@pytest.fixture
def server(tmp_path):
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--workers", "2",
               "--max-batch-size", "16", "--max-delay-ms", "5", "--drain-grace-s", "0.5")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _requests_total(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(r'fusedserve_requests_total\{model="tiny",outcome="(\w+)"\} ([0-9.e+]+)', text)
    return {outcome: float(value) for outcome, value in found}


def test_batches_merge_front_ends_and_stats_cover_every_process(server):
    assert len(children(server.proc.pid)["frontend"]) == 2
    # Front ends start once the engine imported its code (beside its imports they would slow them).
    log = server.log.read_text()
    assert log.index("started front end 0") > log.index("engine imported its code"), log
    for pid in [server.proc.pid, *children(server.proc.pid)["frontend"]]:  # ~85 MB each instead of ~300
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps, f"pid {pid} loaded torch: only the engine needs it"
    record: list = []
    asyncio.run(load(server.port, 2.0, record))
    ok = sum(status == 200 for _, _, status, _ in record)
    assert ok == len(record) and ok > 100, f"{ok} of {len(record)} answered 200"
    bad = httpx.post(server.url + "/infer", json={"model": "tiny", "inputs": [[1.0]]}, timeout=10)
    assert bad.status_code == 422, bad.text  # refused by a front end: counted by the engine all the same
    stats = httpx.get(server.url + "/kernel-stats", timeout=10).json()
    assert stats["processes"]["front_ends_connected"] == 2, stats["processes"]
    merged = stats["processes"]["batches_with_rows_from_several_front_ends"]["tiny"]
    assert merged > 0, f"no batch held rows from both front ends: {stats['processes']}"
    tiny = stats["models"]["tiny"]
    assert tiny["requests"]["success"] == ok, tiny["requests"]
    assert max(int(size) for size in tiny["batch_size_histogram"]) > 1, tiny["batch_size_histogram"]
    assert _requests_total(server.url) == {"ok": ok, "bad_input": 1}
    page = httpx.get(server.url + "/model-stats", timeout=10).json()["models"]["tiny"]  # the live page's figures
    assert page["requests"] == ok + 1 and page["errors_by_status"] == {"422": 1}, page
    assert httpx.post(server.url + "/kernel-stats/reset", timeout=10).json() == {"reset": True}
    after = httpx.get(server.url + "/kernel-stats", timeout=10).json()
    assert "tiny" not in after["models"], after["models"]
    assert after["processes"]["batches_with_rows_from_several_front_ends"]["tiny"] == 0, after["processes"]


def test_grpc_infer_through_every_front_end_matches_http(server):
    # Each new connection lands on one of the two front ends (SO_REUSEPORT): six cover both, surely
    # enough; every answer goes through that front end's RemoteEngine to the one engine.
    triton_grpc = pytest.importorskip("tritonclient.grpc")
    want = httpx.post(server.url + "/infer", content=BODY, timeout=10).json()["outputs"]
    for _ in range(6):
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            x = triton_grpc.InferInput("input", [1, 3], "FP32")
            x.set_data_from_numpy(np.array([[0.5, -1.0, 2.0]], dtype=np.float32))
            got = client.infer("tiny", [x], client_timeout=10).as_numpy("output")
        finally:
            client.close()
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg="gRPC and HTTP give the same answer")


def _grpc_ready(port: int) -> bool:
    """Whether a new gRPC connection finds the server ready."""
    triton_grpc = pytest.importorskip("tritonclient.grpc")
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return client.is_server_ready(client_timeout=2)
    except Exception:  # noqa: BLE001 - unreachable is the answer
        return False
    finally:
        client.close()


def test_front_end_killed_under_load_is_restarted(server):
    before = children(server.proc.pid)["frontend"]
    victim = min(before)  # the first started: were gRPC one front end's, this would be it
    record: list = []
    grpc_after_kill: list = []

    async def kill():
        await asyncio.sleep(0.7)
        os.kill(victim, signal.SIGKILL)
        # gRPC is every front end's: it answers at once, before the killed one is back.
        for _ in range(3):
            grpc_after_kill.append(await asyncio.to_thread(_grpc_ready, server.grpc_port))

    killed_at = time.monotonic() + 0.7
    asyncio.run(load(server.port, 3.0, record, kill))
    hung = [r for r in record if r[2] == "TimeoutError"]
    assert not hung, f"{len(hung)} requests hung"
    broken = [r for r in record if not isinstance(r[2], int)]
    # Only the killed process's connections break, each once: a client then reconnects.
    assert len(broken) <= CLIENTS, broken[:5]
    assert all(r[2] == 200 for r in record if isinstance(r[2], int)), {r[2] for r in record}
    assert sum(r[2] == 200 and r[0] > killed_at + 0.2 for r in record) > 50, "no answers after the kill"
    end = time.monotonic() + 20
    while time.monotonic() < end:
        now = children(server.proc.pid)["frontend"]
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.1)
    assert len(now) == 2 and victim not in now, f"front ends {before} -> {now}: not restarted"
    # One new connection in the three may land on the front end being killed or restarted (ready
    # false until its engine status comes); the others find a live front end.
    assert grpc_after_kill.count(True) >= 2, f"gRPC right after a front end died: {grpc_after_kill}"
    assert httpx.get(server.url + "/v2/health/ready", timeout=5).status_code == 200


def test_engine_killed_under_load_answers_503_at_once_then_recovers(server):
    engine = children(server.proc.pid)["engine"][0]
    record: list = []
    probes: list = []

    async def kill_and_probe():
        await asyncio.sleep(0.7)
        os.kill(engine, signal.SIGKILL)
        await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as c:
            probes.extend([(await c.get("/v2/health/ready")).status_code, (await c.get("/v2/health/live")).status_code])

    asyncio.run(load(server.port, 2.0, record, kill_and_probe))
    statuses = {r[2] for r in record}
    assert statuses <= {200, 503}, statuses  # no hang, no reset: the front ends answer
    refused = [r for r in record if r[2] == 503]
    assert refused, "no request saw the engine gone"
    assert any(b"engine process" in r[3] for r in refused), {r[3] for r in refused}
    # Each 503 says why: the engine is gone, or (once restarted) it is still warming up.
    assert all(b"engine process" in r[3] or b"warming up" in r[3] for r in refused), {r[3] for r in refused}
    assert max(seconds for _, seconds, _, _ in record) < 1.0, "a request waited on the dead engine"
    assert probes == [503, 503], f"readiness and liveness while the engine was gone: {probes}"
    server.wait_ready(timeout_s=60)
    assert children(server.proc.pid)["engine"] != [engine]
    r = httpx.post(server.url + "/infer", content=BODY, timeout=10)
    assert r.status_code == 200 and len(r.json()["outputs"]) == 1, r.text


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_supervisor_and_wait(server: Server, kids: list[int]) -> None:
    server.proc.kill()
    server.proc.wait()
    end = time.monotonic() + 15
    while time.monotonic() < end and any(_running(pid) for pid in kids):
        time.sleep(0.1)
    left = [pid for pid in kids if _running(pid)]
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"children still running 15 s after the supervisor died: {left}"


def test_children_stop_when_the_supervisor_is_killed(server):
    # SIGKILL leaves no chance to stop them: each notices it was orphaned and exits, freeing the ports.
    kids = [pid for pids in children(server.proc.pid).values() for pid in pids]
    assert len(kids) == 3, kids
    _kill_supervisor_and_wait(server, kids)


@pytest.mark.parametrize("role", ["engine", "frontend"])
def test_a_child_stops_when_the_supervisor_dies_while_it_starts(tmp_path, role):
    # Killed as soon as the child exists (still importing, or loading models): the child must know
    # its supervisor's PID, since its parent is already someone else when it first looks.
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--workers", "2")
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and not children(s.proc.pid)[role]:
            time.sleep(0.005)
        kids = [pid for pids in children(s.proc.pid).values() for pid in pids]
        assert kids, f"no {role} started:\n{s.log.read_text()}"
        _kill_supervisor_and_wait(s, kids)
    finally:
        s.stop()


@pytest.mark.timeout(90)
def test_a_stopped_engine_is_unready_at_once_then_killed_and_restarted(tmp_path):
    # SIGSTOP: the engine's socket still accepts, but nothing answers. Heartbeat timeout 2 s: the
    # front ends turn unready and answer what the engine held 503 after ~2 s (the deadline is 20 s);
    # the supervisor kills it at ~4 s and a new engine serves.
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--workers", "2",
               "--engine-heartbeat-timeout-s", "2", "--request-timeout-ms", "20000")
    engine = None
    try:
        s.wait_ready()
        engine = children(s.proc.pid)["engine"][0]
        os.kill(engine, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with httpx.Client(base_url=s.url, timeout=30) as c:
            held = c.post("/infer", content=BODY)  # sent to the stopped engine: in flight until found out
            waited = time.monotonic() - stopped_at
            # Found out by its front end ("stopped answering"), or on a busy box by the supervisor's
            # kill first ("not running"): either way answered long before its deadline.
            assert held.status_code == 503 and re.search("stopped answering|not running", held.json()["error"]), \
                held.text
            assert waited < 8, f"the held request was answered after {waited:.1f} s"
        # Each probe on a new connection: 4 land on both front ends, surely enough. Each front end finds
        # the silence on its own heartbeat, so the other may take up to one more beat after the first.
        end = time.monotonic() + 3
        while True:
            ready = [httpx.get(s.url + "/v2/health/ready", timeout=5) for _ in range(4)]
            if [r.status_code for r in ready] == [503] * 4 or time.monotonic() > end:
                break
            time.sleep(0.1)
        assert [r.status_code for r in ready] == [503] * 4, [r.text for r in ready]
        # (Said "stopped answering", or "not running" once the supervisor killed it.)
        assert all(re.search("stopped answering|not running", r.json()["error"]) for r in ready), \
            [r.text for r in ready]
        end = time.monotonic() + 20
        while time.monotonic() < end and children(s.proc.pid)["engine"] in ([engine], []):
            time.sleep(0.1)
        assert children(s.proc.pid)["engine"] not in ([engine], []), "the stopped engine was not replaced"
        s.wait_ready(timeout_s=60)
        r = httpx.post(s.url + "/infer", content=BODY, timeout=10)
        assert r.status_code == 200 and len(r.json()["outputs"]) == 1, r.text
        assert "sent no heartbeat" in s.log.read_text()
    finally:
        if engine is not None and _running(engine):
            os.kill(engine, signal.SIGCONT)  # else a failed test leaves it stopped
        s.stop()


def _unexpected(text: str) -> dict[str, float]:
    found = re.findall(r'fusedserve_unexpected_errors_total\{front_end="(\w+)"\} ([0-9.e+]+)', text)
    return {where: float(value) for where, value in found}


@pytest.mark.timeout(60)
def test_front_ends_unexpected_errors_are_counted_in_metrics(tmp_path, monkeypatch):
    # A bug in a front end (injected: every request for "wide" raises there) answered over HTTP
    # and gRPC is counted in /metrics, whichever front end answers the scrape.
    triton_grpc = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    monkeypatch.setenv(FAULT_ENV, "wide")
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--workers", "2")
    try:
        s.wait_ready()
        r = httpx.post(s.url + "/infer", json={"model": "wide", "inputs": [[1, 2, 3, 4, 5]]}, timeout=10)
        assert r.status_code == 500, r.text
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        try:
            x = triton_grpc.InferInput("input", [1, 5], "FP32")
            x.set_data_from_numpy(np.ones((1, 5), dtype=np.float32))
            with pytest.raises(InferenceServerException) as caught:
                client.infer("wide", [x], client_timeout=10)
        finally:
            client.close()
        assert caught.value.status() == "StatusCode.INTERNAL", caught.value
        want = {"http": 1.0, "grpc": 1.0}
        end = time.monotonic() + 5  # the counts travel to the engine beside the answers
        while time.monotonic() < end and _unexpected(httpx.get(s.url + "/metrics", timeout=5).text) != want:
            time.sleep(0.05)
        for _ in range(4):  # new connections: both front ends answer some of the scrapes
            text = httpx.get(s.url + "/metrics", timeout=5).text
            assert _unexpected(text) == want, [line for line in text.splitlines() if "unexpected" in line]
            assert 'fusedserve_requests_total{model="wide",outcome="error"} 2.0' in text
    finally:
        s.stop()


def test_the_engine_process_imports_no_web_framework():
    # Front ends start once the engine has imported its code: whatever it imports delays them.
    code = ("import sys, fusedserve.service.workers.engine_process; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
