"""deploy/healthcheck.py, the image's HEALTHCHECK: it must ask where the server really listens."""

import importlib.util
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from fusedserve.service.settings import Settings

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"
_spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
healthcheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(healthcheck)


@pytest.mark.parametrize("env, host", [
    ({"FUSEDSERVE_HOST": "0.0.0.0"}, "127.0.0.1"),
    ({"FUSEDSERVE_HOST": "::"}, "[::1]"),
    ({"FUSEDSERVE_HOST": "10.1.2.3"}, "10.1.2.3"),
    ({"FUSEDSERVE_HOST": "fd00::7"}, "[fd00::7]"),
])
def test_ready_url_follows_the_configured_host(env, host):
    port = Settings.model_fields["port"].default
    assert healthcheck.ready_url(env) == f"http://{host}:{port}/v2/health/ready"


def test_ready_url_follows_the_configured_port_and_defaults():
    settings = Settings(model_repository=".")  # a repository given: no need to import torch
    assert healthcheck.ready_url({}) == f"http://{settings.host}:{settings.port}/v2/health/ready"
    assert healthcheck.ready_url({"FUSEDSERVE_PORT": "9123"}).endswith(":9123/v2/health/ready")


class _Probe(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, code", [(200, 0), (503, 1)])
def test_exit_code_is_readiness(monkeypatch, status, code):
    handler = type("Handler", (_Probe,), {"status": status})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("FUSEDSERVE_HOST", "127.0.0.1")
        monkeypatch.setenv("FUSEDSERVE_PORT", str(server.server_port))
        assert healthcheck.main() == code
    finally:
        server.shutdown()
        server.server_close()


def test_nothing_listening_is_unhealthy(monkeypatch, capsys):
    with HTTPServer(("127.0.0.1", 0), _Probe) as closed:
        port = closed.server_port  # bound, then closed on leaving: nothing listens there
    monkeypatch.setenv("FUSEDSERVE_HOST", "127.0.0.1")
    monkeypatch.setenv("FUSEDSERVE_PORT", str(port))
    assert healthcheck.main() == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err
