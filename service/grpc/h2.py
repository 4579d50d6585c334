"""gRPC's HTTP/2, served by us: one asyncio protocol per connection reads frames, keeps both
directions' flow-control windows, decodes header blocks (``hpack``) and runs each call
(``service.grpc.calls``) in a task; what a turn of the event loop answers goes out in one write.

What a gRPC server needs of RFC 9113 is here: SETTINGS, PING, GOAWAY (sent on drain, refused
streams after it), RST_STREAM (cancels the call), HEADERS with CONTINUATION, padding and priority,
flow control on every DATA frame both ways, and frame and header-list limits. Not here: server
push, TLS (clients speak HTTP/2 with prior knowledge, as gRPC does without TLS), message encodings
other than gzip and deflate (answered UNIMPLEMENTED).

What a client can make a connection hold is bounded (``Limits``, and the constants below after
nghttp2's and Envoy's defaults): requests in flight (reading pauses at the cap), the receive windows
(DATA beyond them is a connection error; a stream's window comes back as its handler takes its
messages), bytes written and not yet sent (reading pauses past a high-water mark, a client that lets
them pass a hard bound is cut off), work per event-loop turn, and floods of control frames, empty
frames and CONTINUATIONs (GOAWAY ENHANCE_YOUR_CALM)."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from dataclasses import dataclass

from hpack import Decoder
from hpack.exceptions import HPACKError

from fusedserve.service.grpc import calls
from fusedserve.service.grpc.h2_wire import (ACK, CONTINUATION, DATA, DEFAULT_WINDOW, END_HEADERS, END_STREAM,
                                        ENHANCE_YOUR_CALM, GOAWAY, HEADERS, INITIAL_WINDOW_SIZE,
                                        MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE, MAX_WINDOW,
                                        NO_ERROR, PADDED, PING, PREFACE, PROTOCOL_ERROR, PUSH_PROMISE,
                                        REFUSED_STREAM, RST_STREAM, SETTINGS, U32, WINDOW_UPDATE, WITH_PRIORITY,
                                        COMPRESSION_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, changes_table,
                                        frame)

log = logging.getLogger("fusedserve")

FRAME_LIMIT = 16384  # the largest frame we accept: the protocol's default, never raised
RECV_WINDOW = 1 << 24  # what a client may send on the connection, and at least on each stream, unread by us
MAX_STREAMS = 1024  # calls open at once on one connection
MAX_HEADER_LIST = 1 << 16
# The window we give back as we read lets a client start many large requests at once: a connection
# holds at most this many largest messages unfinished (checked once one stream holds HELD_CHECK bytes).
HELD_MESSAGES, HELD_CHECK = 8, 1 << 16
OPENED_CACHE = 64  # header blocks remembered per connection (a client sends the same few again and again)
# Stream ids remembered: those opened among the last this many ids. HEADERS on one is late trailers;
# on any other id below the highest opened, an error.
RECENT_IDS = 2 * MAX_STREAMS
# Frames (or bytes) one connection's reads are handled in per event-loop turn, the rest on later turns
# with reading paused: a megabyte read cannot hold the loop from every other connection.
SLICE_FRAMES, SLICE_BYTES = 256, 1 << 16
# Floods, answered GOAWAY ENHANCE_YOUR_CALM:
EMPTY_FRAMES = 1  # DATA/HEADERS/CONTINUATION frames in a row with nothing in them, no END_STREAM (Envoy: 1)
CONTINUATIONS = 8  # CONTINUATION frames in one header block (nghttp2: 8); 64 KiB of headers needs 4
SETTINGS_ENTRIES = 32  # entries in one SETTINGS frame (nghttp2: 32); gRPC clients send a handful
# PINGs, SETTINGS, RST_STREAMs and streams refused without a call each draw from a token bucket this
# deep, refilled this many a second: nghttp2's RST_STREAM rate limit (1000, 33/s), applied to each.
FLOOD_BURST, FLOOD_RATE = 1000, 33.0
# Frames that ask nothing of us (PRIORITY, unknown types, ACKs we did not ask for, GOAWAYs, header
# blocks on closed streams) past this many per stream the client opened (Envoy's PRIORITY limit, 100),
# and WINDOW_UPDATEs past this many per DATA frame we sent or stream opened (Envoy's, 10).
IDLE_PER_STREAM, WINDOW_UPDATES_PER_DATA = 100, 10
# Bytes unsent, in the transport or held for the client's window, past this many high-water marks:
# the client is not reading (the transport's: cut off; held: new streams refused).
WRITE_HARD = 16
CLOSE_LINGER_S = 5.0  # a closed connection whose client reads nothing more is aborted after this long
NOT_GRPC = b"\x00\x07:status\x03415"  # the answer to a request that is no gRPC call


@dataclass(frozen=True)
class Limits:
    """What one client may make its connection hold; Settings' grpc_* fields give the defaults and why."""
    calls_per_connection: int  # requests in flight (handlers running, stream requests unanswered)
    calls_per_stream: int  # a streaming call's requests taken by its handler and not yet answered
    write_buffer_bytes: int  # the transport's high-water mark
    queued_control_frames: int  # PING/SETTINGS ACKs and RST_STREAMs written and not yet sent

    @classmethod
    def of(cls, settings) -> Limits:
        return cls(settings.grpc_calls_per_connection, settings.grpc_calls_per_stream,
                   settings.grpc_write_buffer_bytes, settings.grpc_max_queued_control_frames)


class Bucket:
    """A token bucket for one kind of frame a flood is made of (FLOOD_BURST, FLOOD_RATE)."""

    __slots__ = ("tokens", "stamp")

    def __init__(self, now: float):
        self.tokens, self.stamp = float(FLOOD_BURST), now

    def take(self, now: float) -> bool:
        self.tokens = min(float(FLOOD_BURST), self.tokens + (now - self.stamp) * FLOOD_RATE) - 1
        self.stamp = now
        return self.tokens >= 0


class H2Error(Exception):
    """A connection error: answered with GOAWAY and the connection closed."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Stream:
    """One call: what has come in, and what waits for the client's window to go out."""

    __slots__ = ("id", "method", "body", "unread", "recv_window", "send_window", "out", "trailers", "headed", "task",
                 "running", "inbox", "queued", "in_flight", "waiter", "remote_closed", "context")

    def __init__(self, stream_id: int, method: calls.Method, send_window: int, recv_window: int,
                 context: calls.CallContext):
        self.id, self.method, self.context = stream_id, method, context
        self.body = bytearray()  # bytes of messages not yet whole (or not yet in the inbox)
        self.unread = 0  # bytes read (a stream's: taken by its handler) since its last WINDOW_UPDATE
        self.recv_window = recv_window  # what the client may still send on it
        self.send_window = send_window
        self.out = bytearray()
        self.trailers: bytes | None = None
        self.headed = False
        self.task: asyncio.Task | None = None
        self.running = False  # a unary call's handler runs (it counts in the connection's in_flight)
        # A streaming call's whole messages (and their bytes on the wire) its handler has yet to take.
        self.inbox: deque[tuple[bytes, int]] | None = deque() if method.streaming else None
        self.queued = 0  # the inbox's bytes on the wire
        self.in_flight = 0  # requests the handler took and has not answered yet
        self.waiter: asyncio.Future | None = None  # the handler, waiting for a message it may take
        self.remote_closed = False


class Connection(asyncio.Protocol):
    """One client's HTTP/2 connection. ``server`` (service.grpc.server.GrpcServer) holds the methods by
    path, ``refuse``, ``max_message``, the connections' ``limits``, whether it is ``draining`` and its
    open ``connections``."""

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
        # A header block awaiting CONTINUATION: its stream, flags, bytes so far and [CONTINUATIONs so far].
        self.block: tuple[int, int, bytearray, list[int]] | None = None
        self.opened: dict[bytes, tuple] = {}  # header block -> open_call's answer, while the table holds
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for a window
        self.failed = False  # a connection error was answered: nothing more is read
        self._out: list[bytes] = []
        self.limits: Limits = server.limits
        # A stream's window comes back only as its handler takes whole messages: it must hold the largest.
        self.stream_window = min(MAX_WINDOW, max(RECV_WINDOW, server.max_message + 5))
        self.check_at = min(HELD_CHECK, server.max_message + 5)  # a stream holding more is checked (_fits)
        self.recv_window = RECV_WINDOW  # what the client may still send on the connection
        self.recent: set[int] = set()  # the stream ids opened lately (RECENT_IDS)
        self.in_flight = 0  # requests in flight: unary handlers running, stream requests unanswered
        self.scheduled = False  # a later turn handles the rest of what was read
        self.reading = True
        self.writes_paused = False  # the transport's buffer passed its high-water mark
        self.control_queued = 0  # control frames written since the socket last took all we wrote
        self.empty = 0  # frames in a row that carried nothing
        self.buckets: dict[str, Bucket] = {}
        self.opened_total = self.data_sent = 0  # streams the client opened, DATA frames we sent
        self.idle_frames = self.window_updates = 0  # frames that asked nothing of us; WINDOW_UPDATEs

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.watch = None  # what service.connections' timers know of this connection
        policy = getattr(self.server, "policy", None)  # a test's stand-in server may have none
        if policy is not None and not policy.admit(self):  # over the cap or the descriptor budget
            self.failed = True
            return
        self.server.connections.add(self)
        transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)
        settings = b"".join(struct.pack(">HI", key, value) for key, value in (
            (MAX_CONCURRENT_STREAMS, MAX_STREAMS), (INITIAL_WINDOW_SIZE, self.stream_window),
            (MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))
        self.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, U32.pack(RECV_WINDOW - DEFAULT_WINDOW)))
        if self.server.draining:
            self.go_away()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        for stream in self.streams.values():
            self._cancel(stream)
        self.streams.clear()
        self.transport = None

    def write(self, data: bytes, control: bool = False) -> None:
        """Queue ``data`` (a ``control`` frame: an ACK or a reset the client's frames called for);
        everything queued in one event-loop turn goes out in one write."""
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(data)
        self.control_queued += control

    def _flush(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing() and self._out:
            transport.write(b"".join(self._out))
            unsent = transport.get_write_buffer_size()
            if not unsent:
                self.control_queued = 0
            elif unsent > WRITE_HARD * self.limits.write_buffer_bytes:
                log.info("gRPC connection cut off: %d bytes written to it are unsent (the client reads nothing)",
                         unsent)
                transport.abort()
        self._out.clear()
        if self.goaway_id is not None and not self.streams:
            self.close()

    def pause_writing(self) -> None:
        self.writes_paused = True
        self._reading()

    def resume_writing(self) -> None:
        self.writes_paused = False
        self._unblock()

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
            self.loop.call_later(CLOSE_LINGER_S, self._abort)

    def _abort(self) -> None:
        if self.transport is not None:  # still unsent: connection_lost has not come
            self.transport.abort()

    def _fail(self, error: H2Error) -> None:
        log.info("gRPC connection closed: %s", error)
        self.failed = True
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_id, error.code) + str(error).encode()[:256]))
        self.goaway_id = self.last_id
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        self.buffer.clear()

    def data_received(self, data: bytes) -> None:
        if self.watch is not None and not self.watch.greeted:  # the handshake deadline's clock
            self.watch.greet(data)
        if self.failed:
            return
        self.buffer += data
        if not self.scheduled:
            self._work()

    def _work(self) -> None:
        """Handle one slice of what was read; the rest on a later turn, reading paused till then."""
        self.scheduled = False
        if self.failed or self.transport is None:
            return
        try:
            if self.preface or self._preface():
                self._frames()
        except H2Error as error:
            self._fail(error)
            return
        self._reading()

    def _preface(self) -> bool:
        buffer = self.buffer
        if buffer[:len(PREFACE)] != PREFACE[:len(buffer)]:
            raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 client preface")
        if len(buffer) < len(PREFACE):
            return False
        del buffer[:len(PREFACE)]
        self.preface = True
        return True

    def _frames(self) -> None:
        buffer, pos, handled, cap = self.buffer, 0, 0, self.limits.calls_per_connection
        try:
            while len(buffer) - pos >= 9 and not self.writes_paused and self.in_flight < cap:  # _held(), inlined
                if handled == SLICE_FRAMES or pos >= SLICE_BYTES:
                    self.scheduled = True
                    self.loop.call_soon(self._work)
                    return
                length = (buffer[pos] << 16) | (buffer[pos + 1] << 8) | buffer[pos + 2]
                if length > FRAME_LIMIT:
                    raise H2Error(FRAME_SIZE_ERROR, f"a frame of {length} bytes; the limit is {FRAME_LIMIT}")
                if len(buffer) - pos < 9 + length:
                    return
                kind, flags = buffer[pos + 3], buffer[pos + 4]
                stream_id = U32.unpack_from(buffer, pos + 5)[0] & 0x7FFFFFFF
                payload = bytes(buffer[pos + 9:pos + 9 + length])
                pos += 9 + length
                handled += 1
                self._frame(kind, flags, stream_id, payload)
                if self.control_queued > self.limits.queued_control_frames:
                    raise H2Error(ENHANCE_YOUR_CALM, f"more than {self.limits.queued_control_frames} control frames "
                                                     "queued unsent: read what the server writes")
        finally:
            del buffer[:pos]

    def _held(self) -> bool:
        """Whether frames wait: the client reads too little of what we write, or holds its cap of calls."""
        return self.writes_paused or self.in_flight >= self.limits.calls_per_connection

    def _reading(self) -> None:
        """Read from the client only while nothing read waits to be handled."""
        want = not (self.scheduled or self._held())
        transport = self.transport
        if want != self.reading and transport is not None and not transport.is_closing():
            self.reading = want
            (transport.resume_reading if want else transport.pause_reading)()

    def _unblock(self) -> None:
        """Go on with what was read, once nothing holds it: wake the streams the cap held, handle the rest."""
        if self._held() or self.transport is None or self.failed:
            return
        for stream in self.streams.values():
            self._wake(stream)
        if self.buffer and not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._work)
        self._reading()

    def _answered(self, n: int) -> None:
        """``n`` requests in flight were answered (or dropped)."""
        held = self.in_flight >= self.limits.calls_per_connection
        self.in_flight -= n
        if held and n:
            self._unblock()

    def _flood(self, kind: str) -> None:
        """Draw one ``kind`` (PINGs, ...) from its bucket: none left is a flood."""
        now = self.loop.time()
        bucket = self.buckets.get(kind)
        if bucket is None:
            bucket = self.buckets[kind] = Bucket(now)
        if not bucket.take(now):
            raise H2Error(ENHANCE_YOUR_CALM, f"more than {FLOOD_BURST} {kind}, {FLOOD_RATE:g} a second after that")

    def _idle(self) -> None:
        """One more frame that asks nothing of us."""
        self.idle_frames += 1
        if self.idle_frames > IDLE_PER_STREAM * (1 + self.opened_total):
            raise H2Error(ENHANCE_YOUR_CALM, f"more than {IDLE_PER_STREAM} frames that ask nothing per stream opened")

    def _count_empty(self, empty: bool) -> None:
        if not empty:
            self.empty = 0
            return
        self.empty += 1
        if self.empty > EMPTY_FRAMES:
            raise H2Error(ENHANCE_YOUR_CALM, f"{self.empty} frames in a row with nothing in them")

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
            self.window_updates += 1
            if self.window_updates > WINDOW_UPDATES_PER_DATA * (1 + self.data_sent + self.opened_total):
                raise H2Error(ENHANCE_YOUR_CALM, f"more than {WINDOW_UPDATES_PER_DATA} WINDOW_UPDATEs per DATA "
                                                 "frame sent")
            self._window_update(stream_id, payload)
        elif kind == PING:
            self._ping(flags, stream_id, payload)
        elif kind == RST_STREAM:
            self._client_reset(stream_id, payload)
        elif kind == GOAWAY:
            self._idle()
            self.go_away()  # the client sends no more: answer what it sent, then close
        elif kind == PUSH_PROMISE:
            raise H2Error(PROTOCOL_ERROR, "a client may not push")
        else:  # PRIORITY and unknown frame types are ignored, as the protocol asks
            self._idle()

    def _never_opened(self, stream_id: int, what: str) -> None:
        if stream_id > self.last_id:  # an idle stream (RFC 9113 section 5.1)
            raise H2Error(PROTOCOL_ERROR, f"{what} on stream {stream_id}, which the client never opened")

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 8 or stream_id:
            raise H2Error(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "a malformed PING")
        if flags & ACK:
            self._idle()  # we send no PING
        else:
            self._flood("PINGs")
            self.write(frame(PING, ACK, 0, payload), control=True)

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
            self._idle()
            return
        self._flood("SETTINGS frames")
        if len(payload) > 6 * SETTINGS_ENTRIES:
            raise H2Error(ENHANCE_YOUR_CALM, f"{len(payload) // 6} entries in one SETTINGS frame; "
                                             f"the limit is {SETTINGS_ENTRIES}")
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
        self.write(frame(SETTINGS, ACK, 0), control=True)
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
                                                                      else FLOW_CONTROL_ERROR)), control=True)
        else:
            self._never_opened(stream_id, "WINDOW_UPDATE")
        self._resume()

    def _client_reset(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4 or not stream_id:
            raise H2Error(FRAME_SIZE_ERROR if stream_id else PROTOCOL_ERROR, "a malformed RST_STREAM")
        self._never_opened(stream_id, "RST_STREAM")
        self._flood("RST_STREAM frames")
        self._reset(stream_id)

    def _reset(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        self.blocked.pop(stream_id, None)
        if stream is not None:
            self._cancel(stream)

    def _cancel(self, stream: Stream) -> None:
        self._call_over(stream)
        if stream.task is not None:
            stream.task.cancel()

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or not stream_id & 1:
            raise H2Error(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}: a client opens odd streams")
        payload = self._unpad(flags, payload)
        if flags & WITH_PRIORITY:
            payload = payload[5:]
        if payload or flags & END_STREAM:
            self.empty = 0
        else:
            self._count_empty(True)
        self.block = (stream_id, flags, bytearray(payload), [0])
        if flags & END_HEADERS:
            self._header_block_done()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.block is None:
            raise H2Error(PROTOCOL_ERROR, "CONTINUATION without a header block")
        self._count_empty(not payload)
        _, _, block, continued = self.block
        continued[0] += 1
        if continued[0] > CONTINUATIONS:
            raise H2Error(ENHANCE_YOUR_CALM, f"more than {CONTINUATIONS} CONTINUATION frames in one header block")
        block.extend(payload)
        if len(block) > MAX_HEADER_LIST:
            raise H2Error(PROTOCOL_ERROR, "a header block above the header list limit")
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        stream_id, flags, block, _ = self.block
        self.block = None
        block = bytes(block)
        opened = self.opened.get(block)  # a block seen before that left the table alone: no decoding
        headers, key = (None, None) if opened is not None else self._decode(block)
        if stream_id in self.streams:  # trailers from the client end its side
            if flags & END_STREAM:
                self._received(self.streams[stream_id], ended=True)
            else:
                self._idle()
            return
        if stream_id <= self.last_id:
            if stream_id in self.recent:  # a stream already answered or refused: its trailers are moot
                self._idle()
                return
            raise H2Error(PROTOCOL_ERROR, f"a new stream {stream_id} after stream {self.last_id}: a client's "
                                          "stream ids must grow (RFC 9113 section 5.1.1)")
        self.last_id = stream_id
        self.opened_total += 1
        self.recent.add(stream_id)
        if len(self.recent) > RECENT_IDS:  # forget those now too old, all at once
            self.recent = {i for i in self.recent if i > stream_id - RECENT_IDS}
        if ((self.goaway_id is not None and stream_id > self.goaway_id) or len(self.streams) >= MAX_STREAMS
                or (self.blocked and self._unsent() > WRITE_HARD * self.limits.write_buffer_bytes)):
            self._flood("streams refused")
            self.write(frame(RST_STREAM, 0, stream_id, U32.pack(REFUSED_STREAM)), control=True)
            return
        self._open(stream_id, flags, key, headers, opened)

    def _unsent(self) -> int:
        """Bytes of answers held for the client's windows."""
        return sum(len(stream.out) for stream in self.blocked.values())

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
            opened = self._open_call(headers)
            if key is not None:
                if len(self.opened) >= OPENED_CACHE:  # one-off blocks (a new grpc-timeout each call) filled it
                    self.opened.clear()
                self.opened[key] = opened
        if isinstance(opened, bytes):  # refused: the header block that answers it
            self._flood("streams refused")
            self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, opened))
            return
        method, timeout, metadata, encoding = opened
        context = calls.CallContext(None if timeout is None else self.loop.time() + timeout, metadata, encoding)
        stream = Stream(stream_id, method, self.peer_window, self.stream_window, context)
        self.streams[stream_id] = stream
        if method.streaming:
            stream.task = self.loop.create_task(calls.stream_call(self, stream))
            stream.task.add_done_callback(lambda _: self._stream_done(stream))
        if flags & END_STREAM:
            self._received(stream, ended=True)

    def _open_call(self, headers) -> tuple | bytes:
        """open_call's answer, or the header block that refuses the call (HTTP 415, or a gRPC status)."""
        try:
            return calls.open_call(self.server.methods, self.server.refuse, headers)
        except calls.NotGrpc:
            return NOT_GRPC
        except calls.Abort as abort:
            return calls.RESPONSE_HEADERS + calls.status_block(abort.code, abort.message)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise H2Error(PROTOCOL_ERROR, "DATA on stream 0")
        if stream_id > self.last_id:
            self._never_opened(stream_id, "DATA")
        self.recv_window -= len(payload)
        if self.recv_window < 0:
            raise H2Error(FLOW_CONTROL_ERROR, "DATA beyond the connection's window: wait for WINDOW_UPDATE")
        self.unread += len(payload)
        if self.unread >= RECV_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.unread)))
            self.recv_window += self.unread
            self.unread = 0
        data = self._unpad(flags, payload)
        if data or flags & END_STREAM:
            self.empty = 0
        else:
            self._count_empty(True)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:  # answered, reset, or refused already: drop
            return
        stream.recv_window -= len(payload)
        if stream.recv_window < 0:
            raise H2Error(FLOW_CONTROL_ERROR, f"DATA beyond stream {stream_id}'s window: wait for WINDOW_UPDATE")
        stream.body += data
        if len(stream.body) + stream.queued > self.check_at and not self._fits(stream):
            return
        if stream.inbox is not None or flags & END_STREAM:
            self._received(stream, ended=bool(flags & END_STREAM))
            if flags & END_STREAM or self.streams.get(stream_id) is not stream:
                return
        # A unary call's window comes back as its bytes arrive (max_message caps its body); a stream's
        # as its handler takes its messages (next_message), but for padding.
        self._consumed(stream, len(payload) if stream.inbox is None else len(payload) - len(data))

    def _fits(self, stream: Stream) -> bool:
        """Whether the call may hold what it was sent; if not it is refused."""
        limit = self.server.max_message
        if stream.inbox is None and len(stream.body) > limit + 5:
            why = f"the request message is larger than the server's limit of {limit} bytes"
        elif len(stream.body) + stream.queued > HELD_CHECK and self._held_bytes() > HELD_MESSAGES * (limit + 5):
            why = "this connection holds too many unfinished large requests: finish some, or open another connection"
        else:
            return True
        self._refuse(stream, calls.Abort("RESOURCE_EXHAUSTED", why))
        return False

    def _held_bytes(self) -> int:
        return sum(len(s.body) + s.queued for s in self.streams.values())

    def _consumed(self, stream: Stream, n: int) -> None:
        """``n`` more of the stream's bytes are read: its window comes back half of it at a time."""
        stream.unread += n
        if stream.unread >= self.stream_window // 2 and not stream.remote_closed:
            self.write(frame(WINDOW_UPDATE, 0, stream.id, U32.pack(stream.unread)))
            stream.recv_window += stream.unread
            stream.unread = 0

    def _received(self, stream: Stream, ended: bool) -> None:
        """Hand whole messages to the call: a stream's to its inbox as they come, a unary call's once it ended."""
        if ended:
            stream.remote_closed = True
        try:
            if stream.inbox is not None:
                self._fill(stream)
                self._wake(stream)
            elif ended:
                taken = calls.take_message(stream.body, stream.context.encoding, self.server.max_message)
                if taken is None or stream.body:
                    raise calls.Abort("INTERNAL", "a unary call carries exactly one whole request message")
                self.in_flight += 1
                stream.running = True
                stream.task = self.loop.create_task(calls.unary_call(self, stream, taken[0]))
        except calls.Abort as abort:
            self._refuse(stream, abort)

    def _fill(self, stream: Stream) -> None:
        """Move whole messages from a stream's body to its inbox, which holds at most calls_per_stream."""
        while len(stream.inbox) < self.limits.calls_per_stream:
            taken = calls.take_message(stream.body, stream.context.encoding, self.server.max_message)
            if taken is None:
                return
            stream.inbox.append(taken)
            stream.queued += taken[1]

    async def next_message(self, stream: Stream) -> bytes | None:
        """A streaming call's next request message for its handler (None once the client ended the
        stream), taken while the stream and the connection are under their caps of requests
        unanswered and the stream's answers go out; its window comes back as it is taken."""
        while True:
            if stream.inbox and self._may_take(stream):
                message, size = stream.inbox.popleft()
                stream.queued -= size
                stream.in_flight += 1
                self.in_flight += 1
                self._fill(stream)
                self._consumed(stream, size)
                return message
            if not stream.inbox and stream.remote_closed:
                if stream.body:
                    raise calls.Abort("INTERNAL", "the stream ended inside a message")
                return None
            stream.waiter = self.loop.create_future()
            try:
                await stream.waiter
            finally:
                stream.waiter = None

    def _may_take(self, stream: Stream) -> bool:
        limits = self.limits
        return (stream.in_flight < limits.calls_per_stream and self.in_flight < limits.calls_per_connection
                and len(stream.out) <= limits.write_buffer_bytes)

    @staticmethod
    def _wake(stream: Stream) -> None:
        if stream.waiter is not None and not stream.waiter.done():
            stream.waiter.set_result(None)

    def _call_over(self, stream: Stream) -> None:
        """A unary call's handler finished, or was cancelled: it is in flight no more."""
        if stream.running:
            stream.running = False
            self._answered(1)

    def _stream_done(self, stream: Stream) -> None:
        """A streaming call's handler ended: what it took and left unanswered is in flight no more."""
        n, stream.in_flight = stream.in_flight, 0
        self._answered(n)

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
        if stream.in_flight:  # a streaming call answered one of its requests
            stream.in_flight -= 1
            self._answered(1)
            self._wake(stream)
        if not stream.headed:
            stream.headed = True
            self.write(frame(HEADERS, END_HEADERS, stream.id, calls.RESPONSE_HEADERS))
        data = calls.length_prefixed(message)
        if not stream.out and len(data) <= min(self.send_window, stream.send_window, self.peer_frame):
            self.send_window -= len(data)
            stream.send_window -= len(data)
            self.data_sent += 1
            self.write(frame(DATA, 0, stream.id, data))
        else:
            stream.out += data
            self._pump(stream)

    def finish(self, stream: Stream, code: str, message: str) -> None:
        """End the call with its status; the stream closes once its data has gone out."""
        if stream.running:
            self._call_over(stream)
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
            self.data_sent += 1
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
            self.write(frame(RST_STREAM, 0, stream.id, U32.pack(NO_ERROR)), control=True)

    def _resume(self) -> None:
        for stream in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            self._pump(stream)
            self._wake(stream)  # a handler held back by its unsent answers


