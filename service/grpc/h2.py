"""gRPC's HTTP/2, served by us: one asyncio protocol per connection reads frames (``h2_frames``),
keeps both directions' flow-control windows, decodes header blocks (``hpack``) and runs each call
(``service.grpc.calls``) in a task; what a turn of the event loop answers goes out in one write. This
module is the streams: header blocks open calls, DATA brings their messages in within the windows we
give, and their answers go out as the client's windows allow.

What a gRPC server needs of RFC 9113 is here: SETTINGS, PING, GOAWAY (sent on drain, refused
streams after it), RST_STREAM (cancels the call), HEADERS with CONTINUATION, padding and priority,
flow control on every DATA frame both ways, and frame and header-list limits. Not here: server
push, TLS (clients speak HTTP/2 with prior knowledge, as gRPC does without TLS), message encodings
other than gzip and deflate (answered UNIMPLEMENTED). What a client can make a connection hold is
bounded: ``h2_limits``."""

from __future__ import annotations

import asyncio
from collections import deque

from hpack import Decoder
from hpack.exceptions import HPACKError

from fusedserve.service.grpc import calls
from fusedserve.service.grpc.h2_frames import FrameConnection, H2Error
from fusedserve.service.grpc.h2_limits import (
    CONTINUATIONS,
    HELD_CHECK,
    HELD_MESSAGES,
    MAX_HEADER_LIST,
    MAX_STREAMS,
    OPENED_CACHE,
    RECENT_IDS,
    RECV_WINDOW,
    WRITE_HARD,
)
from fusedserve.service.grpc.h2_wire import (
    COMPRESSION_ERROR,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    HEADERS,
    NO_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    U32,
    WINDOW_UPDATE,
    WITH_PRIORITY,
    changes_table,
    frame,
)

NOT_GRPC = b"\x00\x07:status\x03415"  # the answer to a request that is no gRPC call


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


class Connection(FrameConnection):
    """One client's HTTP/2 connection: its frames (``FrameConnection``) and its streams, each a gRPC
    call. It is the ``calls.Carrier`` its calls run on; ``server`` also holds the methods by path and
    ``refuse``."""

    def __init__(self, server):
        super().__init__(server)
        self.decoder = Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_LIST
        self.opened: dict[bytes, tuple] = {}  # header block -> open_call's answer, while the table holds
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for a window
        self.check_at = min(HELD_CHECK, server.max_message + 5)  # a stream holding more is checked (_fits)
        self.recent: set[int] = set()  # the stream ids opened lately (RECENT_IDS)

    def connection_lost(self, exc) -> None:
        self._cancel_all()
        super().connection_lost(exc)

    def _fail(self, error: H2Error) -> None:
        super()._fail(error)
        self._cancel_all()

    def _cancel_all(self) -> None:
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()

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
        block = calls.RESPONSE_HEADERS + calls.status_block(code, message)
        self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))

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


