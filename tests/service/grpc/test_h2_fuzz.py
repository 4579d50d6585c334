"""Random frame sequences fed to one HTTP/2 connection (``service.grpc.h2``, over the toy gRPC methods of
test_h2, on a fake transport in-process): lengths, flags, stream ids and payloads drawn at random or
shaped like a gRPC client's, split at random points, with the client's reading paused and resumed.
Whatever comes, the connection serves or closes with a GOAWAY as its last frame, never raises out
of ``data_received`` or a callback, never hangs, and never holds more than its bounds."""

import asyncio
import struct
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fusedserve.service.grpc import h2, h2_limits

from .test_h2 import (
    ACK,
    CHAT,
    CONTINUATION,
    DATA,
    ECHO,
    END_HEADERS,
    END_STREAM,
    FAIL,
    GOAWAY,
    HEADERS,
    HOLD,
    INITIAL_WINDOW_SIZE,
    OPENING,
    PADDED,
    PILE,
    PING,
    RST_STREAM,
    SETTINGS,
    WAIT,
    WINDOW_UPDATE,
    FakeTransport,
    frame,
    frames_in,
    message,
    request_block,
    toy_stub,
)

LIMITS = h2_limits.Limits(calls_per_connection=3, calls_per_stream=2, write_buffer_bytes=1 << 14,
                          queued_control_frames=20)
PATHS = [ECHO, FAIL, WAIT, CHAT, HOLD, PILE, "/toy.Toy/Nope"]
TURNS = 200  # event-loop turns a sequence may take to settle
ids = st.sampled_from([0, 1, 2, 3, 5, 7, 9, 2**31 - 1]) | st.integers(0, 2**31 - 1)


def _raw():
    return st.builds(lambda kind, flags, stream, payload: frame(kind, flags, stream, payload),
                     st.integers(0, 12), st.integers(0, 255), ids, st.binary(max_size=40))


def _shaped():
    """Frames as a gRPC client sends them, with their fields drawn at random."""
    u32 = st.integers(0, 2**32 - 1).map(lambda n: n.to_bytes(4, "big"))
    return st.one_of(
        st.builds(lambda s, p, f: frame(HEADERS, f | END_HEADERS, s, request_block(p)), ids, st.sampled_from(PATHS),
                  st.sampled_from([0, END_STREAM])),
        st.builds(lambda s, p, cut: frame(HEADERS, 0, s, request_block(p)[:cut])
                  + frame(CONTINUATION, END_HEADERS, s, request_block(p)[cut:]), ids, st.sampled_from(PATHS),
                  st.integers(0, 60)),
        st.builds(lambda s, body, f, n: frame(DATA, f, s, message(body) * n), ids, st.binary(max_size=30),
                  st.sampled_from([0, END_STREAM, PADDED]), st.integers(0, 5)),
        st.builds(lambda s, n: frame(DATA, 0, s, bytes([0, 0, 0, n >> 8 & 255, n & 255])), ids, st.integers(0, 70000)),
        st.builds(lambda v: frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, v)),
                  st.integers(0, 2**32 - 1)),
        st.builds(lambda s, inc: frame(WINDOW_UPDATE, 0, s, inc), ids, u32),
        st.builds(lambda s, code: frame(RST_STREAM, 0, s, code), ids, u32),
        st.builds(lambda f, p: frame(PING, f, 0, p), st.sampled_from([0, ACK]), st.binary(min_size=8, max_size=8)),
        st.just(frame(GOAWAY, 0, 0, bytes(8))),
        st.builds(lambda n: frame(PING, 0, 0, bytes(8)) * n, st.integers(0, 1100)),
    )


def _client():
    """What a gRPC client does: open a call on the next stream (its messages, ended or not), or send
    more on one it opened (messages, nothing, padding), as (what, ...) tuples ``_frames`` turns to bytes."""
    messages = st.binary(max_size=30).map(lambda b: [b]) | st.lists(st.binary(max_size=30), max_size=4)
    return st.one_of(st.tuples(st.just("call"), st.sampled_from(PATHS), messages, st.booleans()),
                     st.tuples(st.just("more"), st.integers(0, 7), messages, st.sampled_from([0, END_STREAM, PADDED])))


def _frames(events) -> list:
    """The sequence with each client action made frames: calls on ids 1, 3, 5, ..."""
    made, opened = [], []
    for event in events:
        if not isinstance(event, tuple):
            made.append(event)
            continue
        what, which, bodies, how = event
        body = b"".join(message(b) for b in bodies)
        if what == "call":
            opened.append(2 * len(opened) + 1)
            made.append(frame(HEADERS, END_HEADERS, opened[-1], request_block(which))
                        + frame(DATA, END_STREAM if how else 0, opened[-1], body))
        elif opened:
            data = bytes([3]) + body + bytes(3) if how == PADDED else body
            made.append(frame(DATA, how, opened[which % len(opened)], data))
    return made


# A sequence: a client's actions, then those mixed with frames of any shape and the client pausing
# ("pause") and resuming ("resume") its reading, which the transport tells the connection as
# pause_writing/resume_writing; each then cut into chunks at random points.
_mixed = st.one_of(*[_client()] * 4, _shaped(), _raw(), st.sampled_from(["pause", "resume"]))
events = st.builds(lambda calls, rest: _frames(calls + rest), st.lists(_client(), min_size=1, max_size=12),
                   st.lists(_mixed, max_size=20))


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in pairwise(points)]


async def _feed(sequence, cuts: list[int], unsent: int) -> None:
    loop = asyncio.get_running_loop()
    errors: list = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    stub = toy_stub(LIMITS)
    connection, transport = h2.Connection(stub), FakeTransport()
    transport.unsent = unsent
    connection.connection_made(transport)
    for event in [OPENING, *sequence]:
        if event == "pause":
            connection.pause_writing()
        elif event == "resume":
            connection.resume_writing()
        else:
            for chunk in _chunks(event, cuts):
                await _settle(transport)
                if not transport.reading or transport.closed:
                    break  # a real transport delivers nothing while reading is paused
                connection.data_received(chunk)
                _check_bounds(connection)
    connection.resume_writing()
    stub.state.release.set()
    await _settle(transport)
    _check_bounds(connection)
    _check_output(connection, transport)
    connection.connection_lost(None)
    await _settle(transport)
    assert connection.in_flight == 0, f"requests in flight after the connection was lost: {connection.in_flight}"
    assert not errors, f"an exception escaped into the event loop: {errors[0]}"


async def _settle(transport, turns: int = TURNS) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


def _check_bounds(connection) -> None:
    assert len(connection.streams) <= h2_limits.MAX_STREAMS, len(connection.streams)
    assert 0 <= connection.in_flight <= LIMITS.calls_per_connection, connection.in_flight
    assert len(connection.buffer) <= h2_limits.SLICE_BYTES + 2 * (9 + h2_limits.FRAME_LIMIT) + 70000 * 2, \
        len(connection.buffer)
    for stream in connection.streams.values():
        assert stream.in_flight <= LIMITS.calls_per_stream, stream.in_flight
        assert stream.inbox is None or len(stream.inbox) <= LIMITS.calls_per_stream, len(stream.inbox)
        assert stream.recv_window >= 0, stream.recv_window


def _check_output(connection, transport) -> None:
    written = frames_in(transport.written)
    assert written and written[0][0] == SETTINGS, "the server's SETTINGS come first"
    assert all(len(payload) <= h2_limits.FRAME_LIMIT for *_, payload in written), "frames within the frame size limit"
    if connection.failed:
        kind, _, stream, payload = written[-1]
        assert kind == GOAWAY and stream == 0 and struct.unpack(">I", payload[4:8])[0] != 0, \
            f"a connection error ends with GOAWAY and its code, last frame {written[-1][:3]}"
        assert transport.closed, "a failed connection is closed"


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=2000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sequence=events, cuts=st.lists(st.integers(0, 2**20), max_size=6), unsent=st.sampled_from([0, 0, 1]))
def test_any_frames_are_served_or_answered_with_goaway(sequence, cuts, unsent):
    asyncio.run(asyncio.wait_for(_feed(sequence, cuts, unsent), 10))
