"""tools/dashboard_shot.py capture: the page's two JSON routes kept as a line of dashboard.jsonl, or as
one JSON file (the browser half is tests/service/dashboard/test_dashboard_browser.py's)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.runs import pick, read
from tools.dashboard_shot import capture

ROUTES = {"/model-stats": {"models": {"digits": {"in_features": 64}}}, "/kernel-stats": {"served": {}}}


class Routes(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps(ROUTES[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_capture_is_a_line_of_dashboard_jsonl_or_a_json_file(url, tmp_path):
    capture(url, tmp_path)
    capture(url, tmp_path)
    lines = read(tmp_path / "dashboard.jsonl")
    assert len(lines) == 2 and lines[1]["benchmark"] == "dashboard" and lines[1]["url"] == url
    assert lines[1]["model_stats"] == ROUTES["/model-stats"] and lines[1]["kernel_stats"] == ROUTES["/kernel-stats"]
    assert pick(f"{tmp_path}/dashboard.jsonl:1")["captured_utc"] == lines[0]["captured_utc"]
    data = capture(url, tmp_path / "one.json")
    assert json.loads((tmp_path / "one.json").read_text()) == data and "benchmark" not in data
