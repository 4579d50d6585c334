"""The frames a front end and the engine process exchange over one Unix stream socket (``--workers N``).

Every frame is a 9-byte header (payload length u32, kind u8, request id u32, little-endian) and its
payload. Rows and outputs travel as raw float32 bytes after a small fixed header, never pickled;
control messages (stats, metrics, status) are JSON, off the hot path. Writes made in one turn of the
event loop leave in one system call (``Outbox``).

Front end -> engine: INFER, one group of requests for one model and timeout gathered in one turn of
the front end's loop (model index u16, requests u16, cols u32, timeout s f32, 4 pad bytes; per
request its id u32 and rows u32; then every request's rows, float32, in that order), CANCEL (the
request's client left or its deadline passed), CONTROL (JSON ``{"op": ...}``), PING (empty).
Engine -> front end: RESULT (rows u32, cols u32, float32 data), ERROR (JSON: the ServiceError's
type, message and headers), REPLY (JSON answer to a CONTROL), STATUS (JSON: models, readiness),
PONG (empty: the answer to a PING, from the engine's event loop; shows it is not wedged)."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import orjson

from fusedserve.service import errors

HEADER = struct.Struct("<IBI")
INFER_HEAD = struct.Struct("<HHIfxxxx")  # padded to 16 bytes: with 8 per request the rows stay aligned
INFER_ENTRY = struct.Struct("<II")
MAX_GROUP = 0xFFFF  # requests in one INFER frame
RESULT_HEAD = struct.Struct("<II")
INFER, CANCEL, CONTROL, RESULT, ERROR, REPLY, STATUS, PING, PONG = range(1, 10)
ID_MASK = 0xFFFFFFFF
_F32 = np.dtype(np.float32)

_ERRORS = {cls.__name__: cls for cls in (errors.ServiceError, errors.BadInput, errors.PayloadTooLarge,
                                         errors.UnknownModel, errors.NotReady, errors.QueueFull,
                                         errors.DeadlineExceeded, errors.BatchFailed, errors.ClientGone)}


class Frames:
    """Splits a byte stream into ``(kind, id, payload)`` frames; a payload is a writable copy
    (numpy views of it hand torch memory it may write)."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytearray]]:
        # Whole frames are copied once, straight out of ``data``; only a partial one waits in a buffer.
        if self._buf:
            self._buf += data
            data = self._buf
        view = memoryview(data)
        frames, pos, size, head = [], 0, len(data), HEADER.size
        while size - pos >= head:
            length, kind, ident = HEADER.unpack_from(view, pos)
            end = pos + head + length
            if end > size:
                break
            frames.append((kind, ident, bytearray(view[pos + head:end])))
            pos = end
        rest = view[pos:]
        self._buf = bytearray(rest) if len(rest) else bytearray()
        return frames


class Outbox:
    """Frames queued during one turn of the event loop, written together at its end. ``pack``, if
    given, is called first at each flush for frames built from what the turn gathered (its list
    of chunks goes out ahead of the others)."""

    def __init__(self, transport: asyncio.WriteTransport, pack=None):
        self._transport = transport
        self._pack = pack
        self._chunks: list = []
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def send(self, *chunks) -> None:
        """Queue ``chunks`` (none: only make sure a flush, and so ``pack``, comes at the turn's end)."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)
        self._chunks.extend(chunks)

    def _flush(self) -> None:
        self._scheduled = False
        chunks, self._chunks = self._chunks, []
        if self._pack is not None:
            chunks = self._pack() + chunks
        if chunks and not self._transport.is_closing():
            # One write of the joined bytes: uvloop's writelines tries a send per chunk (measured: a
            # flush of 64 answers cost the engine ~2.4 ms that way under cProfile).
            self._transport.write(b"".join(chunks))


class InferGroup:
    """Requests for one model and timeout, sent as one INFER frame (the engine queues them as one)."""

    def __init__(self, model: int, cols: int, timeout_s: float):
        self.model, self.cols, self.timeout_s = model, cols, timeout_s
        self.entries: list[tuple[int, np.ndarray]] = []
        self.rows = 0

    def add(self, ident: int, rows: np.ndarray) -> None:
        self.entries.append((ident, rows))
        self.rows += rows.shape[0]

    def frame(self) -> list:
        table = b"".join([INFER_ENTRY.pack(ident, x.shape[0]) for ident, x in self.entries])
        size = INFER_HEAD.size + len(table) + 4 * self.rows * self.cols
        head = HEADER.pack(size, INFER, self.entries[0][0]) + INFER_HEAD.pack(
            self.model, len(self.entries), self.cols, self.timeout_s) + table
        return [head, *(x.data.cast("B") for _, x in self.entries)]


def infer_frame(ident: int, model: int, rows: np.ndarray, timeout_s: float) -> list:
    """The INFER frame of one request (a group of one)."""
    group = InferGroup(model, rows.shape[1], timeout_s)
    group.add(ident, rows)
    return group.frame()


def read_infer(payload: bytearray) -> tuple[int, list[int], list[int], np.ndarray, float]:
    """``(model index, request ids, their row counts, all rows [n, cols] float32, timeout s)``."""
    model, count, cols, timeout_s = INFER_HEAD.unpack_from(payload)
    start = INFER_HEAD.size + count * INFER_ENTRY.size
    if count == 0 or len(payload) < start:
        raise errors.BadInput(f"INFER frame of {len(payload)} bytes for {count} requests")
    table = [INFER_ENTRY.unpack_from(payload, INFER_HEAD.size + i * INFER_ENTRY.size) for i in range(count)]
    idents, rows = [ident for ident, _ in table], [n for _, n in table]
    n = sum(rows)
    if len(payload) != start + 4 * n * cols:
        raise errors.BadInput(f"frame carries {len(payload) - start} bytes for {n} rows of {cols} float32")
    return model, idents, rows, np.ndarray((n, cols), _F32, payload, start), timeout_s


def result_frame(ident: int, out: np.ndarray) -> tuple[bytes, memoryview]:
    out = np.ascontiguousarray(out, dtype=np.float32)
    n, cols = out.shape
    return HEADER.pack(RESULT_HEAD.size + out.nbytes, RESULT, ident) + RESULT_HEAD.pack(n, cols), out.data.cast("B")


def read_result(payload: bytearray) -> np.ndarray:
    n, cols = RESULT_HEAD.unpack_from(payload)
    return np.ndarray((n, cols), _F32, payload, RESULT_HEAD.size)


def json_frame(kind: int, ident: int, payload) -> bytes:
    body = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    return HEADER.pack(len(body), kind, ident) + body


def cancel_frame(ident: int) -> bytes:
    return HEADER.pack(0, CANCEL, ident)


PING_FRAME, PONG_FRAME = HEADER.pack(0, PING, 0), HEADER.pack(0, PONG, 0)


def error_payload(exc: errors.ServiceError) -> dict:
    return {"type": type(exc).__name__, "message": exc.message, "headers": exc.headers}


def read_error(payload: bytearray) -> errors.ServiceError:
    """The ServiceError an ERROR frame carries, as its own class (its status and gRPC code)."""
    body = orjson.loads(payload)
    cls = _ERRORS.get(body.get("type"), errors.ServiceError)
    return cls(body.get("message", "the engine failed"), headers=body.get("headers") or None)
