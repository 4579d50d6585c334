"""A raw-socket HTTP/2 gRPC client for bench/grpc_load.py: frames and the request header block built
once, one connection per client, no gRPC library, as the HTTP loads are sent. It answers the
server's SETTINGS and PING, gives received bytes back to the server's send window, decodes every
header block that changes the server's HPACK table and reuses the decoding of any that does not."""

from __future__ import annotations

import asyncio
import struct
import time

from hpack import Decoder
from hpack.exceptions import HPACKError

from bench.loadgen import IO_TIMEOUT_S
from fusedserve.service.grpc.calls import literal
from fusedserve.service.grpc.h2_wire import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    WITH_PRIORITY,
    changes_table,
    frame,
)

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"

STREAM_WINDOW = 1 << 24
WINDOW_RETURN = 1 << 20  # received DATA bytes given back to the server's send window at a time


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
    """The next frame off ``reader`` as (type, flags, stream id, payload)."""
    word, flags, stream = struct.unpack(">IBI", await reader.readexactly(9))
    length = word >> 8
    return word & 0xFF, flags, stream & 0x7FFFFFFF, (await reader.readexactly(length) if length else b"")


def _unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (PADDED: a length byte first, that many bytes last)."""
    return payload[1:len(payload) - payload[0]] if flags & PADDED else payload


def request_block(port: int, path: str) -> bytes:
    """The header block of every call to ``path``: built once, sent as is on each new stream."""
    return b"".join(literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"), ("te", "trailers")))


def take_message(buf: bytearray) -> bytes | None:
    """The first whole length-prefixed message in ``buf``, removed from it; None until one is whole."""
    if len(buf) < 5:
        return None
    end = 5 + int.from_bytes(buf[1:5], "big")
    if len(buf) < end:
        return None
    message = bytes(buf[5:end])
    del buf[:end]
    return message


class H2Connection:
    """One raw HTTP/2 connection to a gRPC server. It answers the connection's own frames as they come
    (SETTINGS, PING, flow control) and decodes header blocks, in order, with one HPACK decoder: the
    server's encoder may index into its dynamic table, which the decoder must follow."""

    def __init__(self, reader: asyncio.StreamReader, writer, block: bytes):
        self.reader, self.writer, self.block = reader, writer, block
        self.decoder = Decoder()
        self.decoded = {}  # header blocks that leave the table as it is -> their headers
        self.body = bytearray()  # the stream's DATA not yet taken as messages
        self.stream = 0  # a long-lived stream (the stream load) whose window is given back too
        self.unreturned = 0  # DATA bytes received since the last WINDOW_UPDATE
        self.dead = False  # GOAWAY or the connection lost: the client opens another

    def close(self) -> None:
        self.writer.close()

    async def frame(self) -> tuple[int, int, int, bytes | dict]:
        """The next frame a call cares about: DATA (padding off), HEADERS (its whole block decoded to a
        dict), RST_STREAM or GOAWAY. SETTINGS and PING are answered here; the rest is skipped."""
        while True:
            kind, flags, stream, payload = await read_frame(self.reader)
            if kind == DATA:
                self._received(len(payload))
                return kind, flags, stream, _unpad(flags, payload)
            if kind == HEADERS:
                return kind, flags, stream, await self._headers(flags, payload)
            if kind in (RST_STREAM, GOAWAY):
                return kind, flags, stream, payload
            if kind == SETTINGS and not flags & ACK:
                self.writer.write(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self.writer.write(frame(PING, ACK, 0, payload))
            # WINDOW_UPDATE, PRIORITY, ACKs: nothing to do (the requests are far below any window)

    async def _headers(self, flags: int, payload: bytes) -> dict:
        """A HEADERS frame's block with its CONTINUATIONs, decoded."""
        block = _unpad(flags, payload)[5 if flags & WITH_PRIORITY else 0:]
        while not flags & END_HEADERS:
            kind, flags, _, more = await read_frame(self.reader)
            if kind != CONTINUATION:
                raise ConnectionError(f"frame type {kind} inside a header block")
            block += more
        return self._decode(block)

    def _decode(self, block: bytes) -> dict:
        """``block`` decoded. One that neither adds to nor resizes the dynamic table decodes the same way
        until one that does arrives, so it is kept: a server's repeated headers and trailers cost HPACK
        once (~10 us a block here), and the decoder still sees, in order, every block that changes it."""
        if (headers := self.decoded.get(block)) is not None:
            return headers
        try:
            headers = dict(self.decoder.decode(block))
        except HPACKError as exc:  # the decoder is out of step with the server: this connection is done
            raise ConnectionError(f"HPACK: {exc}") from exc
        if changes_table(block):
            self.decoded.clear()
        elif len(self.decoded) < 64:  # bounded: error messages may differ call by call
            self.decoded[block] = headers
        return headers

    def _received(self, n: int) -> None:
        """Counts DATA bytes in; past WINDOW_RETURN gives them back (the connection's window, and the
        long-lived stream's) so the server never waits on flow control."""
        self.unreturned += n
        if self.unreturned > WINDOW_RETURN:
            grant = struct.pack(">I", self.unreturned)
            self.writer.write(frame(WINDOW_UPDATE, 0, 0, grant)
                              + (frame(WINDOW_UPDATE, 0, self.stream, grant) if self.stream else b""))
            self.unreturned = 0

    async def receive(self, stream: int, to_end: bool) -> tuple[bytes | None, str | None]:
        """Frames until ``stream`` ends (``to_end``: a unary call, up to its trailers) or, on a stream,
        holds one whole message: (the message, None) or (None, the error). GOAWAY or a lost connection
        also marks the connection dead."""
        if not to_end and (message := take_message(self.body)) is not None:  # came with the one before
            return message, None
        try:
            while True:
                kind, flags, sid, payload = await self.frame()
                if kind == GOAWAY:
                    self.dead = True
                    return None, f"GOAWAY error code {int.from_bytes(payload[4:8], 'big')}"
                if sid != stream:
                    continue
                if kind == RST_STREAM:
                    return None, f"RST_STREAM error code {int.from_bytes(payload[:4], 'big')}"
                if kind == DATA:
                    self.body += payload
                    if not to_end and (message := take_message(self.body)) is not None:
                        return message, None
                elif kind == HEADERS and flags & END_STREAM:  # the trailers (or a trailers-only answer)
                    message, status = take_message(self.body), payload.get("grpc-status")
                    if status == "0" and message is not None:
                        return message, None
                    return None, f"grpc-status {status}: {payload.get('grpc-message', '')}"
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.dead = True
            return None, f"{type(exc).__name__}: {exc}"


async def h2_connect(port: int, path: str) -> H2Connection:
    """A connection to the gRPC server on ``port`` for calls to ``path``: the client preface, SETTINGS (no
    push, 16 MiB stream windows) and the connection window opened to its maximum."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), IO_TIMEOUT_S)
    settings = struct.pack(">HIHI", 0x2, 0, 0x4, STREAM_WINDOW)  # ENABLE_PUSH, INITIAL_WINDOW_SIZE
    opened = struct.pack(">I", (1 << 31) - 1 - 65535)  # from the initial 65535 to 2^31 - 1
    writer.write(PREFACE + frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, opened))
    return H2Connection(reader, writer, request_block(port, path))


def _record(t0: float, message: bytes | None, error: str | None, latencies: list, errors: list,
            answers: list) -> None:
    """One call's outcome: its latency or its error; the run's first answer is kept to check it."""
    if error:
        errors.append(error)
        return
    latencies.append(time.perf_counter() - t0)
    if not answers:
        answers.append(message)


async def raw_unary_client(port: int, messages: list[bytes], deadline: float, latencies: list, errors: list,
                            answers: list) -> None:
    """ModelInfer over one raw connection, one call in flight: HEADERS and DATA in one write, on a new
    stream (1, 3, 5...) per call; a new connection after GOAWAY or a lost one."""
    conn, stream, i = await h2_connect(port, METHOD), 1, 0
    try:
        while time.monotonic() < deadline:
            if conn.dead or stream >= 1 << 31:
                conn.close()
                conn, stream = await h2_connect(port, METHOD), 1
            t0 = time.perf_counter()
            conn.body.clear()
            conn.writer.write(frame(HEADERS, END_HEADERS, stream, conn.block)
                              + frame(DATA, END_STREAM, stream, messages[i % len(messages)]))
            message, error = await asyncio.wait_for(conn.receive(stream, to_end=True), IO_TIMEOUT_S)
            _record(t0, message, error, latencies, errors, answers)
            stream, i = stream + 2, i + 1
    finally:
        conn.close()


async def _open_stream(port: int) -> H2Connection:
    """A raw connection with one ModelStreamInfer stream (id 1) open: its HEADERS, no END_STREAM."""
    conn = await h2_connect(port, STREAM_METHOD)
    conn.stream = 1
    conn.writer.write(frame(HEADERS, END_HEADERS, 1, conn.block))
    return conn


async def raw_stream_client(port: int, messages: list[bytes], deadline: float, latencies: list, errors: list,
                             answers: list) -> None:
    """One ModelStreamInfer stream over one raw connection, one request (a DATA frame) in flight; a
    stream that ends, is reset or loses its connection is opened again on a new one."""
    from tritonclient.grpc import service_pb2 as pb

    conn, i = await _open_stream(port), 0
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            conn.writer.write(frame(DATA, 0, 1, messages[i % len(messages)]))
            message, error = await asyncio.wait_for(conn.receive(1, to_end=False), IO_TIMEOUT_S)
            if error:
                conn.close()
                conn = await _open_stream(port)
            elif not message.startswith(b"\x12"):  # infer_response (field 2) not first: error_message is set
                error = pb.ModelStreamInferResponse.FromString(message).error_message or None
            _record(t0, message, error, latencies, errors, answers)
            i += 1
        conn.writer.write(frame(DATA, END_STREAM, 1))
    finally:
        conn.close()
