"""Our HTTP/2 (``service.grpc.h2``) and gRPC call layer (``service.grpc.calls``) spoken to frame by frame
from a raw socket, against toy methods (no model service): what a gRPC client library never sends
or never shows. SETTINGS and PING, flow control both ways, padded and split header blocks,
RST_STREAM, refusals answered trailers-only, connection errors answered with GOAWAY, and drain."""

import asyncio
import gzip
import itertools
import struct
import urllib.parse
import zlib
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hpack import Decoder, Encoder

from fusedserve.service.grpc import calls as grpc_calls, h2, h2_limits
from fusedserve.service.grpc.server import GrpcServer
from fusedserve.service.settings import Settings

from ..conftest import free_port

T = 5.0  # seconds any one wait may take
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# RFC 9113: frame types, flags, the settings we send, the frame size neither side raised.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 2, 3, 4, 6, 7, 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, WITH_PRIORITY = 0x4, 0x8, 0x20
INITIAL_WINDOW_SIZE, FRAME_LIMIT, DEFAULT_WINDOW = 0x4, 16384, 65535
MAX_MESSAGE = 200_000
ECHO, BIG, FAIL, WAIT, CHAT, HOLD, PILE = (f"/toy.Toy/{name}" for name in ("Echo", "Big", "Fail", "Wait", "Chat",
                                                                           "Hold", "Pile"))
STREAMING = (CHAT, HOLD, PILE)


@dataclass
class Blob:
    """A toy message, request and response: its bytes are its serialization."""
    data: bytes

    def SerializeToString(self) -> bytes:
        return self.data


def pattern(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


def toy_methods(state) -> dict:
    """Echo, Big (``int(request)`` bytes), Fail (aborts NOT_FOUND, the request as the message), Wait
    (for ``state.release``, counted in ``state.waiting``; sets ``state.cancelled`` if cancelled);
    streaming: Chat (one answer per request), Hold (takes no request before ``state.release``, then
    answers each "ok"), Pile (like ModelStreamInfer: takes every request it may at once, counted in
    ``state.taken``, and answers each once ``state.release`` is set)."""

    async def echo(request, context):
        return request

    async def big(request, context):
        return Blob(pattern(int(request.data)))

    async def fail(request, context):
        raise grpc_calls.Abort("NOT_FOUND", request.data.decode(errors="replace"))

    async def wait(request, context):
        state.waiting += 1
        state.started.set()
        try:
            await state.release.wait()
        except asyncio.CancelledError:
            state.cancelled.set()
            raise
        return Blob(b"released")

    async def chat(requests, context):
        async for request in requests:
            yield Blob(b"re: " + request.data)

    async def hold(requests, context):
        await state.release.wait()
        async for _ in requests:
            yield Blob(b"ok")

    handlers = {ECHO: echo, BIG: big, FAIL: fail, WAIT: wait, CHAT: chat, HOLD: hold, PILE: pile_handler(state)}
    return {path: grpc_calls.Method(path.rsplit("/", 1)[1], Blob, handler, path in STREAMING)
            for path, handler in handlers.items()}


def pile_handler(state):
    async def pile(requests, context):
        answers: asyncio.Queue = asyncio.Queue()

        async def answer(request):
            await state.release.wait()
            answers.put_nowait(Blob(b"re: " + request.data))

        async def read():
            tasks = []
            async for request in requests:
                state.taken += 1
                tasks.append(asyncio.ensure_future(answer(request)))
            await asyncio.gather(*tasks)
            answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (blob := await answers.get()) is not None:
                yield blob
        finally:
            reader.cancel()

    return pile


def toy_state() -> SimpleNamespace:
    return SimpleNamespace(started=asyncio.Event(), release=asyncio.Event(), cancelled=asyncio.Event(), waiting=0,
                           taken=0)


def toy_stub(limits: h2_limits.Limits | None = None, max_message: int = MAX_MESSAGE) -> SimpleNamespace:
    """A stand-in for GrpcServer (the attributes a Connection reads) over the toy methods; a caller
    sending ``x-deny: yes`` is refused. ``limits``: the defaults unless given."""
    state = toy_state()
    return SimpleNamespace(methods=toy_methods(state), max_message=max_message, connections=set(), draining=False,
                           refuse=lambda name, metadata: "denied" if ("x-deny", "yes") in metadata else None,
                           state=state, limits=limits or h2_limits.Limits.of(Settings()))


@asynccontextmanager
async def toy_server(limits: h2_limits.Limits | None = None, max_message: int = MAX_MESSAGE):
    """``toy_stub`` serving on a free loopback port (``.port``)."""
    stub = toy_stub(limits, max_message)
    listener = await asyncio.get_running_loop().create_server(lambda: h2.Connection(stub), "127.0.0.1", 0)
    stub.port = listener.sockets[0].getsockname()[1]
    try:
        yield stub
    finally:
        listener.close()
        for connection in list(stub.connections):
            connection.close()
        await listener.wait_closed()


@pytest.fixture
async def server():
    async with toy_server() as stub:
        yield stub


OPEN_CLIENTS: list = []


@pytest.fixture(autouse=True)
async def _close_clients():
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().writer.close()


def frame(kind: int, flags: int, stream: int, payload: bytes = b"", length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return n.to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def message(body: bytes, flag: int = 0) -> bytes:
    """A gRPC length-prefixed message: the compressed flag, the length, the bytes."""
    return bytes((flag,)) + len(body).to_bytes(4, "big") + body


def literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, name and value as plain (not Huffman) strings."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127, "the test client writes one-byte string lengths only"
    return b"\x00" + bytes((len(n),)) + n + bytes((len(v),)) + v


def request_block(path: str, content_type: str = "application/grpc", extra=()) -> bytes:
    fields = ((":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1"),
              ("content-type", content_type), ("te", "trailers"), *extra)
    return b"".join(literal(name, value) for name, value in fields)


async def wait(awaitable, what: str):
    try:
        return await asyncio.wait_for(awaitable, T)
    except asyncio.TimeoutError:
        raise AssertionError(f"expected {what} within {T} s") from None


class Client:
    """A raw HTTP/2 client: frames out as told, frames in sorted by stream, windows kept both ways.
    A frame above 16384 bytes, or DATA beyond the windows we granted, fails the test at once."""

    def __init__(self, reader, writer):
        self.reader, self.writer, self.send = reader, writer, writer.write
        self.decoder = Decoder()
        self.server_settings, self.settings_acked, self.closed = None, False, False
        self.pings: list[bytes] = []  # the payloads of the PING ACKs received
        self.goaway: tuple[int, int] | None = None  # (last stream id, error code)
        self.blocks = defaultdict(list)  # stream -> its header blocks, decoded, as dicts
        self.data = defaultdict(bytearray)  # stream -> its DATA, concatenated
        self.ended: dict[int, int] = {}  # stream -> the kind of frame that carried END_STREAM
        self.resets: dict[int, int] = {}  # stream -> RST_STREAM's error code
        # Flow-control windows by stream, 0 the connection's; a stream's starts at the initial window.
        self.out, self.peer_initial = {0: DEFAULT_WINDOW}, DEFAULT_WINDOW  # the server's, for what we send
        self.into, self.recv_initial = {0: DEFAULT_WINDOW}, DEFAULT_WINDOW  # ours, for what it sends
        self.tokens = itertools.count(1)

    @classmethod
    async def open(cls, port: int) -> "Client":
        client = cls(*await wait(asyncio.open_connection("127.0.0.1", port), "a connection"))
        OPEN_CLIENTS.append(client)
        return client

    @classmethod
    async def connect(cls, port: int, window: int = 1 << 22, connection_window: int = 1 << 22) -> "Client":
        """Preface, SETTINGS (our stream window), a connection WINDOW_UPDATE; back once both SETTINGS are ACKed."""
        client = await cls.open(port)
        client.recv_initial = window
        client.send(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, window)))
        if connection_window:
            client.grant(0, connection_window)
        await client.until(lambda: client.server_settings is not None, "the server's SETTINGS")
        client.send(frame(SETTINGS, ACK, 0))
        await client.until(lambda: client.settings_acked, "the ACK of our SETTINGS")
        return client

    def grant(self, stream: int, n: int) -> None:
        self.send(frame(WINDOW_UPDATE, 0, stream, n.to_bytes(4, "big")))
        self.into[stream] = self.into.get(stream, self.recv_initial) + n

    def spend(self, stream: int, n: int) -> None:
        """Take ``n`` bytes of DATA out of the windows the server gave us."""
        left = min(self.out[0], self.out.get(stream, self.peer_initial))
        assert n <= left, f"the server's windows let us send {n} bytes on stream {stream}: only {left} open"
        self.out[0] -= n
        self.out[stream] = self.out.get(stream, self.peer_initial) - n

    def send_data(self, stream: int, body: bytes, end: bool = True) -> None:
        chunks = [body[i:i + FRAME_LIMIT] for i in range(0, len(body), FRAME_LIMIT)] or [b""]
        for i, chunk in enumerate(chunks):
            self.spend(stream, len(chunk))
            self.send(frame(DATA, END_STREAM if end and i == len(chunks) - 1 else 0, stream, chunk))

    def call(self, stream: int, path: str, body: bytes, extra=(), content_type="application/grpc", end=True):
        self.send(frame(HEADERS, END_HEADERS, stream, request_block(path, content_type, extra)))
        self.send_data(stream, body, end)

    async def read(self) -> bool:
        """Take in the next frame; False once the server closed the connection."""
        try:
            head = await self.reader.readexactly(9)
            length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
            payload = await self.reader.readexactly(length)
        except asyncio.IncompleteReadError:
            self.closed = True
            return False
        assert length <= FRAME_LIMIT, f"frames of at most {FRAME_LIMIT} bytes (our limit), got {length}"
        self._take(kind, flags, int.from_bytes(head[5:], "big") & 0x7FFFFFFF, payload)
        return True

    def _take(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == SETTINGS and flags & ACK:
            self.settings_acked = True
        elif kind == SETTINGS:
            self.server_settings = dict(struct.iter_unpack(">HI", payload))
            self.peer_initial = self.server_settings.get(INITIAL_WINDOW_SIZE, self.peer_initial)
        elif kind == WINDOW_UPDATE:
            self.out[stream] = self.out.get(stream, self.peer_initial) + (int.from_bytes(payload, "big") & 0x7FFFFFFF)
        elif kind == PING and flags & ACK:
            self.pings.append(payload)
        elif kind == GOAWAY:
            self.goaway = struct.unpack(">II", payload[:8])
        elif kind == RST_STREAM:
            self.resets[stream] = int.from_bytes(payload, "big")
        elif kind == HEADERS:
            assert flags & END_HEADERS, f"the server's header blocks fit one frame (END_HEADERS), flags {flags:#x}"
            self.blocks[stream].append(dict(self.decoder.decode(payload)))
        elif kind == DATA:
            left = min(self.into[0], self.into.get(stream, self.recv_initial))
            assert len(payload) <= left, f"DATA within our windows: {len(payload)} bytes on {stream}, {left} open"
            self.into[0] -= len(payload)
            self.into[stream] = self.into.get(stream, self.recv_initial) - len(payload)
            self.data[stream] += payload
        if kind in (DATA, HEADERS) and flags & END_STREAM:
            self.ended[stream] = kind

    async def until(self, done, what: str) -> None:
        async def loop():
            while not done():
                assert await self.read() or done(), \
                    f"expected {what} before the server closed the connection ({self.goaway=})"
        await wait(loop(), what)

    async def until_closed(self) -> None:
        await self.until(lambda: self.closed, "the server to close the connection")

    async def sync(self) -> None:
        """A PING round trip: whatever the server wrote before answering it has been read."""
        token = next(self.tokens).to_bytes(8, "big")
        self.send(frame(PING, 0, 0, token))
        await self.until(lambda: token in self.pings, "the ACK of our PING")

    async def answer(self, stream: int) -> SimpleNamespace:
        await self.until(lambda: stream in self.ended or stream in self.resets, f"the end of stream {stream}")
        return SimpleNamespace(blocks=self.blocks[stream], data=bytes(self.data[stream]), end=self.ended.get(stream),
                               reset=self.resets.get(stream), trailers=(self.blocks[stream] or [{}])[-1])


async def unary(client: Client, stream: int, path: str, body: bytes, **kwargs) -> SimpleNamespace:
    client.call(stream, path, message(body), **kwargs)
    return await client.answer(stream)


def answered(answer, data: bytes) -> None:
    """Headers (:status 200), ``data``, then trailers with grpc-status 0 ending the stream."""
    assert [b.get(":status") for b in answer.blocks] == ["200", None], f"headers, then trailers: {answer.blocks}"
    assert answer.blocks[0].get("content-type") == "application/grpc", f"a gRPC content-type: {answer.blocks[0]}"
    assert answer.data == data, f"the DATA {data[:40]!r}... ({len(data)} bytes), got {answer.data[:40]!r}..."
    assert answer.trailers.get("grpc-status") == "0", f"grpc-status 0 in the trailers: {answer.trailers}"
    assert answer.end == HEADERS and answer.reset is None, \
        f"END_STREAM on the trailers' HEADERS, no RST_STREAM: ended by frame type {answer.end}, reset {answer.reset}"


async def test_a_unary_call_frame_by_frame_with_settings_and_ping(server):
    client = await Client.connect(server.port)
    assert client.server_settings.get(INITIAL_WINDOW_SIZE, 0) > DEFAULT_WINDOW, \
        f"the server's SETTINGS open each stream's window past the default: {client.server_settings}"
    assert client.out[0] > DEFAULT_WINDOW, "the server's WINDOW_UPDATE opens the connection's window"
    assert client.settings_acked, "our SETTINGS are ACKed"
    client.send(frame(PING, 0, 0, b"pingpong"))
    answered(await unary(client, 1, ECHO, b"hello"), message(b"hello"))
    assert client.pings == [b"pingpong"], f"the PING answered with ACK and its 8 bytes: {client.pings}"


async def test_a_connection_holds_only_so_many_unfinished_large_requests(server):
    # Eight unfinished messages near max_message fit; the ninth is refused, and the eight still finish.
    client = await Client.connect(server.port, window=1 << 22, connection_window=1 << 24)
    body = message(pattern(MAX_MESSAGE - 10_000))
    for stream in range(1, 19, 2):
        client.call(stream, ECHO, body[:-1], end=False)
    refused = await client.answer(17)
    assert refused.trailers.get("grpc-status") == "8", f"the ninth refused RESOURCE_EXHAUSTED: {refused.blocks}"
    for stream in range(1, 17, 2):
        client.send_data(stream, body[-1:])
        answered(await client.answer(stream), body)


async def test_header_blocks_that_index_and_refer_to_the_table_are_read_right(server):
    # A client's encoder adds headers to its table, then sends references to them: the same bytes
    # again and again, which the server remembers, until a block that changes the table again.
    client, encoder = await Client.connect(server.port), Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    for stream, (path, body) in enumerate([(ECHO, b"a"), (ECHO, b"b"), (ECHO, b"c"), (FAIL, b"d"), (ECHO, b"e")]):
        client.send(frame(HEADERS, END_HEADERS, 2 * stream + 1, encoder.encode([(":path", path), *fields])))
        client.send_data(2 * stream + 1, message(body))
        answer = await client.answer(2 * stream + 1)
        if path == ECHO:
            answered(answer, message(body))
        else:
            assert answer.trailers.get("grpc-status") == "5", f"{path} answered by its own handler: {answer.blocks}"


async def test_a_stream_answers_each_message_as_it_comes(server):
    client = await Client.connect(server.port)
    client.call(1, CHAT, message(b"one"), end=False)
    first = message(b"re: one")
    await client.until(lambda: len(client.data[1]) >= len(first), "the first answer of the stream")
    assert client.data[1] == first and 1 not in client.ended, "the first answer, the stream still open"
    client.send_data(1, message(b"two"), end=True)
    answered(await client.answer(1), first + message(b"re: two"))


async def test_the_server_sends_no_more_than_the_windows_allow(server):
    # Our windows: 1000 bytes a stream, 65535 the connection; Client._take checks every DATA frame.
    client = await Client.connect(server.port, window=1000, connection_window=0)
    size = 200_000
    client.call(1, BIG, message(str(size).encode()))
    await client.until(lambda: len(client.data[1]) >= 1000, "the first 1000 bytes of the answer")
    await client.sync()
    assert len(client.data[1]) == 1000, f"1000 bytes (the stream's window) sent, got {len(client.data[1])}"
    client.grant(1, 150_000)
    await client.until(lambda: len(client.data[1]) >= DEFAULT_WINDOW, "the rest of the connection's window")
    await client.sync()
    assert len(client.data[1]) == DEFAULT_WINDOW and 1 not in client.ended, \
        f"{DEFAULT_WINDOW} bytes (the connection's window) sent, no trailers yet: got {len(client.data[1])}"
    client.grant(0, 200_000)
    client.grant(1, 100_000)
    answered(await client.answer(1), message(pattern(size)))  # the trailers once all the data went out


async def test_a_request_above_the_default_window_is_taken(server):
    client = await Client.connect(server.port)
    body = pattern(100_000)
    assert min(client.out[0], client.peer_initial) >= len(body) + 5, \
        f"the server's SETTINGS and WINDOW_UPDATE let a {len(body)}-byte message in: {client.out[0]} " \
        f"(connection) and {client.peer_initial} (stream) open"
    answered(await unary(client, 1, ECHO, body), message(body))  # Client.spend checks the windows


async def test_a_split_padded_prioritized_header_block_and_padded_data(server):
    client = await Client.connect(server.port)
    client.send(frame(PRIORITY, 0, 1, struct.pack(">IB", 0, 200)) + frame(0x20, 0, 0, b"an unknown frame type"))
    block, pad = request_block(ECHO), 7
    first = bytes((pad,)) + struct.pack(">IB", 0, 15) + block[:10] + bytes(pad)  # pad length, priority, block, pad
    client.send(frame(HEADERS, PADDED | WITH_PRIORITY, 1, first) + frame(CONTINUATION, 0, 1, block[10:30])
                + frame(CONTINUATION, END_HEADERS, 1, block[30:]))
    data = bytes((3,)) + message(b"padded") + bytes(3)
    client.spend(1, len(data))
    client.send(frame(DATA, PADDED | END_STREAM, 1, data))
    answered(await client.answer(1), message(b"padded"))


async def test_rst_stream_cancels_the_call_and_the_connection_goes_on(server):
    client = await Client.connect(server.port)
    client.call(1, WAIT, message(b""))
    await wait(server.state.started.wait(), "the handler to start")
    client.send(frame(RST_STREAM, 0, 1, struct.pack(">I", 0x8)))  # CANCEL
    await wait(server.state.cancelled.wait(), "the handler to see CancelledError")
    answered(await unary(client, 3, ECHO, b"next"), message(b"next"))
    assert not client.blocks[1] and not client.data[1] and not client.closed, \
        f"nothing answered on the reset stream, the connection open: {client.blocks[1]}, {client.closed=}"


REFUSALS = {  # what -> (path, headers added, the DATA, grpc-status)
    "an unknown path": ("/toy.Toy/Nope", (), message(b"hi"), 12),
    "a message flagged compressed without grpc-encoding": (ECHO, (), message(b"hi", flag=1), 13),
    "grpc-encoding br": (ECHO, (("grpc-encoding", "br"),), message(b"hi"), 12),
    "a gzip message that does not inflate": (ECHO, (("grpc-encoding", "gzip"),), message(b"not gzip", flag=1), 13),
    "a gzip message above max_message inflated": (ECHO, (("grpc-encoding", "gzip"),),
                                                   message(gzip.compress(bytes(MAX_MESSAGE + 1)), flag=1), 8),
    "a message above max_message": (ECHO, (), message(bytes(MAX_MESSAGE + 1)), 8),
    "two messages on a unary call": (ECHO, (), message(b"a") + message(b"b"), 13),
    "a message cut short": (ECHO, (), message(b"hello")[:-2], 13),
    "an invalid grpc-timeout": (ECHO, (("grpc-timeout", "10x"),), message(b"hi"), 3),
    "a refused caller": (ECHO, (("x-deny", "yes"),), message(b"hi"), 16),
}


@pytest.mark.parametrize("encoding, squeeze", [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_messages_are_inflated(server, encoding, squeeze):
    # gRPC's message compression: flagged messages in the call's grpc-encoding; answers go uncompressed.
    client = await Client.connect(server.port)
    body = pattern(50_000)
    client.call(1, ECHO, message(squeeze(body), flag=1), (("grpc-encoding", encoding),))
    answered(await client.answer(1), message(body))
    client.call(3, ECHO, message(b"plain"), (("grpc-encoding", encoding),))  # the flag says which are
    answered(await client.answer(3), message(b"plain"))


@pytest.mark.parametrize("what", REFUSALS)
async def test_a_refused_call_is_answered_trailers_only(server, what):
    path, extra, body, code = REFUSALS[what]
    client = await Client.connect(server.port)
    client.call(1, path, body, extra)
    answer = await client.answer(1)
    assert len(answer.blocks) == 1 and answer.end == HEADERS and not answer.data, \
        f"one HEADERS frame ending the stream (trailers-only) for {what}: {answer.blocks}, {answer.data[:20]!r}"
    assert answer.trailers.get(":status") == "200" and answer.trailers.get("grpc-status") == str(code), \
        f":status 200 and grpc-status {code} for {what}: {answer.trailers}"
    assert answer.trailers.get("grpc-message"), f"a grpc-message saying why: {answer.trailers}"
    answered(await unary(client, 3, ECHO, b"after"), message(b"after"))  # the connection goes on


async def test_a_handler_abort_keeps_its_code_and_percent_encodes_its_message(server):
    client = await Client.connect(server.port)
    text = "100% sure: café"
    for stream, said in ((1, "x"), (3, text)):
        answer = await unary(client, stream, FAIL, said.encode())
        assert len(answer.blocks) == 1 and answer.trailers.get("grpc-status") == "5", \
            f"trailers-only with grpc-status 5 (NOT_FOUND): {answer.blocks}"
        raw = answer.trailers.get("grpc-message", "")
        assert raw.isascii() and urllib.parse.unquote(raw) == said, f"grpc-message {said!r} percent-encoded: {raw!r}"
    assert raw == "100%25 sure: caf%C3%A9", f"'%' and non-ASCII bytes as %XX, the rest as is: {raw!r}"
    long = await unary(client, 5, FAIL, "é".encode() * 20_000)  # 120 kB once encoded: cut, in one frame
    assert urllib.parse.unquote(long.trailers["grpc-message"]) == "é" * (grpc_calls.MESSAGE_LIMIT // 2), \
        f"a long message cut to its first {grpc_calls.MESSAGE_LIMIT} bytes, whole characters only"


async def test_a_request_that_is_not_grpc_is_http_415(server):
    client = await Client.connect(server.port)
    answer = await unary(client, 1, ECHO, b"{}", content_type="application/json")
    assert answer.blocks == [{":status": "415"}] and answer.end == HEADERS, \
        f"one HEADERS frame, :status 415, ending the stream: {answer.blocks}"


async def test_trailers_on_a_refused_stream_leave_the_connection_alone(server):
    # HTTP/2 lets a client end its side with trailers; the stream was answered already: nothing to do.
    client = await Client.connect(server.port)
    answer = await unary(client, 1, "/toy.Toy/Nope", b"hi", end=False)
    assert answer.trailers.get("grpc-status") == "12", answer.blocks
    client.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, literal("x-trailer", "1")))
    answered(await unary(client, 3, ECHO, b"next"), message(b"next"))
    assert client.goaway is None and not client.closed, f"the connection goes on: {client.goaway}"


async def test_a_zero_window_increment_on_a_stream_resets_only_that_stream(server):
    client = await Client.connect(server.port)
    client.call(1, WAIT, message(b""))
    await wait(server.state.started.wait(), "the handler to start")
    client.send(frame(WINDOW_UPDATE, 0, 1, bytes(4)))
    assert (await client.answer(1)).reset == 0x1, "RST_STREAM PROTOCOL_ERROR on the stream"
    await wait(server.state.cancelled.wait(), "the reset stream's handler to be cancelled")
    answered(await unary(client, 3, ECHO, b"next"), message(b"next"))


OPENING = PREFACE + frame(SETTINGS, 0, 0)
CONNECTION_ERRORS = {  # what -> (bytes sent, GOAWAY's error code)
    "a bad preface": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 0x1),
    "DATA on stream 0": (OPENING + frame(DATA, 0, 0, b"x"), 0x1),
    "a frame above 16384 bytes": (OPENING + frame(DATA, 0, 1, length=FRAME_LIMIT + 1), 0x6),
    "HEADERS on an even stream": (OPENING + frame(HEADERS, END_HEADERS | END_STREAM, 2, request_block(ECHO)), 0x1),
    "an undecodable header block": (OPENING + frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xfe"), 0x9),
    "a short RST_STREAM": (OPENING + frame(RST_STREAM, 0, 1, b"\0\0"), 0x6),
    "RST_STREAM on stream 0": (OPENING + frame(RST_STREAM, 0, 0, bytes(4)), 0x1),
    "DATA on a stream never opened": (OPENING + frame(DATA, 0, 1, message(b"x")), 0x1),
    "RST_STREAM on a stream never opened": (OPENING + frame(RST_STREAM, 0, 1, bytes(4)), 0x1),
    "WINDOW_UPDATE on a stream never opened": (OPENING + frame(WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")), 0x1),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", CONNECTION_ERRORS)
async def test_a_connection_error_is_answered_with_goaway(server, what):
    sent, code = CONNECTION_ERRORS[what]
    client = await Client.open(server.port)
    client.send(sent)  # only what the server reads before it fails: no unread bytes make its close a reset
    await client.until_closed()
    assert client.goaway == (0, code), f"GOAWAY (last stream 0, error code {code:#x}) for {what}, got {client.goaway}"
    answered(await unary(await Client.connect(server.port), 1, ECHO, b"next"), message(b"next"))


async def test_drain_answers_the_call_in_flight_and_refuses_new_streams():
    state = toy_state()
    grpc = GrpcServer(None, Settings(grpc_port=free_port(), max_body_bytes=MAX_MESSAGE))
    grpc.methods = toy_methods(state)  # the real server's drain, over toy methods
    await grpc.start()
    try:
        client = await Client.connect(grpc.port)
        client.call(1, WAIT, message(b""))
        await wait(state.started.wait(), "the handler to start")
        grpc.drain(grace_s=T)
        await client.until(lambda: client.goaway is not None, "GOAWAY")
        assert client.goaway == (1, 0), f"GOAWAY NO_ERROR with last stream 1 (the call in flight): {client.goaway}"
        client.call(3, ECHO, message(b"late"))
        late = await client.answer(3)
        assert late.reset == 0x7 and not late.blocks and not client.closed, \
            f"a stream after GOAWAY reset REFUSED_STREAM (7), the connection open: {late}, {client.closed=}"
        state.release.set()
        answered(await client.answer(1), message(b"released"))
        await client.until_closed()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", grpc.port)  # no new connection once draining
    finally:
        state.release.set()  # a failed assertion above must not hold the stop for the grace period
        await wait(grpc.stop(1.0), "the server to stop")


@pytest.mark.parametrize("value, seconds", [("100m", 0.1), ("2S", 2.0), ("1H", 3600.0), ("3M", 180.0),
                                            ("250u", 250e-6), ("99999999n", 0.099999999)])
def test_grpc_timeout_parses(value, seconds):
    assert grpc_calls.grpc_timeout(value) == pytest.approx(seconds), f"grpc-timeout {value!r} is {seconds} s"


@pytest.mark.parametrize("value", ["", "m", "123456789m", "10x", "-1S", "1.5S", "10"])
def test_grpc_timeout_rejects(value):
    with pytest.raises(grpc_calls.Abort) as refused:
        grpc_calls.grpc_timeout(value)
    assert refused.value.code == "INVALID_ARGUMENT", f"{value!r} refused INVALID_ARGUMENT, got {refused.value.code}"


# Issue 34: what a hostile client can make one connection hold or do.
ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, PROTOCOL_ERROR = 0xB, 0x3, 0x1
SMALL = h2_limits.Limits(calls_per_connection=2, calls_per_stream=4, write_buffer_bytes=1 << 16,
                         queued_control_frames=10)


class FakeTransport(asyncio.Transport):
    """A Connection's transport without a socket: what it wrote, whether it reads, whether it was
    closed or aborted; ``unsent`` plays the bytes the client has not read yet."""

    def __init__(self):
        super().__init__()
        self.written, self.reading, self.closed, self.aborted, self.unsent = bytearray(), True, False, False, 0
        self.high: int | None = None

    def write(self, data) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self.high = high

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name, default=None):
        return default


def in_process(limits: h2_limits.Limits | None = None) -> tuple[h2.Connection, FakeTransport]:
    """A Connection over the toy methods on a FakeTransport, the client's preface and SETTINGS in."""
    connection, transport = h2.Connection(toy_stub(limits)), FakeTransport()
    connection.connection_made(transport)
    connection.data_received(OPENING)
    return connection, transport


def frames_in(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of each whole frame in ``data``."""
    found, pos = [], 0
    while len(data) - pos >= 9 and len(data) - pos >= 9 + (length := int.from_bytes(data[pos:pos + 3], "big")):
        found.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                      bytes(data[pos + 9:pos + 9 + length])))
        pos += 9 + length
    return found


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def until_true(done, what: str) -> None:
    """Wait for ``done()`` (the server's own state, not a frame) for up to T seconds."""
    async def poll():
        while not done():
            await asyncio.sleep(0.01)
    await wait(poll(), what)


def goaway_code(transport: FakeTransport) -> int | None:
    codes = [struct.unpack(">II", p[:8])[1] for kind, _, _, p in frames_in(transport.written) if kind == GOAWAY]
    return codes[-1] if codes else None


@pytest.mark.timeout(30)
async def test_a_new_stream_below_one_already_opened_is_a_connection_error(server):
    client = await Client.connect(server.port)
    answered(await unary(client, 5, ECHO, b"five"), message(b"five"))
    client.send(frame(HEADERS, END_HEADERS | END_STREAM, 3, request_block(ECHO)))
    await client.until_closed()
    assert client.goaway == (5, PROTOCOL_ERROR), f"GOAWAY PROTOCOL_ERROR, last stream 5, got {client.goaway}"


FLOOD_BURST = h2_limits.FLOOD_BURST
FLOODS = {  # what -> the bytes sent (the server fails on their last frame)
    "PINGs": frame(PING, 0, 0, bytes(8)) * (FLOOD_BURST + 1),
    "SETTINGS frames": frame(SETTINGS, 0, 0) * FLOOD_BURST,  # OPENING holds one more
    "RST_STREAMs": frame(HEADERS, END_HEADERS | END_STREAM, 1, request_block(ECHO))
    + frame(RST_STREAM, 0, 1, bytes(4)) * (FLOOD_BURST + 1),
    "calls refused": b"".join(frame(HEADERS, END_HEADERS | END_STREAM, 2 * i + 1, request_block("/toy.Toy/Nope"))
                              for i in range(FLOOD_BURST + 1)),
    "two empty DATA frames in a row": frame(HEADERS, END_HEADERS, 1, request_block(ECHO)) + frame(DATA, 0, 1) * 2,
    "nine CONTINUATION frames": frame(HEADERS, 0, 1, request_block(ECHO)[:10]) + b"".join(
        frame(CONTINUATION, END_HEADERS if i == 8 else 0, 1, request_block(ECHO)[10 + i:11 + i]) for i in range(9)),
    "33 entries in one SETTINGS frame": frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 1000) * 33),
    "PRIORITY frames on no stream": frame(PRIORITY, 0, 1, bytes(5)) * (h2_limits.IDLE_PER_STREAM + 1),
    "PING ACKs unasked for": frame(PING, ACK, 0, bytes(8)) * (h2_limits.IDLE_PER_STREAM + 1),
    "WINDOW_UPDATEs with no DATA sent": frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big"))
    * (h2_limits.WINDOW_UPDATES_PER_DATA + 1),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", FLOODS)
async def test_a_flood_is_answered_with_enhance_your_calm(server, what):
    client = await Client.open(server.port)
    client.send(OPENING + FLOODS[what])
    await client.until_closed()
    assert client.goaway is not None and client.goaway[1] == ENHANCE_YOUR_CALM, \
        f"GOAWAY ENHANCE_YOUR_CALM (0xb) for {what}, got {client.goaway}"
    answered(await unary(await Client.connect(server.port), 1, ECHO, b"next"), message(b"next"))


@pytest.mark.timeout(30)
async def test_a_stream_window_comes_back_only_as_its_handler_takes_messages():
    async with toy_server(max_message=1 << 22) as server:
        client = await Client.connect(server.port, connection_window=1 << 24)
        window, body = client.peer_initial, message(pattern(100_000))
        count = window // 2 // len(body) + 1  # past half the window: where a WINDOW_UPDATE was due
        client.call(1, HOLD, body * count, end=False)
        await client.sync()
        left = window - count * len(body)
        assert client.out[1] == left, \
            f"no WINDOW_UPDATE on stream 1 while its handler took nothing: {client.out[1] - left} bytes given back"
        server.state.release.set()
        await client.until(lambda: client.out[1] > left, "a WINDOW_UPDATE on stream 1")
        client.send_data(1, b"", end=True)
        answered(await client.answer(1), message(b"ok") * count)


@pytest.mark.timeout(30)
async def test_data_beyond_a_stream_window_is_a_flow_control_error():
    async with toy_server(max_message=1 << 22) as server:
        client = await Client.connect(server.port, connection_window=1 << 25)
        body = message(pattern(100_000)) * (client.peer_initial // 100_005 + 1)
        client.send(frame(HEADERS, END_HEADERS, 1, request_block(HOLD)))
        client.send(b"".join(frame(DATA, 0, 1, body[i:i + FRAME_LIMIT]) for i in range(0, len(body), FRAME_LIMIT)))
        await client.until_closed()
        assert client.goaway == (1, FLOW_CONTROL_ERROR), f"GOAWAY FLOW_CONTROL_ERROR, got {client.goaway}"


@pytest.mark.timeout(30)
async def test_a_stream_handler_takes_at_most_calls_per_stream_requests_unanswered():
    limits = h2_limits.Limits(calls_per_connection=100, calls_per_stream=4, write_buffer_bytes=1 << 16,
                              queued_control_frames=10)
    async with toy_server(limits) as server:
        client = await Client.connect(server.port)
        client.call(1, PILE, b"".join(message(b"%d" % i) for i in range(10)), end=True)
        await until_true(lambda: server.state.taken >= limits.calls_per_stream, "the handler to take requests")
        await asyncio.sleep(0.1)
        assert server.state.taken == limits.calls_per_stream, \
            f"{limits.calls_per_stream} requests taken before any was answered, got {server.state.taken}"
        server.state.release.set()
        answer = await client.answer(1)
        assert answer.data.count(b"re: ") == 10 and answer.trailers.get("grpc-status") == "0", answer


@pytest.mark.timeout(30)
async def test_a_connection_is_not_read_while_it_holds_its_cap_of_calls():
    async with toy_server(SMALL) as server:
        client = await Client.connect(server.port)
        for stream in (1, 3, 5):
            client.call(stream, WAIT, message(b""))
        await until_true(lambda: server.state.waiting >= SMALL.calls_per_connection, "two calls to start")
        client.send(frame(PING, 0, 0, b"held-up!"))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.until(lambda: b"held-up!" in client.pings, "a PING ACK"), 0.3)
        assert server.state.waiting == SMALL.calls_per_connection, f"a third call started: {server.state.waiting}"
        server.state.release.set()
        for stream in (1, 3, 5):
            answered(await client.answer(stream), message(b"released"))
        await client.until(lambda: b"held-up!" in client.pings, "the PING ACK once the calls finished")


@pytest.mark.timeout(30)
async def test_an_unknown_method_is_answered_quoting_little_of_its_path(server):
    client, encoder, path = await Client.connect(server.port), Encoder(), "/" + "x" * 3900
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), ("content-type", "application/grpc")]
    for stream in (1, 3):  # the second block refers to the path the first added to the table
        client.send(frame(HEADERS, END_HEADERS | END_STREAM, stream, encoder.encode(fields)))
        said = (await client.answer(stream)).trailers.get("grpc-message", "")
        assert said.startswith("unknown method /xxx") and len(said) <= 2 * grpc_calls.ECHO_LIMIT, \
            f"a grpc-message of at most {2 * grpc_calls.ECHO_LIMIT} characters, got {len(said)}: {said[:60]}..."


@pytest.mark.timeout(30)
async def test_one_read_is_handled_a_slice_per_event_loop_turn():
    connection, transport = in_process()
    await turns()
    sent = frame(PING, 0, 0, bytes(8)) * 900
    connection.data_received(sent)
    acks = sum(1 for data in connection._out for kind, *_ in frames_in(data) if kind == PING)
    assert acks == h2_limits.SLICE_FRAMES and not transport.reading, \
        f"{h2_limits.SLICE_FRAMES} frames handled in the read's own turn, reading paused: {acks}, {transport.reading=}"
    await turns()
    acks = sum(1 for kind, flags, *_ in frames_in(transport.written) if kind == PING and flags & ACK)
    assert acks == 900 and transport.reading, f"every PING answered on later turns, then reading on: {acks}"


@pytest.mark.timeout(30)
async def test_reading_stops_while_the_client_reads_too_little():
    connection, transport = in_process()
    connection.pause_writing()  # what the transport says past its high-water mark
    connection.data_received(frame(PING, 0, 0, b"pingpong"))
    await turns()
    assert not transport.reading and b"pingpong" not in transport.written, "nothing read or answered while paused"
    assert transport.high == Settings().grpc_write_buffer_bytes, f"the high-water mark set: {transport.high}"
    connection.resume_writing()
    await turns()
    assert transport.reading and b"pingpong" in transport.written, "reading and answering on once resumed"


@pytest.mark.timeout(30)
async def test_a_client_that_leaves_too_much_unsent_is_cut_off():
    connection, transport = in_process(SMALL)
    await turns()
    transport.unsent = h2_limits.WRITE_HARD * SMALL.write_buffer_bytes + 1
    connection.data_received(frame(PING, 0, 0, bytes(8)))
    await turns()
    assert transport.aborted, "the connection aborted once its unsent bytes passed the hard bound"


@pytest.mark.timeout(30)
async def test_control_frames_queued_unsent_past_the_limit_are_a_flood():
    for unsent in (0, 1):  # 1: the client has left something unread, so nothing it is owed has gone out
        connection, transport = in_process(SMALL)
        await turns()
        transport.unsent = unsent
        for _ in range(2):
            connection.data_received(frame(PING, 0, 0, bytes(8)) * (SMALL.queued_control_frames // 2 + 1))
            await turns()
        assert goaway_code(transport) == (ENHANCE_YOUR_CALM if unsent else None), \
            f"GOAWAY ENHANCE_YOUR_CALM only when the ACKs stay unsent: {goaway_code(transport)} with {unsent=}"
