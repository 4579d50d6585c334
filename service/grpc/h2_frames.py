"""HTTP/2's frame layer under our gRPC connections (``service.grpc.h2`` keeps the streams on it): the
client preface, frames cut from what was read and handled a bounded slice per event-loop turn, the
connection's own frames (SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY), floods drawn against
``h2_limits``, what one turn writes sent in one write with backpressure both ways, and closing: GOAWAY
on drain, and on a connection error (``H2Error``)."""

from __future__ import annotations

import asyncio
import logging
import struct

from fusedserve.service.grpc.h2_limits import (
    CLOSE_LINGER_S,
    EMPTY_FRAMES,
    FLOOD_BURST,
    FLOOD_RATE,
    FRAME_LIMIT,
    IDLE_PER_STREAM,
    MAX_HEADER_LIST,
    MAX_STREAMS,
    RECV_WINDOW,
    SETTINGS_ENTRIES,
    SLICE_BYTES,
    SLICE_FRAMES,
    WINDOW_UPDATES_PER_DATA,
    WRITE_HARD,
    Bucket,
    Limits,
)
from fusedserve.service.grpc.h2_wire import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    frame,
)

log = logging.getLogger("fusedserve")


class H2Error(Exception):
    """A connection error: answered with GOAWAY and the connection closed."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class FrameConnection(asyncio.Protocol):
    """One client's HTTP/2 connection as frames: what it reads, what it writes, and the frames that are
    the connection's own. ``server`` (service.grpc.server.GrpcServer) holds ``max_message``, the
    connections' ``limits``, whether it is ``draining`` and its open ``connections``.

    The stream layer on it (``h2.Connection``) keeps ``streams`` and ``block``, takes the ``_data``,
    ``_headers`` and ``_continuation`` frames, and is asked to ``_reset`` a stream, to ``_resume``
    sending once windows grow and to ``_wake`` a handler once reading goes on; it cancels its streams
    when the connection fails or is lost."""

    def __init__(self, server):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.buffer = bytearray()
        self.preface = False
        self.streams: dict = {}  # the open streams (h2.Stream) by id: a GOAWAY closes once none is left
        self.last_id = 0  # the highest stream the client opened
        self.goaway_id: int | None = None  # once GOAWAY is sent: streams above it are refused
        self.send_window = DEFAULT_WINDOW
        self.peer_window = DEFAULT_WINDOW  # the client's initial window for each new stream
        self.peer_frame = FRAME_LIMIT
        self.unread = 0  # bytes received since the last connection WINDOW_UPDATE
        # A header block awaiting CONTINUATION: its stream, flags, bytes so far and [CONTINUATIONs so far].
        self.block: tuple[int, int, bytearray, list[int]] | None = None
        self.failed = False  # a connection error was answered: nothing more is read
        self._out: list[bytes] = []
        self.limits: Limits = server.limits
        # A stream's window comes back only as its handler takes whole messages: it must hold the largest.
        self.stream_window = min(MAX_WINDOW, max(RECV_WINDOW, server.max_message + 5))
        self.recv_window = RECV_WINDOW  # what the client may still send on the connection
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
        self.watch = None  # what service.grpc.policy's timers know of this connection
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
