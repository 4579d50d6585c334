"""HTTP/2's wire format (RFC 9113), what both our server (``service.grpc.h2``) and the benchmark's raw
client need: frame types, flags, error codes and settings, one frame's bytes, and a look into an
HPACK header block that says whether it changes the decoder's table."""

from __future__ import annotations

import struct

# Frame types and flags (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, WITH_PRIORITY = 0x4, 0x8, 0x20
# Error codes (section 7).
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = (
    0x0, 0x1, 0x3, 0x6, 0x7, 0x8, 0x9)
ENHANCE_YOUR_CALM = 0xB  # a peer that floods: it should back off
# Settings identifiers.
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x3, 0x4, 0x5, 0x6

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65535
MAX_WINDOW = 2**31 - 1
U32 = struct.Struct(">I")
_HEAD = struct.Struct(">BHBBI")  # a frame header: length (24 bits, split 8 + 16), type, flags, stream


def hpack_int(block: bytes, i: int, bits: int) -> tuple[int, int]:
    """The HPACK integer at ``block[i]`` with a ``bits``-bit prefix (RFC 7541 5.1), and the index past it."""
    mask = (1 << bits) - 1
    value, i = block[i] & mask, i + 1
    if value < mask:
        return value, i
    shift = 0
    while True:  # continuation bytes, 7 bits each, low first; the last has its top bit clear
        byte, i = block[i], i + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def changes_table(block: bytes) -> bool:
    """Whether an HPACK block adds to or resizes the decoder's dynamic table (RFC 7541 6): a literal
    with incremental indexing (01......) or a size update (001.....). One that does not decodes the
    same way until one that does arrives."""
    i = 0
    while i < len(block):
        if block[i] & 0x80:  # indexed field
            i = hpack_int(block, i, 7)[1]
        elif block[i] & 0x60:
            return True
        else:  # literal: a name index (4-bit prefix), the name itself when that is 0, the value
            index, i = hpack_int(block, i, 4)
            for _ in range(1 if index else 2):
                n, i = hpack_int(block, i, 7)
                i += n
    return False


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream) + payload
