"""Issue 25, defects 1, 3 and 8, and issue 34, item 6, on a real server (``python -m fusedserve serve``
on loopback): an oversized header is refused at once without stalling others (and a legal head whose
blank line spans two reads is not), slow heads and bodies meet deadlines, silent connections are
closed, the connection cap answers 503 and logs it, a slow client cannot hold shutdown, a client
that leaves before its answer is logged as such, and requests pipelined before bad bytes are
answered before the 400."""

import json
import resource
import signal
import socket
import threading
import time

import httpx
import pytest

from ..conftest import Server, write_repository

BODY = json.dumps({"model": "tiny", "inputs": [[0.5, -1.0, 2.0]]}).encode()
HEAD = (b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY))
LIMITS = ("--max-header-bytes", "8192", "--header-timeout-s", "1", "--body-timeout-s", "1", "--log-format", "json")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(write_repository(tmp_path_factory.mktemp("repo")), tmp_path_factory.mktemp("log") / "server.log",
               *LIMITS)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one answer on ``sock``, read until the server closes it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def logged(server, **fields) -> list[dict]:
    lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
    return [e for e in lines if all(e.get(k) == v for k, v in fields.items())]


def test_an_oversized_header_is_431_at_once_and_others_are_served(server):
    sock, refused = connect(server), {}

    def flood():  # 4 MiB of one header value, in 64 KiB writes, as fast as the server takes them
        t0 = time.perf_counter()
        try:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            for _ in range(64):
                sock.sendall(b"a" * 65536)
        except OSError:  # the server answered and stopped reading: expected
            pass
        refused["status"], refused["body"] = answer(sock)
        refused["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=flood)
    thread.start()
    for _ in range(5):
        r = httpx.post(server.url + "/infer", content=BODY, headers={"content-type": "application/json"}, timeout=2)
        assert r.status_code == 200, r.text
    thread.join(timeout=10)
    assert refused["status"] == 431 and "8192 bytes" in refused["body"]["error"], refused
    assert refused["seconds"] < 2.0, refused
    assert logged(server, level="warning") and any("431" in e["message"] for e in logged(server, level="warning"))


def test_a_slow_body_gets_408(server):
    sock = connect(server)
    sock.sendall(HEAD[:-2] + b"X-Request-ID: slow-body-1\r\n\r\n")
    t0 = time.perf_counter()
    try:
        for byte in BODY[:-1]:  # one byte every 0.2 s: the whole body would take ~12 s
            sock.sendall(bytes([byte]))
            time.sleep(0.2)
            if time.perf_counter() - t0 > 3:
                break
    except OSError:
        pass
    status, body = answer(sock)
    assert status == 408 and "body not received within 1 s" in body["error"], body
    assert time.perf_counter() - t0 < 3.0
    end = time.monotonic() + 5
    while not (entries := logged(server, request_id="slow-body-1")) and time.monotonic() < end:
        time.sleep(0.05)
    assert entries and entries[0]["status"] == 408, entries  # what the client got, not the app's 499


def test_a_slow_head_gets_408_and_a_silent_connection_is_closed(server):
    silent, slow = connect(server), connect(server)
    slow.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    t0 = time.perf_counter()
    try:
        for i in range(15):
            slow.sendall(b"X-%d: y\r\n" % i)
            time.sleep(0.2)
    except OSError:
        pass
    status, body = answer(slow)
    assert status == 408 and "head not received within 1 s" in body["error"], body
    assert silent.recv(1) == b"", "a connection that never sent a byte was kept open"
    assert time.perf_counter() - t0 < 3.0


def test_the_connection_cap_answers_503_and_logs_it(tmp_path):
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--max-connections", "4",
               "--log-format", "json")
    try:
        s.wait_ready()  # its probe connections are closed by now (Connection: close from httpx.get)
        time.sleep(0.2)
        held = [connect(s) for _ in range(4)]
        extra = connect(s)
        extra.sendall(HEAD + BODY)
        status, body = answer(extra)
        assert status == 503 and "connection limit" in body["error"], body
        for sock in held[:2]:
            sock.close()
        time.sleep(0.2)
        sock = connect(s)
        sock.sendall(HEAD[:-2] + b"Connection: close\r\n\r\n" + BODY)
        assert answer(sock)[0] == 200, "a connection freed below the cap is served again"
        assert any("connection limit of 4" in e["message"] for e in logged(s, level="warning"))
    finally:
        s.stop()


def test_a_slow_client_cannot_hold_shutdown(tmp_path):
    s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--body-timeout-s", "60",
               "--drain-grace-s", "0.5", "--shutdown-timeout-s", "1")
    try:
        s.wait_ready()
        sock = connect(s)
        sock.sendall(HEAD + BODY[:5])  # a body that never ends, at no deadline within the test
        time.sleep(0.2)
        t0 = time.perf_counter()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=10)
        assert time.perf_counter() - t0 < 4.0, "grace 0.5 s + shutdown 1 s, plus the lifespan's stop"
    finally:
        s.stop()


@pytest.mark.parametrize("request_bytes", [b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n", HEAD[:-2]],
                         ids=["framework route", "hot path"])
def test_the_access_log_says_whether_a_half_closed_client_got_its_answer(server, request_bytes):
    # uvicorn takes a half-close as the client leaving: whatever the client then receives, the
    # access log must say the same (not 200 for an answer that never went out).
    rid = f"half-closed-{len(request_bytes)}"
    sock = connect(server)
    sock.sendall(request_bytes + b"X-Request-ID: " + rid.encode() + b"\r\n\r\n"
                 + (BODY if request_bytes.startswith(b"POST") else b""))
    sock.shutdown(socket.SHUT_WR)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    end = time.monotonic() + 5
    while not (entries := logged(server, request_id=rid)) and time.monotonic() < end:
        time.sleep(0.05)
    assert len(entries) == 1, entries
    if received:
        assert entries[0]["status"] == int(received.split(b" ", 2)[1]), (entries[0], received[:100])
    else:
        assert entries[0]["status"] == 499, entries[0]  # (the hot path may see the client leave itself)


def test_the_default_connection_cap_stays_under_the_open_file_limit(monkeypatch):
    # With the cap above the fd limit, accept() fails for lack of descriptors and clients are
    # refused with no answer and no log line; under it, they get a 503 and the log says so.
    from fusedserve.service import connections

    for soft, cap in ((1024, 960), (100_000, 4096), (resource.RLIM_INFINITY, 4096), (32, 1)):
        monkeypatch.setattr(connections.resource, "getrlimit", lambda _, soft=soft: (soft, soft))
        assert connections.default_max_connections() == cap, soft


def test_a_body_left_unfinished_after_its_answer_is_closed_without_a_second_answer(server):
    # The app answers 413 as soon as a body passes the cap; the client then stops sending. The
    # body deadline must close the connection, not write a 408 the client would take as the
    # answer to its next request.
    sock = connect(server)
    sock.sendall(b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 99999999\r\n\r\n" + b"[" * 4096)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    assert data.startswith(b"HTTP/1.1 413") and data.count(b"HTTP/1.1") == 1, data[:300]


def test_bytes_that_are_not_http_get_a_json_400(server):
    sock = connect(server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: nope\r\n\r\n")
    status, body = answer(sock)
    assert status == 400 and "not valid HTTP/1.1" in body["error"], body


@pytest.mark.timeout(30)
@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_head_whose_blank_line_spans_two_reads_is_served_not_431(server, split):
    # A body past the head cap (8192 here), in the same read as the head's last byte(s).
    body = BODY + b" " * 40_000  # JSON may end in whitespace
    head = HEAD.replace(b"%d" % len(BODY), b"%d" % len(body))
    sock = connect(server)
    sock.sendall(head[:-split])
    time.sleep(0.2)  # a read of its own on the server
    sock.sendall(head[-split:] + body)
    sock.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:300]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("good", [b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", HEAD + BODY],
                         ids=["framework route", "hot path"])
def test_a_request_pipelined_before_bad_bytes_is_answered_then_the_400(server, good):
    seen = len(server.log.read_text())
    sock = connect(server)
    sock.sendall(good + b"NOT HTTP\x01\r\n\r\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    assert data.startswith(b"HTTP/1.1 200") and data.count(b"HTTP/1.1 ") == 2, data
    second = data[data.index(b"HTTP/1.1 ", 1):]
    assert second.startswith(b"HTTP/1.1 400") and b"not valid HTTP/1.1" in second, data
    time.sleep(0.2)  # the log line of an error after the answer, if any
    logged = server.log.read_text()[seen:]
    assert "Traceback" not in logged and "RuntimeError" not in logged, logged
