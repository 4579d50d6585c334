"""gRPC's HTTP/2, served by us: one asyncio protocol per connection reads frames, keeps both
directions' flow-control windows, decodes header blocks (``hpack``) and runs each call
(``service.grpc_calls``) in a task; what a turn of the event loop answers goes out in one write.

What a gRPC server needs of RFC 9113 is here: SETTINGS, PING, GOAWAY (sent on drain, refused
streams after it), RST_STREAM (cancels the call), HEADERS with CONTINUATION, padding and priority,
flow control on every DATA frame both ways, and frame and header-list limits. Not here: server
push, TLS (clients speak HTTP/2 with prior knowledge, as gRPC does without TLS), compressed
messages (answered UNIMPLEMENTED)."""

from __future__ import annotations

import asyncio
import logging
import struct

from hpack import Decoder
from hpack.exceptions import HPACKError

from fusedserve.service import grpc_calls as calls
from fusedserve.service.h2_wire import (ACK, CONTINUATION, DATA, DEFAULT_WINDOW, END_HEADERS, END_STREAM, GOAWAY,
                                        HEADERS, INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE,
                                        MAX_HEADER_LIST_SIZE, MAX_WINDOW, NO_ERROR, PADDED, PING, PREFACE,
                                        PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM, RST_STREAM, SETTINGS, U32,
                                        WINDOW_UPDATE, WITH_PRIORITY, COMPRESSION_ERROR, FLOW_CONTROL_ERROR,
                                        FRAME_SIZE_ERROR, changes_table, frame)

log = logging.getLogger("fusedserve")

FRAME_LIMIT = 16384  # the largest frame we accept: the protocol's default, never raised
RECV_WINDOW = 1 << 24  # what a client may send, per stream and per connection, before we say we read it
MAX_STREAMS = 1024  # calls open at once on one connection
MAX_HEADER_LIST = 1 << 16
# The window we give back as we read lets a client start many large requests at once: a connection
# holds at most this many largest messages unfinished (checked once one stream holds HELD_CHECK bytes).
HELD_MESSAGES, HELD_CHECK = 8, 1 << 16
OPENED_CACHE = 64  # header blocks remembered per connection (a client sends the same few again and again)


class H2Error(Exception):
    """A connection error: answered with GOAWAY and the connection closed."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Stream:
    """One call: what has come in, and what waits for the client's window to go out."""

    __slots__ = ("id", "method", "body", "unread", "send_window", "out", "trailers", "headed", "task", "inbox",
                 "remote_closed", "context")

    def __init__(self, stream_id: int, method: calls.Method, send_window: int, context: calls.CallContext):
        self.id, self.method, self.context = stream_id, method, context
        self.body = bytearray()
        self.unread = 0  # bytes received since the last WINDOW_UPDATE for this stream
        self.send_window = send_window
        self.out = bytearray()
        self.trailers: bytes | None = None
        self.headed = False
        self.task: asyncio.Task | None = None
        self.inbox: asyncio.Queue | None = asyncio.Queue() if method.streaming else None
        self.remote_closed = False


class Connection(asyncio.Protocol):
    """One client's HTTP/2 connection. ``server`` (service.grpc_server.GrpcServer) holds the methods by
    path, ``refuse``, ``max_message``, whether it is ``draining`` and its open ``connections``."""

    def __init__(self, server):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.buffer = bytearray()
        self.preface = False
        self.decoder = Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_LIST
        self.streams: dict[int, Stream] = {}
        self.last_id = 0  # the highest stream the client opened
        self.goaway_id: int | None = None  # once GOAWAY is sent: streams above it are refused
        self.send_window = DEFAULT_WINDOW
        self.peer_window = DEFAULT_WINDOW  # the client's initial window for each new stream
        self.peer_frame = FRAME_LIMIT
        self.unread = 0  # bytes received since the last connection WINDOW_UPDATE
        self.block: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self.opened: dict[bytes, tuple] = {}  # header block -> open_call's answer, while the table holds
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for a window
        self.failed = False  # a connection error was answered: nothing more is read
        self._out: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.watch = None  # what service.connections' timers know of this connection
        policy = getattr(self.server, "policy", None)  # a test's stand-in server may have none
        if policy is not None and not policy.admit(self):  # over the cap or the descriptor budget
            self.failed = True
            return
        self.server.connections.add(self)
        settings = b"".join(struct.pack(">HI", key, value) for key, value in (
            (MAX_CONCURRENT_STREAMS, MAX_STREAMS), (INITIAL_WINDOW_SIZE, RECV_WINDOW),
            (MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))
        self.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, U32.pack(RECV_WINDOW - DEFAULT_WINDOW)))
        if self.server.draining:
            self.go_away()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        for stream in self.streams.values():
            if stream.task is not None:
                stream.task.cancel()
        self.streams.clear()
        self.transport = None

    def write(self, data: bytes) -> None:
        """Queue ``data``; everything queued in one event-loop turn goes out in one write."""
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()
        if self.goaway_id is not None and not self.streams:
            self.close()

    def go_away(self) -> None:
        """Say no stream after the last one opened will be served; close once those are answered."""
        if self.goaway_id is None:
            self.goaway_id = self.last_id
            self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_id, NO_ERROR)))

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if self._out:
                self.transport.write(b"".join(self._out))
                self._out.clear()
            self.transport.close()

    def _fail(self, error: H2Error) -> None:
        log.info("gRPC connection closed: %s", error)
        self.failed = True
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_id, error.code) + str(error).encode()[:256]))
        self.goaway_id = self.last_id
        for stream in list(self.streams.values()):
            if stream.task is not None:
                stream.task.cancel()
        self.streams.clear()
        self.buffer.clear()

    def data_received(self, data: bytes) -> None:
        if self.watch is not None and not self.watch.greeted:  # the handshake deadline's clock
            self.watch.greet(data)
        if self.failed:
            return
        buffer = self.buffer
        buffer += data
        if not self.preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._fail(H2Error(PROTOCOL_ERROR, "not an HTTP/2 client preface"))
                return
            if buffer[:len(PREFACE)] != PREFACE:
                return self._fail(H2Error(PROTOCOL_ERROR, "not an HTTP/2 client preface"))
            del buffer[:len(PREFACE)]
            self.preface = True
        pos, size = 0, len(buffer)
        try:
            while size - pos >= 9:
                length = (buffer[pos] << 16) | (buffer[pos + 1] << 8) | buffer[pos + 2]
                if length > FRAME_LIMIT:
                    raise H2Error(FRAME_SIZE_ERROR, f"a frame of {length} bytes; the limit is {FRAME_LIMIT}")
                if size - pos < 9 + length:
                    break
                kind, flags = buffer[pos + 3], buffer[pos + 4]
                stream_id = U32.unpack_from(buffer, pos + 5)[0] & 0x7FFFFFFF
                payload = bytes(buffer[pos + 9:pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream_id, payload)
        except H2Error as error:
            self._fail(error)
            return
        del buffer[:pos]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.block is not None and (kind != CONTINUATION or stream_id != self.block[0]):
            raise H2Error(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise H2Error(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "a malformed PING")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self._reset(stream_id, payload)
        elif kind == GOAWAY:
            self.go_away()  # the client sends no more: answer what it sent, then close
        elif kind == PUSH_PROMISE:
            raise H2Error(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored, as the protocol asks.

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise H2Error(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1:len(payload) - payload[0]]

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id or len(payload) % 6 or (flags & ACK and payload):
            raise H2Error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "a malformed SETTINGS frame")
        if flags & ACK:
            return
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(FLOW_CONTROL_ERROR, f"initial window {value} is above 2^31-1")
                for stream in self.streams.values():
                    stream.send_window += value - self.peer_window
                self.peer_window = value
            elif key == MAX_FRAME_SIZE:
                if not FRAME_LIMIT <= value <= 2**24 - 1:
                    raise H2Error(PROTOCOL_ERROR, f"max frame size {value} is out of range")
                self.peer_frame = value
        self.write(frame(SETTINGS, ACK, 0))
        self._resume()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame is 4 bytes")
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise H2Error(PROTOCOL_ERROR, "a zero window increment")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2Error(FLOW_CONTROL_ERROR, "the connection's window passed 2^31-1")
        elif (stream := self.streams.get(stream_id)) is not None:
            stream.send_window += increment
            if not increment or stream.send_window > MAX_WINDOW:
                self._reset(stream_id)
                self.write(frame(RST_STREAM, 0, stream_id, U32.pack(PROTOCOL_ERROR if not increment
                                                                      else FLOW_CONTROL_ERROR)))
        self._resume()

    def _reset(self, stream_id: int, payload: bytes = b"\0\0\0\0") -> None:
        if len(payload) != 4 or not stream_id:
            raise H2Error(FRAME_SIZE_ERROR if stream_id else PROTOCOL_ERROR, "a malformed RST_STREAM")
        stream = self.streams.pop(stream_id, None)
        self.blocked.pop(stream_id, None)
        if stream is not None and stream.task is not None:
            stream.task.cancel()

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or not stream_id & 1:
            raise H2Error(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}: a client opens odd streams")
        payload = self._unpad(flags, payload)
        if flags & WITH_PRIORITY:
            payload = payload[5:]
        self.block = (stream_id, flags, bytearray(payload))
        if flags & END_HEADERS:
            self._header_block_done()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.block is None:
            raise H2Error(PROTOCOL_ERROR, "CONTINUATION without a header block")
        self.block[2].extend(payload)
        if len(self.block[2]) > MAX_HEADER_LIST:
            raise H2Error(PROTOCOL_ERROR, "a header block above the header list limit")
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        stream_id, flags, block = self.block
        self.block = None
        block = bytes(block)
        opened = self.opened.get(block)  # a block seen before that left the table alone: no decoding
        headers, key = (None, None) if opened is not None else self._decode(block)
        if stream_id in self.streams:  # trailers from the client end its side
            if flags & END_STREAM:
                self._received(self.streams[stream_id], ended=True)
            return
        if stream_id <= self.last_id:  # a stream already answered or refused: its trailers are moot
            return
        self.last_id = stream_id
        if (self.goaway_id is not None and stream_id > self.goaway_id) or len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, stream_id, U32.pack(REFUSED_STREAM)))
            return
        self._open(stream_id, flags, key, headers, opened)

    def _decode(self, block: bytes) -> tuple[list, bytes | None]:
        """The block's headers, and the block itself where it may key the cache (it left the table alone)."""
        try:  # every block that changes the table is decoded, refused or not: ours must follow the client's
            headers = self.decoder.decode(block)
        except HPACKError as exc:
            raise H2Error(COMPRESSION_ERROR, f"a header block does not decode: {exc}") from None
        if changes_table(block):
            self.opened.clear()
            return headers, None
        return headers, block

    def _open(self, stream_id: int, flags: int, key: bytes | None, headers, opened) -> None:
        if opened is None:
            try:
                opened = calls.open_call(self.server.methods, self.server.refuse, headers)
            except calls.NotGrpc:
                self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, b"\x00\x07:status\x03415"))
                return
            except calls.Abort as abort:
                self.trailers_only(stream_id, abort.code, abort.message)
                return
            if key is not None:
                if len(self.opened) >= OPENED_CACHE:  # one-off blocks (a new grpc-timeout each call) filled it
                    self.opened.clear()
                self.opened[key] = opened
        method, timeout, metadata, encoding = opened
        context = calls.CallContext(None if timeout is None else self.loop.time() + timeout, metadata, encoding)
        stream = Stream(stream_id, method, self.peer_window, context)
        self.streams[stream_id] = stream
        if method.streaming:
            stream.task = self.loop.create_task(calls.stream_call(self, stream))
        if flags & END_STREAM:
            self._received(stream, ended=True)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise H2Error(PROTOCOL_ERROR, "DATA on stream 0")
        self.unread += len(payload)
        if self.unread >= RECV_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.unread)))
            self.unread = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:  # answered, reset, or refused already: drop
            return
        stream.body += self._unpad(flags, payload)
        if len(stream.body) > self.server.max_message + 5:
            self._refuse(stream, calls.Abort("RESOURCE_EXHAUSTED", f"the request message is larger than the "
                                                                  f"server's limit of {self.server.max_message} bytes"))
            return
        if len(stream.body) > HELD_CHECK and self._held() > HELD_MESSAGES * (self.server.max_message + 5):
            self._refuse(stream, calls.Abort("RESOURCE_EXHAUSTED", "this connection holds too many unfinished large "
                                                                  "requests: finish some, or open another connection"))
            return
        if stream.inbox is not None or flags & END_STREAM:
            self._received(stream, ended=bool(flags & END_STREAM))
            if flags & END_STREAM or self.streams.get(stream_id) is not stream:
                return
        stream.unread += len(payload)
        if stream.unread >= RECV_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, stream_id, U32.pack(stream.unread)))
            stream.unread = 0

    def _held(self) -> int:
        return sum(len(s.body) for s in self.streams.values())

    def _received(self, stream: Stream, ended: bool) -> None:
        """Hand whole messages to the call: a stream's as they come, a unary call's once it ended."""
        stream.remote_closed = ended
        try:
            messages = calls.take_messages(stream.body, stream.context.encoding, self.server.max_message)
            if stream.inbox is not None:
                for message in messages:
                    stream.inbox.put_nowait(message)
                if ended and stream.body:
                    raise calls.Abort("INTERNAL", "the stream ended inside a message")
                if ended:
                    stream.inbox.put_nowait(None)
            elif ended:
                if len(messages) != 1 or stream.body:
                    raise calls.Abort("INTERNAL", "a unary call carries exactly one whole request message")
                stream.task = self.loop.create_task(calls.unary_call(self, stream, messages[0]))
        except calls.Abort as abort:
            self._refuse(stream, abort)

    def _refuse(self, stream: Stream, abort: calls.Abort) -> None:
        """End a call on what it sent, its handler (a stream's, running) cancelled."""
        self.finish(stream, abort.code, abort.message)
        if stream.task is not None:
            stream.task.cancel()

    def trailers_only(self, stream_id: int, code: str, message: str) -> None:
        self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, calls.RESPONSE_HEADERS + calls.status_block(code, message)))

    def send_message(self, stream: Stream, message: bytes) -> None:
        if stream.id not in self.streams:
            return
        if not stream.headed:
            stream.headed = True
            self.write(frame(HEADERS, END_HEADERS, stream.id, calls.RESPONSE_HEADERS))
        data = calls.length_prefixed(message)
        if not stream.out and len(data) <= min(self.send_window, stream.send_window, self.peer_frame):
            self.send_window -= len(data)
            stream.send_window -= len(data)
            self.write(frame(DATA, 0, stream.id, data))
        else:
            stream.out += data
            self._pump(stream)

    def finish(self, stream: Stream, code: str, message: str) -> None:
        """End the call with its status; the stream closes once its data has gone out."""
        if self.streams.get(stream.id) is not stream or stream.trailers is not None:
            return
        if not stream.headed:
            self.streams.pop(stream.id)
            self.trailers_only(stream.id, code, message)
            self._close_remote(stream)
            return
        stream.trailers = calls.OK_TRAILERS if code == "OK" else calls.status_block(code, message)
        self._pump(stream)

    def _pump(self, stream: Stream) -> None:
        """Send what the windows allow of ``stream``'s data, then its trailers once all is out."""
        out = stream.out
        while out:
            n = min(len(out), self.send_window, stream.send_window, self.peer_frame)
            if n <= 0:
                self.blocked[stream.id] = stream
                return
            self.write(frame(DATA, 0, stream.id, bytes(out[:n])))
            del out[:n]
            self.send_window -= n
            stream.send_window -= n
        self.blocked.pop(stream.id, None)
        if stream.trailers is not None:
            self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, stream.trailers))
            self.streams.pop(stream.id, None)
            self._close_remote(stream)

    def _close_remote(self, stream: Stream) -> None:
        # Answered before the client finished sending: ask it to stop (RFC 9113 section 8.1).
        if not stream.remote_closed:
            stream.remote_closed = True
            self.write(frame(RST_STREAM, 0, stream.id, U32.pack(NO_ERROR)))

    def _resume(self) -> None:
        for stream in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            self._pump(stream)


