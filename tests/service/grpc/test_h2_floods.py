"""HTTP/2 floods against a real server (``python -m fusedserve serve``, one process and ``--workers 2``,
on loopback): while
one raw-socket client sends PINGs, SETTINGS, empty DATA frames, CONTINUATIONs, calls to an unknown
method or empty ModelStreamInfer messages as fast as it can (reading its socket, or never reading
it), a good HTTP request is answered within a second, the server's RSS stays within 100 MiB of
where it was, and the flooding connection ends with GOAWAY or is closed. Calls the server serves
(ServerLive), sent as fast as it can, are no flood: that connection is only held to its share."""

import http.client
import itertools
import json
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import pytest
from hpack import Encoder

from ..conftest import Server, write_repository
from .test_h2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    request_block,
)

FLOOD_S = 2.0  # the most one flood lasts
GOOD_S = 1.0  # the slowest a good request may be answered during a flood
SHARE_S = 0.25  # ... beside a connection whose calls are served: one turn of the loop is a slice of its work
RSS_MIB = 100  # the most the server's RSS may grow during one
BODY = json.dumps({"model": "tiny", "inputs": [[0.5, -1.0, 2.0]]}).encode()
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"
# A client that never runs out of window for the server's answers (a well-behaved one grants as it reads).
OPEN_WINDOWS = (frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 2**31 - 1))
                + frame(WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65535).to_bytes(4, "big")))


@pytest.fixture(scope="module", params=["1", "2"], ids=["1 process", "--workers 2"])
def server(tmp_path_factory, request):
    s = Server(write_repository(tmp_path_factory.mktemp("repo")), tmp_path_factory.mktemp("log") / "server.log",
               "--workers", request.param)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def tree_rss_mib(pid: int) -> float:
    """RSS of ``pid`` and its children (under --workers N: the supervisor, engine and front ends)."""
    total = rss_mib(pid)
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                total += rss_mib(int(entry))
        except (OSError, AssertionError):  # gone meanwhile, or a zombie without VmRSS
            continue
    return total


def good_request(port: int) -> float:
    """Seconds one POST /infer took on a new connection (a failure counts as 10 s)."""
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/infer", BODY, {"content-type": "application/json"})
        ok = conn.getresponse().status == 200
        conn.close()
    except OSError:
        ok = False
    return time.perf_counter() - t0 if ok else 10.0


def wait_healthy(port: int, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while good_request(port) >= GOOD_S:
        assert time.monotonic() < end, f"the server did not answer POST /infer within {GOOD_S} s for {seconds} s"


def goaway_in(data: bytes) -> int | None:
    """The error code of the first GOAWAY in a run of frames (``data`` starts at a frame), or None."""
    pos = 0
    while len(data) - pos >= 9:
        length, kind = int.from_bytes(data[pos:pos + 3], "big"), data[pos + 3]
        if kind == GOAWAY and len(data) - pos >= 17:
            return struct.unpack_from(">I", data, pos + 13)[0]
        pos += 9 + length
    return None


@dataclass
class Outcome:
    sent: int = 0  # bytes the flood got into the socket
    received: bytearray = field(default_factory=bytearray)
    closed: bool = False  # the server closed (or reset) the connection
    stalled_s: float = 0.0  # seconds the socket took no bytes (the server stopped reading)


def _read_all(sock: socket.socket, outcome: Outcome, until: float) -> None:
    while time.monotonic() < until and not outcome.closed:
        if not select.select([sock], [], [], 0.05)[0]:
            continue
        try:
            chunk = sock.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            outcome.closed = True
        outcome.received += chunk


def flood(port: int, opening: bytes, chunks, reads: bool) -> Outcome:
    """Send ``opening`` then ``chunks`` (whole frames) as fast as the socket takes them for FLOOD_S,
    reading the socket all along if ``reads``; then read what the server says for up to 3 s."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setblocking(False)
    outcome, stop = Outcome(), time.monotonic() + FLOOD_S
    reader = threading.Thread(target=_read_all, args=(sock, outcome, stop)) if reads else None
    if reader:
        reader.start()
    data, last = memoryview(PREFACE + frame(SETTINGS, 0, 0) + opening), time.monotonic()
    while time.monotonic() < stop and not outcome.closed:
        if not data:
            data = memoryview(next(chunks))
        if not select.select([], [sock], [], 0.05)[1]:
            continue
        try:
            n = sock.send(data)
        except BlockingIOError:
            continue
        except OSError:
            outcome.closed = True
            break
        now = time.monotonic()
        outcome.stalled_s, last = max(outcome.stalled_s, now - last), now
        outcome.sent += n
        data = data[n:]
    if reader:
        reader.join()
    _read_all(sock, outcome, time.monotonic() + 3.0)
    sock.close()
    return outcome


def repeat(chunk: bytes):
    return itertools.repeat(chunk)


def new_streams(block: bytes, first: int = 3, body: bytes | None = None):
    """Runs of 1000 calls with header ``block``, each on the next new stream: HEADERS ending it, or
    HEADERS and ``body`` in a DATA frame ending it."""
    ids = itertools.count(first, 2)
    flags = END_HEADERS | (END_STREAM if body is None else 0)
    while True:
        yield b"".join(frame(HEADERS, flags, i, block) + (b"" if body is None else frame(DATA, END_STREAM, i, body))
                       for i in (next(ids) for _ in range(1000)))


def unknown_method():
    """A call to an unknown method whose ~4 kB path the first block indexes: then 4 bytes a call."""
    encoder = Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", "/" + "x" * 3900),
              ("content-type", "application/grpc")]
    first = encoder.encode(fields)
    return frame(HEADERS, END_HEADERS | END_STREAM, 1, first), new_streams(encoder.encode(fields))


FLOODS = {  # name -> () -> (opening frames, chunks)
    "PING": lambda: (b"", repeat(frame(PING, 0, 0, bytes(8)) * 4000)),
    "SETTINGS": lambda: (b"", repeat(frame(SETTINGS, 0, 0) * 7000)),
    "empty DATA": lambda: (frame(HEADERS, END_HEADERS, 1, request_block(INFER)), repeat(frame(DATA, 0, 1) * 7000)),
    "CONTINUATION": lambda: (frame(HEADERS, 0, 1, request_block(INFER)[:10]),
                             repeat(frame(CONTINUATION, 0, 1) * 7000)),
    "unknown method": unknown_method,
    "empty stream messages": lambda: (frame(HEADERS, END_HEADERS, 1, request_block(STREAM)),
                                      repeat(frame(DATA, 0, 1, bytes(5) * 3276) * 4)),
    "ServerLive calls": lambda: (OPEN_WINDOWS, new_streams(request_block(LIVE), 1, bytes(5))),
}
SERVED = {"ServerLive calls"}  # no flood: its connection may go on


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("reads", [True, False], ids=["reading", "never-reading"])
@pytest.mark.parametrize("kind", FLOODS)
def test_a_flood_leaves_others_served_and_ends_the_flooding_connection(server, kind, reads):
    wait_healthy(server.port)
    pid, before = server.proc.pid, tree_rss_mib(server.proc.pid)
    latencies, peak, done = [], [before], threading.Event()

    def watch():  # good requests and RSS samples, all through the flood
        while not done.is_set():
            latencies.append(good_request(server.port))
            peak.append(tree_rss_mib(pid))
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    opening, chunks = FLOODS[kind]()
    try:
        outcome = flood(server.grpc_port, opening, chunks, reads)
    finally:
        done.set()
        watcher.join()
    code = goaway_in(bytes(outcome.received))
    print(f"\nFLOOD {kind} ({'reading' if reads else 'never reading'}): good request max {max(latencies):.3f} s "
          f"over {len(latencies)}, RSS {before:.0f} -> peak {max(peak):.0f} MiB (+{max(peak) - before:.0f}), "
          f"sent {outcome.sent / 2**20:.1f} MiB, longest stall {outcome.stalled_s:.2f} s, "
          f"GOAWAY {code}, closed {outcome.closed}")
    bound = SHARE_S if kind in SERVED else GOOD_S
    assert max(latencies) < bound, f"a good request took {max(latencies):.2f} s during the {kind} flood"
    assert max(peak) - before < RSS_MIB, f"RSS grew {max(peak) - before:.0f} MiB during the {kind} flood"
    assert kind in SERVED or code is not None or outcome.closed, \
        f"the {kind} flood's connection neither got GOAWAY nor was closed"
