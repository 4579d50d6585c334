"""bench/loadgen.py: splitting clients over processes, reading responses, merging results, and the
client itself against a small HTTP server in this process (and in worker processes)."""

import asyncio
import threading
import time

import numpy as np
import pytest

from bench.loadgen import LoadPool, Shard, drive, merge, parse_head, percentiles_ms, plan_shards, read_response, split


@pytest.mark.parametrize("total, parts", [(1, 1), (1, 4), (7, 3), (64, 8), (256, 6), (5, 5)])
def test_split_adds_up_and_differs_by_at_most_one(total, parts):
    counts = split(total, parts)
    assert sum(counts) == total and len(counts) == parts
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_shards_never_empty_and_share_the_request_cap_pro_rata():
    shards = plan_shards(80, "/infer", [b"{}"], clients=3, procs=8, start_at=1.0, duration_s=2.0, max_requests=10)
    assert [s.clients for s in shards] == [1, 1, 1]  # 3 clients: 3 processes, not 8
    assert all(s.max_requests == 4 for s in shards)  # ceil(10 / 3): the cap is never undershot
    shards = plan_shards(80, "/infer", [b"{}"], clients=64, procs=6, start_at=1.0, duration_s=2.0, max_requests=6400)
    assert sum(s.clients for s in shards) == 64 and len(shards) == 6
    assert sum(s.max_requests for s in shards) >= 6400


def test_parse_head_reads_status_length_chunked_and_close():
    assert parse_head(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n") == (200, 12, False)
    assert parse_head(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n") == (
        503, 0, True)
    assert parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") == (200, None, False)


async def test_read_response_consumes_exactly_one_response_of_either_framing():
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
                     b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                     b"3\r\nabc\r\n0\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert await read_response(reader) == (200, False)
    assert await read_response(reader) == (404, True)
    assert await read_response(reader) == (200, False)


def part(latencies_ms, statuses, errors=None, elapsed=1.0, cpu=0.1):
    return {"latencies": np.array(latencies_ms) / 1e3, "statuses": statuses, "errors": errors or {},
            "clients": 1, "elapsed_s": elapsed, "cpu_s": cpu}


def test_merge_takes_percentiles_over_every_latency_and_req_s_over_the_longest_process():
    # One process fast, one slow: percentiles of the merged list, not an average of each one's.
    fast = part([1.0] * 90, {200: 90, 503: 2}, elapsed=1.0)
    slow = part([100.0] * 10, {200: 10}, {"ConnectionResetError": 1}, elapsed=2.0)
    run = merge([fast, slow], duration_s=1.0)
    assert run["requests"] == 100 and run["rps"] == 50.0  # 100 answers over the last one's 2 s
    assert run["errors"] == 3 and run["statuses"] == {"200": 100, "503": 2}
    assert run["transport_errors"] == {"ConnectionResetError": 1}
    assert run["p50_ms"] == 1.0 and run["p99_ms"] == pytest.approx(100.0) and run["max_ms"] == 100.0
    assert run["p90_ms"] == pytest.approx(1.0 + 0.1 * 99.0)  # numpy's linear interpolation at rank 89.1
    assert run["processes"] == 2 and run["client_cpu_s"] == pytest.approx(0.2)


def test_merge_of_a_run_with_no_answer_reports_none_not_a_crash():
    run = merge([part([], {}, {"ConnectionRefusedError": 7}, elapsed=0.0)], duration_s=3.0)
    assert run["requests"] == 0 and run["rps"] == 0.0 and run["seconds"] == 3.0
    assert run["errors"] == 7 and run["p50_ms"] is None and run["p99_ms"] is None


def test_percentiles_of_one_to_a_hundred_ms():
    p = percentiles_ms(np.arange(1, 101) / 1e3)
    assert p["p50_ms"] == pytest.approx(50.5) and p["p99_ms"] == pytest.approx(99.01)
    assert p["mean_ms"] == pytest.approx(50.5) and p["max_ms"] == pytest.approx(100.0)


async def _serve(reader, writer, count):
    """A keep-alive HTTP/1.1 server: 200 with the body echoed; every 5th answer is 503 + close."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            count[0] += 1
            if count[0] % 5 == 0:
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


async def test_drive_counts_statuses_reconnects_after_close_and_stops_at_the_cap():
    count = [0]
    server = await asyncio.start_server(lambda r, w: _serve(r, w, count), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        shard = Shard(port, "/infer", (b'{"inputs": [[1]]}', b'{"inputs": [[2]]}'), clients=3,
                      start_at=time.monotonic() + 0.05, duration_s=10.0, max_requests=50)
        tally = await drive(shard)
    assert sum(tally.statuses.values()) == 50 == count[0]  # the cap ends the run long before 10 s
    assert tally.statuses[503] == 10 and tally.statuses[200] == 40 and len(tally.latencies) == 40
    assert not tally.errors


@pytest.fixture
def server_in_a_thread():
    """The same small server on its own event loop thread: reachable from worker processes."""
    loop, ready, count = asyncio.new_event_loop(), threading.Event(), [0]
    holder = {}

    async def start():
        holder["server"] = await asyncio.start_server(lambda r, w: _serve(r, w, count), "127.0.0.1", 0)
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)
    yield holder["server"].sockets[0].getsockname()[1], count
    loop.call_soon_threadsafe(holder["server"].close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_pool_splits_clients_over_processes_and_merges_their_answers(server_in_a_thread):
    port, count = server_in_a_thread
    with LoadPool(2) as pool:
        run = pool.run(port, "/infer", [b'{"inputs": [[1]]}'], clients=4, duration_s=0.5, max_requests=10**6)
    assert run["processes"] == 2
    assert run["requests"] + run["errors"] == count[0] > 0  # every request answered is counted once
    assert run["statuses"]["503"] == pytest.approx(count[0] / 5, abs=4)  # per connection: each 5th
    assert run["p50_ms"] > 0 and run["seconds"] >= 0.5
