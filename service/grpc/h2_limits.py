"""What a client can make one gRPC connection (``service.grpc.h2``) hold, bounded after nghttp2's and
Envoy's defaults: requests in flight (reading pauses at the cap), the receive windows (DATA beyond
them is a connection error; a stream's window comes back as its handler takes its messages), bytes
written and not yet sent (reading pauses past a high-water mark, a client that lets them pass a hard
bound is cut off), work per event-loop turn, and floods of control frames, empty frames and
CONTINUATIONs (GOAWAY ENHANCE_YOUR_CALM). ``Limits`` holds those a deployment sets; the constants
below, the rest."""

from __future__ import annotations

from dataclasses import dataclass

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
