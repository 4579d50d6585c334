"""SIGTERM under load on a real server: every request written to an accepted connection is answered.

32 clients keep one keep-alive connection each and send with a short think time between requests,
so at any moment many connections are idle. Plain uvicorn closes idle connections at once on
SIGTERM, and the request a client sends a few ms later meets a reset (this test fails that way
with ``--drain-grace-s 0``). With a grace period the server keeps answering, each answer now with
``Connection: close``, and a client that sees it stops using the connection, as a real client would
before reconnecting elsewhere. Nothing may be lost: no reset, no request left without a response.
"""

import asyncio
import json
import signal
import time

import pytest

from .conftest import Server, write_repository

CLIENTS = 32
LOAD_BEFORE_S = 0.5  # load before SIGTERM
DEADLINE_S = 20.0  # the whole test's bound
THINK_S = 0.01  # between a response and the next request on the same connection


async def client(port: int, body: bytes, stop_at: float, record: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (f"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        while time.monotonic() < stop_at:
            writer.write(request)
            await writer.drain()
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower().split("\r\n")
            status = int(head[0].split(" ", 2)[1])
            fields = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
            payload = await reader.readexactly(int(fields["content-length"]))
            record.append((status, fields.get("connection"), payload))
            if fields.get("connection") == "close":
                return
            await asyncio.sleep(THINK_S)
    finally:
        writer.close()


async def load_then_sigterm(server: Server, body: bytes, record: list) -> None:
    stop_at = time.monotonic() + DEADLINE_S
    tasks = [asyncio.create_task(client(server.port, body, stop_at, record)) for _ in range(CLIENTS)]
    await asyncio.sleep(LOAD_BEFORE_S)
    server.proc.send_signal(signal.SIGTERM)
    # Any exception (a reset, a truncated response) fails the test here.
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=DEADLINE_S)


# --workers 2: the supervisor passes SIGTERM to every front end; the engine stops after they drained.
@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_under_load_loses_no_request(tmp_path, workers):
    repo = write_repository(tmp_path / "repo")
    server = Server(repo, tmp_path / "server.log", "--drain-grace-s", "1.0", "--max-batch-size", "16",
                    "--workers", workers)
    try:
        server.wait_ready()
        body = json.dumps({"model": "tiny", "inputs": [[0.5, -1.0, 2.0]]}).encode()
        record: list = []
        asyncio.run(load_then_sigterm(server, body, record))
        statuses = [status for status, _, _ in record]
        assert statuses and set(statuses) == {200}, f"non-200 answers: {sorted(set(statuses))}"
        closes = sum(conn == "close" for _, conn, _ in record)
        # Every client ended on a Connection: close answer, not on an error or the deadline.
        assert closes == CLIENTS, f"{closes} of {CLIENTS} clients were told to close"
        assert all(len(json.loads(p)["outputs"]) == 1 for _, _, p in record)
        server.proc.wait(timeout=15)
        assert server.proc.returncode in (0, -signal.SIGTERM), server.log.read_text()[-2000:]
        assert len(record) > CLIENTS * 2, f"only {len(record)} requests: the load never built up"
    finally:
        server.stop()
