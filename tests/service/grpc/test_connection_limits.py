"""Issue 34, item 4, on a real server (``python -m fusedserve serve`` on loopback) whose open-file
limit is low: gRPC connections meet a handshake deadline, an idle timeout and a request-message
deadline, and draw on the process's descriptors only up to their share, so HTTP keeps answering
however many gRPC connections a client opens; each refusal kind is logged at most once a second.
And, against a stand-in connection, a message the server itself holds up is never timed out."""

import json
import resource
import selectors
import socket
import struct
import time
from collections import deque
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest

from fusedserve.service.grpc.policy import GrpcPolicy, Watch
from fusedserve.service.settings import Settings

from ..conftest import Server, write_repository
from .test_h2 import DATA, END_HEADERS, GOAWAY, HEADERS, PREFACE, RST_STREAM, SETTINGS, frame, request_block
from .test_h2_floods import rss_mib

INFER = "/inference.GRPCInferenceService/ModelInfer"
NO_ERROR, ENHANCE_YOUR_CALM = 0x0, 0xB
HELLO = PREFACE + frame(SETTINGS, 0, 0)  # a client's whole handshake
SHORT = ("--header-timeout-s", "1", "--body-timeout-s", "1", "--grpc-idle-timeout-s", "1")


@contextmanager
def open_file_limit(soft: int):
    """Processes started inside inherit a soft open-file limit of ``soft``; this one's is restored."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def descriptors_for(n: int) -> int:
    """Raise this process's soft open-file limit toward its hard one for ``n`` client sockets; how
    many it may open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256  # pytest, the server's log file, httpx
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return n if soft == resource.RLIM_INFINITY else min(n, soft - 256)


def start(tmp_path, soft: int, *flags: str) -> Server:
    with open_file_limit(soft):
        s = Server(write_repository(tmp_path / "repo"), tmp_path / "server.log", "--log-format", "json", *flags)
    s.wait_ready()
    return s


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The whole HTTP/2 frames in ``data``: (type, flags, stream, payload)."""
    out, i = [], 0
    while len(data) - i >= 9:
        n = int.from_bytes(data[i:i + 3], "big")
        if len(data) - i < 9 + n:
            break
        out.append((data[i + 3], data[i + 4], int.from_bytes(data[i + 5:i + 9], "big") & 0x7FFFFFFF,
                    data[i + 9:i + 9 + n]))
        i += 9 + n
    return out


def goaway(data: bytes) -> int | None:
    """The error code of the first GOAWAY in ``data``, if any."""
    return next((struct.unpack(">II", p[:8])[1] for kind, _, _, p in frames(data) if kind == GOAWAY), None)


def dial(port: int, n: int, first: bytes) -> list[socket.socket]:
    """``n`` connections to ``port``, each having sent ``first``."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(first)
        socks.append(sock)
    return socks


def until_closed(socks: list[socket.socket], seconds: float) -> tuple[dict, list]:
    """Read every socket until the server closes it or ``seconds`` pass: what each received, and
    those still open."""
    received = {sock: b"" for sock in socks}
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    end = time.monotonic() + seconds
    while selector.get_map() and time.monotonic() < end:
        for key, _ in selector.select(timeout=0.1):
            try:
                chunk = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                chunk = b""
            received[key.fileobj] += chunk
            if not chunk:
                selector.unregister(key.fileobj)
    left = [key.fileobj for key in selector.get_map().values()]
    selector.close()
    return received, left


def close_all(socks) -> None:
    for sock in socks:
        sock.close()


def http_ok(server) -> bool:
    return httpx.get(server.url + "/v2/health/live", timeout=2).status_code == 200


def warnings(server, words: str) -> list[str]:
    lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
    return [e["message"] for e in lines if e["level"] == "warning" and words in e["message"]]


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A server whose gRPC timeouts are all 1 s, under an open-file limit of 1024."""
    s = start(tmp_path_factory.mktemp("short"), 1024, *SHORT)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.timeout(60)
def test_thousands_of_idle_grpc_connections_are_closed_and_http_keeps_accepting(short):
    n = descriptors_for(3000)
    socks = dial(short.grpc_port, n, HELLO)
    try:
        assert http_ok(short), "HTTP refused while gRPC connections pile up"
        received, left = until_closed(socks, 8.0)
        assert not left, f"{len(left)} of {n} idle gRPC connections still open after 8 s"
        codes = [goaway(data) for data in received.values()]
        idle, refused = codes.count(NO_ERROR), codes.count(ENHANCE_YOUR_CALM)
        # Each ended with a GOAWAY saying why: idle (NO_ERROR) or over gRPC's share (ENHANCE_YOUR_CALM).
        assert idle + refused == n and idle >= 500, (idle, refused, n)
        assert http_ok(short)
    finally:
        close_all(socks)


@pytest.mark.timeout(30)
def test_half_sent_prefaces_are_closed_by_the_handshake_deadline(short):
    half = dial(short.grpc_port, 20, PREFACE[:12]) + dial(short.grpc_port, 20, PREFACE + frame(SETTINGS, 0, 0)[:5])
    silent = dial(short.grpc_port, 20, b"")
    t0 = time.monotonic()
    try:
        received, left = until_closed(half + silent, 5.0)
        assert not left and time.monotonic() - t0 < 3.0, (len(left), time.monotonic() - t0)
        assert not any(goaway(data) == NO_ERROR for data in received.values()), "closed as idle, not as unfinished"
        assert warnings(short, "no HTTP/2 preface and SETTINGS within 1 s")
    finally:
        close_all(half + silent)


@pytest.mark.timeout(30)
def test_an_unfinished_large_message_is_answered_deadline_exceeded_and_freed(short):
    held = 3 * 4 * 2**20  # 4 MiB on each of 3 streams per connection: within one connection's window
    socks = dial(short.grpc_port, 4, HELLO)
    try:
        rss = rss_mib(short.proc.pid)
        for sock in socks:
            for stream in (1, 3, 5):  # a message that says 8 MiB, of which 4 MiB come, in 16 KiB frames
                sock.sendall(frame(HEADERS, END_HEADERS, stream, request_block(INFER)))
                body = (8 * 2**20).to_bytes(5, "big") + bytes(held // 3 - 5)
                sock.sendall(b"".join(frame(DATA, 0, stream, body[i:i + 16384]) for i in range(0, len(body), 16384)))
        time.sleep(0.3)
        grown = rss_mib(short.proc.pid) - rss
        received, _ = until_closed(socks, 5.0)
        after = rss_mib(short.proc.pid) - rss
        for data in received.values():
            ends = [(kind, stream) for kind, _, stream, _ in frames(data) if kind in (HEADERS, RST_STREAM)]
            assert ends == [(HEADERS, 1), (RST_STREAM, 1), (HEADERS, 3), (RST_STREAM, 3), (HEADERS, 5),
                            (RST_STREAM, 5)], ends
            assert data.count(b"grpc-status\x014") == 3 and b"not received within 1 s" in data
        assert grown > 30 and after < grown / 2, f"RSS grew {grown:.0f} MiB while held, {after:.0f} MiB after"
    finally:
        close_all(socks)


@pytest.mark.timeout(90)
def test_grpc_is_refused_its_descriptors_before_http_starves(tmp_path):
    # Under 256 descriptors, gRPC's share ends at 128 (HTTP's at 192): the rest answer HTTP.
    s = start(tmp_path, 256)
    socks: list[socket.socket] = []
    try:
        socks = dial(s.grpc_port, 300, HELLO)
        received, left = until_closed(socks, 1.0)
        refused = [data for data in received.values() if goaway(data) == ENHANCE_YOUR_CALM]
        assert len(left) > 50 and len(refused) == 300 - len(left), (len(left), len(refused))
        assert b"open-file limit (256)" in refused[0]
        # 100 HTTP connections at once beside every gRPC one admitted: those on descriptors below
        # HTTP's ceiling are answered, the rest refused with a 503, never left unaccepted.
        http = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(100)]
        time.sleep(0.3)  # every one accepted before any is answered (and closed)
        for sock in http:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        statuses = [sock.recv(100)[:12] for sock in http]
        close_all(http)
        ok, full = statuses.count(b"HTTP/1.1 200"), statuses.count(b"HTTP/1.1 503")
        assert ok >= 50 and ok + full == 100, statuses
        assert http_ok(s)
        for share in ("gRPC's share of the open-file limit (256) is in use", "HTTP's share of the open-file limit"):
            logged = warnings(s, share)
            assert 1 <= len(logged) <= 2, logged  # one burst of refusals: one warning, or two across a second
    finally:
        close_all(socks)
        s.stop()


class StalledConnection:
    """What GrpcPolicy reads of a service.grpc.h2.Connection: one streaming call holding half a message,
    whose client may send ``window`` more bytes; ``reading``: whether the server reads the connection."""

    def __init__(self, window: int, reading: bool):
        half = b"\x00" + (100).to_bytes(4, "big") + b"x" * 50
        self.stream = SimpleNamespace(id=1, body=bytearray(half), inbox=deque(), remote_closed=False, task=None,
                                      recv_window=window)
        self.streams, self.last_id, self.goaway_id, self.failed = {1: self.stream}, 1, None, False
        self.reading, self.recv_window = reading, 1 << 24
        self.watch = Watch(0.0)
        self.watch.greeted = True
        self.transport = SimpleNamespace(get_extra_info=lambda name: ("127.0.0.1", 1))
        self.answered: list[str] = []

    def finish(self, stream, code: str, message: str) -> None:
        self.answered.append(code)
        del self.streams[stream.id]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("window", "reading", "late"), [(1000, True, True), (0, True, False), (1000, False, False)],
                         ids=["the client is slow", "its window is spent", "the server reads nothing"])
def test_a_message_the_server_holds_up_is_not_timed_out(window, reading, late):
    connection = StalledConnection(window, reading)
    policy = GrpcPolicy(Settings(body_timeout_s=1.0), {connection})
    for now in (0.0, 0.5, 1.0, 1.5, 2.0):
        policy.sweep(now)
    assert connection.answered == (["DEADLINE_EXCEEDED"] if late else []), connection.answered
