"""Issue 25, security: API keys (probes open, admin routes apart), /docs off, Content-Type on
inference routes, allowed hosts, and error bodies without the server's paths; on the hot path, on
the framework's routes and on gRPC."""

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb

from fusedserve.service.app import create_app
from fusedserve.service.settings import Settings

from .conftest import _close, _serve, wait_ready
from .grpc.test_grpc import ROWS, raw_request

INFER = ("/infer", {"model": "tiny", "inputs": [[1.0, 2.0, 3.0]]})
V2 = ("/v2/models/tiny/infer", {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})


@pytest.fixture
def app_client(settings):
    """An in-memory client for an app built with extra settings: ``async with app_client(**extra) as c``."""

    class Served:
        def __init__(self, **extra):
            self.app = create_app(settings.model_copy(update=extra))

        async def __aenter__(self):
            self._life = self.app.router.lifespan_context(self.app)
            await self._life.__aenter__()
            self.c = httpx.AsyncClient(transport=httpx.ASGITransport(self.app), base_url="http://localhost")
            await wait_ready(self.c)
            return self

        async def __aexit__(self, *exc):
            await self.c.aclose()
            await self._life.__aexit__(*exc)

        async def post(self, path, body, hot=True, **kwargs):
            served = self.app.hot_path
            if not hot:
                async def declined(scope, receive, send):
                    return False
                self.app.hot_path = declined
            try:
                return await self.c.post(path, json=body, **kwargs)
            finally:
                self.app.hot_path = served

    return Served


@pytest.mark.parametrize("hot", [True, False], ids=["hot path", "framework"])
async def test_an_api_key_guards_every_route_but_the_probes(app_client, hot):
    async with app_client(api_key="s3cret") as s:
        for path, body in (INFER, V2):
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = await s.post(path, body, hot=hot, headers=auth)
                assert r.status_code == 401 and "Bearer" in r.json()["error"], (path, auth, r.text)
                assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]
            r = await s.post(path, body, hot=hot, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, r.text
        for path in ("/metrics", "/kernel-stats", "/v2/models/tiny", "/docs", "/openapi.json"):
            assert (await s.c.get(path)).status_code == 401, path
            assert (await s.c.get(path, headers={"Authorization": "Bearer s3cret"})).status_code == 200, path
        for path in ("/v2/health/live", "/v2/health/ready", "/healthz", "/readyz"):
            assert (await s.c.get(path)).status_code == 200, path


async def test_an_admin_key_guards_admin_routes_even_when_inference_is_open(app_client):
    async with app_client(admin_api_key="root", api_key=None) as s:
        assert (await s.post(*INFER)).status_code == 200
        assert (await s.c.post("/kernel-stats/reset")).status_code == 401
        assert (await s.c.post("/kernel-stats/reset", headers={"Authorization": "Bearer root"})).status_code == 200
        assert (await s.c.post("/v2/repository/index")).status_code == 401, "model control is admin"
        assert (await s.c.post("/v2/repository/index", headers={"Authorization": "Bearer root"})).status_code == 200
    async with app_client(admin_api_key="root", api_key="user") as s:
        user, root = {"Authorization": "Bearer user"}, {"Authorization": "Bearer root"}
        assert (await s.c.post("/kernel-stats/reset", headers=user)).status_code == 401, "a user key is not admin"
        assert (await s.c.post("/kernel-stats/reset", headers=root)).status_code == 200
        assert (await s.post(*INFER, headers=root)).status_code == 200, "the admin key opens the rest too"


async def test_docs_can_be_turned_off(app_client):
    async with app_client(docs=False) as s:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await s.c.get(path)).status_code == 404, path


@pytest.mark.parametrize("hot", [True, False], ids=["hot path", "framework"])
async def test_inference_refuses_bodies_a_browser_form_can_send(app_client, hot):
    async with app_client() as s:
        for path, body in (INFER, V2):
            for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                r = await s.post(path, body, hot=hot, headers={"Content-Type": kind})
                assert r.status_code == 415 and "application/json" in r.json()["error"], (path, kind, r.text)
            r = await s.post(path, body, hot=hot, headers={"Content-Type": "application/json; charset=utf-8"})
            assert r.status_code == 200, r.text
        # No Content-Type at all is what tritonclient.http sends.
        r = await s.c.post(V2[0], content=httpx.Request("POST", "/", json=V2[1]).content)
        assert r.status_code == 200, r.text


async def test_allowed_hosts_refuse_other_host_names(app_client):
    async with app_client(allowed_hosts="localhost, *.example.com") as s:
        for host in ("localhost", "localhost:8000", "api.example.com:80"):
            assert (await s.post(*INFER, headers={"Host": host})).status_code == 200, host
        for host in ("evil.test", "example.com.evil.test", "127.0.0.1:8000"):
            r = await s.post(*INFER, headers={"Host": host})
            assert r.status_code == 400 and "Host" in r.json()["error"], host
            assert (await s.c.get("/metrics", headers={"Host": host})).status_code == 400, host
        assert (await s.c.get("/v2/health/ready", headers={"Host": "10.0.0.7:8000"})).status_code == 200, \
            "probes come from the kubelet by address"


UNLOAD = "/v2/repository/models/tiny/unload"


async def test_a_default_server_refuses_cross_site_model_control(app_client):
    async with app_client() as s:  # no keys, listening on loopback: what `fusedserve serve` starts
        page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}  # a form's "simple" POST
        for headers in (page, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"},
                        {"Origin": "http://localhost:9999"}):  # another port is another origin
            r = await s.c.post(UNLOAD, headers=headers)
            assert r.status_code == 403 and "another site" in r.json()["error"], (headers, r.text)
            assert (await s.post(*INFER)).status_code == 200, "the model must still be served"
        r = await s.c.post("/kernel-stats/reset", headers=page)
        assert r.status_code == 403, r.text
        # The live page's own reset (same origin), and clients that send no Origin (curl, tritonclient).
        same = {"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"}
        assert (await s.c.post("/kernel-stats/reset", headers=same)).status_code == 200
        assert (await s.c.post(UNLOAD)).status_code == 200


async def test_a_loopback_server_refuses_names_dns_could_rebind(app_client):
    async with app_client() as s:
        rebound = {"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}  # same origin, to the browser
        for path in ("/kernel-stats", "/metrics", "/dashboard"):
            r = await s.c.get(path, headers=rebound)
            assert r.status_code == 400 and "FUSEDSERVE_ALLOWED_HOSTS" in r.json()["error"], (path, r.text)
        assert (await s.post(*INFER, headers=rebound)).status_code == 400
        assert (await s.c.post(UNLOAD, headers=rebound)).status_code == 400
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000"):
            assert (await s.post(*INFER, headers={"Host": host})).status_code == 200, host
    async with app_client(allowed_hosts="*") as s:  # any name for inference, as on 0.0.0.0 by default
        assert (await s.post(*INFER, headers=rebound)).status_code == 200
        r = await s.c.post(UNLOAD, headers=rebound)
        assert r.status_code == 403 and "localhost or an IP" in r.json()["error"], r.text


async def test_the_inference_key_never_opens_admin_routes(app_client):
    async with app_client(api_key="user") as s:
        user = {"Authorization": "Bearer user"}
        assert (await s.post(*INFER, headers=user)).status_code == 200
        for path in ("/kernel-stats/reset", "/v2/repository/index", UNLOAD):
            r = await s.c.post(path, headers=user)
            assert r.status_code == 403 and "FUSEDSERVE_ADMIN_API_KEY" in r.json()["error"], (path, r.text)
        assert (await s.post(*INFER, headers=user)).status_code == 200, "the model must still be served"


async def test_grpc_repository_calls_refuse_the_inference_key(settings):
    served = await _serve(settings.model_copy(update={"api_key": "user"}))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=(("authorization", "Bearer user"),))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
        assert "FUSEDSERVE_ADMIN_API_KEY" in caught.value.details()
    finally:
        await _close(served)


async def test_error_bodies_carry_no_server_paths(app_client, repository):
    async with app_client() as s:
        runner = s.app.state.service.runners["tiny"]

        def broken(x):
            raise OSError(f"cannot open {repository}/tiny/kernels/cache.bin")

        runner.run = broken
        r = await s.post(*INFER)
        assert r.status_code == 500 and "cache.bin" in r.json()["error"], r.text
        assert str(repository) not in r.text and "/tiny/kernels" not in r.text, r.text


async def test_grpc_needs_the_key_too(settings):
    served = await _serve(settings.model_copy(update={"api_key": "s3cret"}))
    try:
        assert (await served.stub.ServerLive(pb.ServerLiveRequest())).live
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.ModelInfer(raw_request(ROWS))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
        ok = await served.stub.ModelInfer(raw_request(ROWS), metadata=(("authorization", "Bearer s3cret"),))
        assert ok.model_name == "tiny"
    finally:
        await _close(served)


def test_keys_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEDSERVE_API_KEY", "from-env")
    settings = Settings()
    assert settings.api_key.get_secret_value() == "from-env" and "from-env" not in repr(settings)


async def test_grpc_repository_calls_need_the_admin_key(settings):
    served = await _serve(settings.model_copy(update={"admin_api_key": "root"}))
    try:
        await served.stub.ModelInfer(raw_request(ROWS))  # inference stays open
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
        index = await served.stub.RepositoryIndex(pb.RepositoryIndexRequest(),
                                                  metadata=(("authorization", "Bearer root"),))
        assert [m.name for m in index.models] == ["tiny", "wide"]
    finally:
        await _close(served)
