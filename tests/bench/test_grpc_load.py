"""bench/grpc_load.py: the requests it sends are ones the service accepts, its summary's ratios, and its
raw-socket HTTP/2 gRPC client (bench/h2_client.py) (framing on hand-built bytes, and calls against the
bare grpc.aio server)."""

import asyncio
import json
import struct
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import hpack
import pytest
from tritonclient.grpc import service_pb2 as pb

from bench.grpc_load import CannedProcess, drive_raw, drive_spread, grpc_requests, http_requests, rows, summarize
from bench.h2_client import H2Connection, request_block
from fusedserve.service.engine.state import ModelInfo
from fusedserve.service.grpc import codec as grpc_codec
from fusedserve.service.grpc.calls import length_prefixed
from fusedserve.service.grpc.h2_wire import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    PING,
    SETTINGS,
    WINDOW_UPDATE,
    changes_table,
    frame,
    hpack_int,
)

DIGITS = ModelInfo("digits", 64, 10, "float32", "torch", "cpu")


def test_requests_carry_one_row_each_as_the_service_decodes_it():
    x = rows(3)
    for i, wire in enumerate(grpc_requests(x)):
        got, raw = grpc_codec.decode(pb.ModelInferRequest.FromString(wire), DIGITS, 64)
        assert raw and got.tolist() == x[i:i + 1].tolist()
    v2, infer = http_requests(8000, x, "http_v2")[1], http_requests(8000, x, "http_infer")[1]
    head, body = v2.split(b"\r\n\r\n", 1)
    n = int(next(line.split(b": ")[1] for line in head.split(b"\r\n") if line.startswith(b"Inference-Header")))
    assert body[n:] == x[1].tobytes() and json.loads(body[:n])["inputs"][0]["shape"] == [1, 64]
    assert json.loads(infer.split(b"\r\n\r\n", 1)[1])["inputs"] == [x[1].tolist()]


def test_summary_takes_medians_and_ratios_per_client_count():
    def run(mode, clients, rps, cpu):
        return {"mode": mode, "clients": clients, "rps": rps, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0,
                "server_cpu_ms_per_request": cpu, "client_cpu_ms_per_request": 0.1, "mean_batch_rows": 1.0}

    results = [run("grpc", 64, r, 0.3) for r in (1000, 1300, 1200)] + \
              [run("http_v2", 64, r, 0.2) for r in (1000, 900, 1100)] + [run("http_infer", 64, 1000, 0.25)]
    (row,) = summarize(results, target=1.2)
    assert row["grpc"]["rps"] == 1200 and row["http_v2"]["rps"] == 1000
    assert row["grpc_over_http_v2"] == {"rps": 1.2, "met": True, "server_cpu_per_request": 1.5}
    assert row["grpc_over_http_infer"]["met"] is True and "grpc_shared_over_http_v2" not in row


def test_summary_reports_the_raw_clients_ratios_too():
    def run(mode, rps):
        return {"mode": mode, "clients": 1, "rps": rps, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0,
                "server_cpu_ms_per_request": 0.2, "client_cpu_ms_per_request": 0.1, "mean_batch_rows": 1.0}

    (row,) = summarize([run("grpc_raw", 1500), run("grpc_raw_stream", 600), run("http_v2", 1000)], target=1.2)
    assert row["grpc_raw_over_http_v2"] == {"rps": 1.5, "met": True, "server_cpu_per_request": 1.0}
    assert row["grpc_raw_stream_over_http_v2"]["met"] is False and "grpc_raw_over_http_infer" not in row


def test_the_request_block_is_the_same_valid_bytes_on_every_stream():
    block, decoder = request_block(8001, "/inference.GRPCInferenceService/ModelInfer"), hpack.Decoder()
    first, again = decoder.decode(block), decoder.decode(block)
    assert first == again and not decoder.header_table.dynamic_entries  # nothing indexed
    assert dict(first) == {":method": "POST", ":scheme": "http", ":path": "/inference.GRPCInferenceService/ModelInfer",
                           ":authority": "127.0.0.1:8001", "content-type": "application/grpc", "te": "trailers"}



def test_hpack_blocks_that_change_the_table_are_told_from_those_that_do_not():
    assert hpack_int(bytes([0b11111, 0b10011010, 0b00001010]), 0, 5) == (1337, 3)  # RFC 7541 C.1.2
    encoder = hpack.Encoder()
    headers = [(":status", "200"), ("content-type", "application/grpc"), ("x-long", "v" * 300)]
    assert changes_table(encoder.encode(headers))  # literals with incremental indexing
    assert not changes_table(encoder.encode(headers))  # now all indexed
    assert not changes_table(encoder.encode([hpack.NeverIndexedHeaderTuple("secret", "x" * 200)]))
    encoder.header_table_size = 100
    assert changes_table(encoder.encode([(":status", "200")]))  # a table size update first


async def test_a_kept_block_is_decoded_again_once_the_table_changes():
    encoder, conn = hpack.Encoder(), H2Connection(asyncio.StreamReader(), None, b"")
    conn._decode(encoder.encode([("a", "1")]))
    newest = bytes([0x80 | 62])  # the newest dynamic entry
    assert conn._decode(newest) == {"a": "1"} and conn._decode(newest) == {"a": "1"}
    conn._decode(encoder.encode([("b", "2")]))
    assert conn._decode(newest) == {"b": "2"}

class _Sink:
    """A writer that keeps what is written."""

    def __init__(self):
        self.sent = bytearray()

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        pass


async def _feed(reader: asyncio.StreamReader, wire: bytes, piece: int) -> None:
    # Small pieces with a turn of the loop between: frames arrive split across reads.
    for i in range(0, len(wire), piece):
        reader.feed_data(wire[i:i + piece])
        await asyncio.sleep(0)


async def test_frames_split_across_reads_with_continuations_pings_and_an_indexing_server():
    encoder = hpack.Encoder()  # indexes and uses Huffman, as a server may
    head = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    ok = encoder.encode([("grpc-status", "0")])
    again = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])  # from the dynamic table
    failed = encoder.encode([("grpc-status", "13"), ("grpc-message", "boom")])
    answer = length_prefixed(b"answer")
    wire = (frame(SETTINGS, 0, 0, struct.pack(">HI", 3, 100)) + frame(PING, 0, 0, b"12345678")
            + frame(HEADERS, 0, 1, head[:2]) + frame(CONTINUATION, END_HEADERS, 1, head[2:])
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1000)) + frame(PING, ACK, 0, b"87654321")
            + frame(DATA, PADDED, 1, bytes([3]) + answer + bytes(3))
            + frame(HEADERS, END_HEADERS | END_STREAM, 1, ok)
            + frame(HEADERS, END_HEADERS | END_STREAM, 3, again + failed))  # a trailers-only error
    reader, sink = asyncio.StreamReader(), _Sink()
    conn = H2Connection(reader, sink, b"")
    call = asyncio.create_task(conn.receive(1, to_end=True))
    await _feed(reader, wire, 7)
    assert await asyncio.wait_for(call, 5) == (b"answer", None)
    assert await asyncio.wait_for(conn.receive(3, to_end=True), 5) == (None, "grpc-status 13: boom")
    # SETTINGS acknowledged and the PING answered with its 8 bytes; the PING ACK and WINDOW_UPDATE left alone
    assert bytes(sink.sent) == frame(SETTINGS, ACK, 0) + frame(PING, ACK, 0, b"12345678")
    assert not conn.dead


async def test_a_stream_answer_is_one_message_and_goaway_or_a_lost_connection_marks_it_dead():
    reader, sink = asyncio.StreamReader(), _Sink()
    conn = H2Connection(reader, sink, b"")
    two = length_prefixed(b"first") + length_prefixed(b"second")
    await _feed(reader, frame(DATA, 0, 1, two[:9]) + frame(DATA, 0, 1, two[9:]), 4)
    assert await asyncio.wait_for(conn.receive(1, to_end=False), 5) == (b"first", None)
    assert await asyncio.wait_for(conn.receive(1, to_end=False), 5) == (b"second", None)
    reader.feed_data(frame(7, 0, 0, struct.pack(">II", 1, 2)))  # GOAWAY, PROTOCOL_ERROR
    assert await asyncio.wait_for(conn.receive(1, to_end=False), 5) == (None, "GOAWAY error code 2")
    assert conn.dead
    lost = H2Connection(reader, sink, b"")
    reader.feed_eof()
    message, error = await asyncio.wait_for(lost.receive(1, to_end=True), 5)
    assert message is None and error.startswith("IncompleteReadError") and lost.dead


@pytest.fixture(scope="module")
def canned(tmp_path_factory):
    server = CannedProcess(tmp_path_factory.mktemp("canned"))
    try:
        server.wait_ready(30)
        yield server
    finally:
        server.stop(timeout_s=5)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("clients", [1, 3])
def test_the_raw_client_calls_the_bare_grpc_aio_server_without_errors(canned, stream, clients):
    latencies, errors, _ = asyncio.run(drive_raw(canned.port, grpc_requests(rows(4)), clients, 0.5, stream))
    assert latencies and not errors, errors[:3]  # drive_raw also checked the first answer


def test_clients_spread_over_processes_start_together_and_merge(canned):
    # Three clients over two spawned processes: every call lands in one summary, none fails.
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        r = drive_spread(pool, 2, "grpc_raw", canned.port, grpc_requests(rows(4)), 3, 0.5)
    assert r["requests"] > 0 and r["errors"] == 0, r
    assert 0.5 <= r["seconds"] < 5, f"the processes ran the run's duration, together: {r['seconds']} s"
