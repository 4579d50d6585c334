"""gRPC's connection policy: admission (the connection cap and gRPC's share of the descriptor budget,
``service.connections``) and its timers (handshake deadline, idle timeout, request-message deadline),
kept by one sweep over the connections ten times per shortest timeout (at most once a second)."""

from __future__ import annotations

import random
import struct

from fusedserve.service.connections import Descriptors, Warnings, connection_cap
from fusedserve.service.grpc.h2_wire import ENHANCE_YOUR_CALM, GOAWAY, SETTINGS, frame

# A client's first bytes: the 24-byte preface, then a SETTINGS frame's 9-byte header (its length first).
PREFACE_BYTES, FRAME_HEAD = 24, 9


def sweep_interval(*timeouts_s: float) -> float:
    """A tenth of the shortest timeout (0: off), within 0.05-1 s: each fires at most ~20% late."""
    shortest = min((t for t in timeouts_s if t > 0), default=10.0)
    return min(1.0, max(0.05, shortest / 10))


class Watch:
    """What the sweep knows of one gRPC connection: when it was made, whether its handshake is in,
    when it last had a stream, and since when each stream has held an unfinished request."""

    __slots__ = ("made", "greeted", "_head", "_got", "active", "last_id", "held")

    def __init__(self, now: float):
        self.made = self.active = now
        self.greeted = False
        self._head = bytearray()  # the client's first bytes, up to its first frame's header
        self._got = 0
        self.last_id = 0  # the connection's highest stream id when the sweep last looked
        self.held: dict[int, tuple[float, int]] = {}  # stream id -> (since, bytes held then)

    def greet(self, data: bytes) -> None:
        """Count the client's first bytes until its preface and first frame (SETTINGS) are whole."""
        self._head += data[:PREFACE_BYTES + FRAME_HEAD - len(self._head)]
        self._got += len(data)
        if len(self._head) == PREFACE_BYTES + FRAME_HEAD:
            length = int.from_bytes(self._head[PREFACE_BYTES:PREFACE_BYTES + 3], "big")
            self.greeted = self._got >= PREFACE_BYTES + FRAME_HEAD + length


class GrpcPolicy:
    """gRPC's connection limits over the server's set of ``connections`` (``service.grpc.h2.Connection``):
    admission (the cap and the descriptor budget: refused with GOAWAY ENHANCE_YOUR_CALM), then the
    sweep: no preface and SETTINGS within ``header_timeout_s``: closed; no stream for
    ``grpc_idle_timeout_s``: GOAWAY NO_ERROR, then closed; a request message unfinished
    ``body_timeout_s`` after its stream opened (unary) or its first byte (streaming): answered
    DEADLINE_EXCEEDED, its bytes dropped."""

    def __init__(self, settings, connections: set, descriptors: Descriptors | None = None):
        self.connections = connections
        self.max_connections = connection_cap(settings)
        self.descriptors = descriptors or Descriptors()
        self.handshake_s, self.idle_s = settings.header_timeout_s, settings.grpc_idle_timeout_s
        self.message_s = settings.body_timeout_s
        self.interval_s = sweep_interval(self.handshake_s, self.idle_s, self.message_s)
        self.warnings = Warnings()
        self._timer = None

    def admit(self, connection) -> bool:
        """Watch a new connection, or refuse it (False): GOAWAY saying why, then closed at once (a
        refusal left to linger would hold the very descriptors kept for HTTP)."""
        transport = connection.transport
        if len(self.connections) >= self.max_connections:
            why = f"gRPC connection limit of {self.max_connections} reached (--max-connections)"
        elif not self.descriptors.fits(transport, self.descriptors.grpc):
            why = (f"gRPC's share of the open-file limit ({self.descriptors.soft}) is in use: "
                   "raise the limit (ulimit -n) or spread clients over replicas")
        else:
            connection.watch = Watch(connection.loop.time())
            return True
        self.warnings.note(f"{why}: connection refused with GOAWAY", transport.get_extra_info("peername"))
        goaway = struct.pack(">II", 0, ENHANCE_YOUR_CALM) + f"refused: {why}".encode()
        transport.write(frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, goaway))
        transport.close()
        return False

    def start(self, loop) -> None:
        self._timer = loop.call_later(self.interval_s, self._sweep, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def sweep(self, now: float) -> None:
        """Hold every connection to its timers at ``now`` (the event loop's time)."""
        for connection in list(self.connections):
            if connection.watch is not None and not connection.failed:
                self._check(connection, connection.watch, now)

    def _sweep(self, loop) -> None:
        try:
            self.sweep(loop.time())
        finally:
            # Jittered: the message deadline tells messages apart by a stream's bytes shrinking
            # between sweeps; at a fixed period a steady stream could alias into looking stalled.
            self._timer = loop.call_later(self.interval_s * random.uniform(0.5, 1.5), self._sweep, loop)

    def _check(self, connection, watch: Watch, now: float) -> None:
        if not watch.greeted:
            if now - watch.made >= self.handshake_s:
                self.warnings.note(f"gRPC connection closed: no HTTP/2 preface and SETTINGS within "
                                   f"{self.handshake_s:g} s", connection.transport.get_extra_info("peername"))
                connection.close()
            return
        if connection.streams or connection.last_id != watch.last_id:
            watch.active, watch.last_id = now, connection.last_id
            self._check_messages(connection, watch, now)
        elif self.idle_s and now - watch.active >= self.idle_s and connection.goaway_id is None:
            connection.go_away()  # closes once sent: no stream is open

    def _check_messages(self, connection, watch: Watch, now: float) -> None:
        held, late = {}, []
        # The client may send nothing while we read nothing (its calls at their cap) or its window is spent.
        stalled_by_us = not connection.reading or connection.recv_window <= 0
        for stream_id, stream in connection.streams.items():
            if stream.remote_closed or (stream.inbox is not None and not _partial(stream.body)):
                continue  # a unary request that is whole; a stream between messages, or waiting on us
            size = len(stream.body)
            since, seen = watch.held.get(stream_id, (now, size))
            if size < seen or stalled_by_us or stream.recv_window <= 0:
                since = now  # a streaming call's message was taken whole, or the client waits on us
            held[stream_id] = (since, size)
            if now - since >= self.message_s:
                late.append(stream)
        watch.held = held
        for stream in late:
            self._time_out(connection, stream)

    def _time_out(self, connection, stream) -> None:
        message = (f"the request message was not received within {self.message_s:g} s: send it faster, or "
                   "raise the server's --body-timeout-s")
        connection.finish(stream, "DEADLINE_EXCEEDED", message)
        if stream.task is not None:
            stream.task.cancel()
        stream.body.clear()
        self.warnings.note(f"gRPC request message not received within {self.message_s:g} s: answered "
                           "DEADLINE_EXCEEDED", connection.transport.get_extra_info("peername"))


def _partial(body: bytearray) -> bool:
    """Whether ``body`` starts with a length-prefixed message not yet whole (the client's to finish)."""
    return bool(body) and (len(body) < 5 or len(body) < 5 + int.from_bytes(body[1:5], "big"))
