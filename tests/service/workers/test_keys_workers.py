"""API keys on a real server, one process and ``--workers 2``: the keys set in the environment open
what they should on every route, HTTP and gRPC; a wrong key and pydantic's mask ("**********", what
``model_dump_json`` writes for a secret) open nothing; no child shows a key on its command line."""

from pathlib import Path

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

from ..conftest import Server, write_repository
from ..grpc.test_grpc import ROWS, raw_request
from .test_workers import children

API, ADMIN, MASK = "inference-key-7", "admin-key-9", "**********"
INFER = {"model": "tiny", "inputs": [[0.5, -1.0, 2.0]]}
READS = ("/kernel-stats", "/model-stats", "/metrics", "/v2", "/v2/models/tiny")
ADMIN_POSTS = ("/kernel-stats/reset", "/v2/repository/index")


@pytest.fixture(params=[1, 2], ids=["1 process", "--workers 2"])
def keyed(request, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_API_KEY", API)
    monkeypatch.setenv("FUSEDSERVE_ADMIN_API_KEY", ADMIN)
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--workers", str(request.param))
    try:
        s.wait_ready(60)
        yield s
    finally:
        s.stop()


def _http(s: Server, key: str | None) -> dict[str, int]:
    """Status by route for a client sending ``key`` (None: no Authorization header)."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=s.url, headers=headers, timeout=10) as c:
        found = {"/infer": c.post("/infer", json=INFER).status_code,
                 "/v2/health/ready": c.get("/v2/health/ready").status_code}
        found.update({path: c.get(path).status_code for path in READS})
        found.update({path: c.post(path, json={}).status_code for path in ADMIN_POSTS})
    return found


def _grpc(s: Server, key: str | None) -> dict[str, grpc.StatusCode]:
    metadata = () if key is None else (("authorization", f"Bearer {key}"),)
    found = {}
    with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name, call, request in (("ModelInfer", stub.ModelInfer, raw_request(ROWS)),
                                    ("RepositoryIndex", stub.RepositoryIndex, pb.RepositoryIndexRequest())):
            try:
                call(request, metadata=metadata, timeout=10)
                found[name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                found[name] = exc.code()
    return found


@pytest.mark.timeout(120)
def test_keys_hold_under_every_worker_count(keyed):
    for key in (None, "wrong", MASK):
        http = _http(keyed, key)
        assert http.pop("/v2/health/ready") == 200  # probes stay open
        assert set(http.values()) == {401}, (key, http)
        assert set(_grpc(keyed, key).values()) == {grpc.StatusCode.UNAUTHENTICATED}, key
    http = _http(keyed, API)
    assert all(http[path] == 200 for path in ("/infer", *READS)), http
    assert all(http[path] in (401, 403) for path in ADMIN_POSTS), http  # the inference key opens no admin route
    assert _grpc(keyed, API) == {"ModelInfer": grpc.StatusCode.OK, "RepositoryIndex": grpc.StatusCode.UNAUTHENTICATED}
    http = _http(keyed, ADMIN)  # the admin key opens everything
    assert all(http[path] == 200 for path in ("/infer", *READS, "/kernel-stats/reset")), http
    assert http["/v2/repository/index"] in (200, 501), http  # model control is one process only
    assert _grpc(keyed, ADMIN)["ModelInfer"] == grpc.StatusCode.OK


@pytest.mark.timeout(120)
def test_children_carry_no_key_on_their_command_line(keyed):
    pids = [keyed.proc.pid, *(pid for role in children(keyed.proc.pid).values() for pid in role)]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert API.encode() not in cmdline and ADMIN.encode() not in cmdline and MASK.encode() not in cmdline, cmdline
