"""What a gRPC call is on HTTP/2 (``service.grpc.h2`` carries it): its status codes and trailers, its
deadline header, the methods a server offers and the context their handlers see, and the tasks that
run one call, unary or streaming, through what they ask of its connection (``Carrier``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import DecodeError

from fusedserve.service.http.middleware import log_call

log = logging.getLogger("fusedserve")

# gRPC status codes by name (a ServiceError's grpc_code), as numbers on the wire.
STATUS = {name: number for number, name in enumerate((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))}
TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _hpack_int(n: int) -> bytes:
    """An HPACK integer with a 7-bit prefix (a string length, Huffman bit clear)."""
    if n < 127:
        return bytes((n,))
    out, n = [127], n - 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes((*out, n))


def literal(name: str, value: str) -> bytes:
    """One header as a literal never added to the table: the same bytes are right on any connection."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n)) + n + _hpack_int(len(v)) + v


# grpc-message's encoding by byte: printable ASCII but '%' as is, every other byte as %XX.
_PERCENT = tuple(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in range(256))


def _percent(message: str) -> str:
    """``message`` as grpc-message carries it, in a few C-level calls whatever its length."""
    if message.isascii() and message.isprintable() and "%" not in message:
        return message
    return "".join(map(_PERCENT.__getitem__, message.encode()))


RESPONSE_HEADERS = b"\x88" + literal("content-type", "application/grpc")  # 0x88: ":status 200" (static table)
OK_TRAILERS = literal("grpc-status", "0")


MESSAGE_LIMIT = 2048  # UTF-8 bytes of grpc-message sent: percent-encoded (x3 at most), it fits one frame
ECHO_LIMIT = 200  # characters of a client's own header value quoted back in a refusal


def _echo(value: str) -> str:
    return value if len(value) <= ECHO_LIMIT else f"{value[:ECHO_LIMIT]}... ({len(value)} characters)"


def status_block(code: str, message: str) -> bytes:
    block = literal("grpc-status", str(STATUS[code]))
    if not message:
        return block
    return block + literal("grpc-message", _percent(message.encode()[:MESSAGE_LIMIT].decode(errors="ignore")))


class Abort(Exception):
    """A call ends with this status (``code``: a name in ``STATUS``) and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Method:
    """A gRPC method: how its request parses, and its handler. A unary handler takes (request,
    context) and returns the response; a streaming one takes (request iterator, context) and
    yields one response per request (the iterator holds back requests while too many are
    unanswered: service.grpc.h2_limits.Limits)."""
    name: str
    parse: Callable[[bytes], object]
    handler: Callable
    streaming: bool
    path: str = ""  # what clients call it by (the access log's path); the name where unset


class CallContext:
    """What a handler may ask of its call (grpc.aio's servicer context, the parts we use)."""

    __slots__ = ("_deadline", "_metadata", "encoding", "started")

    def __init__(self, deadline: float | None, metadata: tuple, encoding: str = "identity"):
        self._deadline, self._metadata = deadline, metadata
        self.encoding = encoding  # grpc-encoding: how the call's flagged messages are compressed
        self.started = time.perf_counter()  # the access log's duration counts from here

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - asyncio.get_running_loop().time()

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def abort(self, code: str, message: str):
        raise Abort(code, message)


class Carrier(Protocol):
    """All a call asks of the connection that carries it (``service.grpc.h2.Connection``): its
    request messages in, its answers out, its end with a status. ``stream`` is the call's own, of
    which the call reads ``method`` and ``context``."""

    async def next_message(self, stream) -> bytes | None:
        """A streaming call's next request message; None once the client ended the stream."""

    def send_message(self, stream, message: bytes) -> None:
        """One response message out."""

    def finish(self, stream, code: str, message: str) -> None:
        """End the call with its status."""


class NotGrpc(Exception):
    """A request that is no gRPC call (not a POST of application/grpc): answered HTTP 415."""


# grpc-encoding -> zlib's wbits: gzip's header, or zlib's (what gRPC calls "deflate").
INFLATE = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def open_call(methods: dict[str, Method], refuse, headers) -> tuple[Method, float | None, tuple, str]:
    """The method, timeout (seconds, or None), metadata and message encoding of a call opened with
    ``headers``; Abort says why it is refused. The same headers always give the same answer (a
    connection caches it)."""
    fields = dict(headers)
    if fields.get(":method") != "POST" or not fields.get("content-type", "").startswith("application/grpc"):
        raise NotGrpc()
    path = fields.get(":path", "")
    metadata = tuple((k, v) for k, v in headers if not k.startswith(":"))
    method = methods.get(path)
    if method is None:
        raise Abort("UNIMPLEMENTED", f"unknown method {_echo(path)}")
    refusal = refuse and refuse(method.name, metadata)
    if refusal and method.streaming:  # told on its first message: a client's first write would fail blindly
        method = dataclasses.replace(method, handler=refuse_stream(refusal), streaming=True)
    elif refusal:
        raise Abort("UNAUTHENTICATED", refusal)
    encoding = fields.get("grpc-encoding") or "identity"
    if encoding != "identity" and encoding not in INFLATE:
        raise Abort("UNIMPLEMENTED", f"grpc-encoding {_echo(encoding)} is not served: send identity, gzip or deflate")
    timeout = fields.get("grpc-timeout")
    return method, None if timeout is None else grpc_timeout(timeout), metadata, encoding


def length_prefixed(message: bytes) -> bytes:
    """A message as gRPC sends it: 0 (not compressed), its length (4 bytes, big-endian), its bytes."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def take_message(body: bytearray, encoding: str, limit: int) -> tuple[bytes, int] | None:
    """The whole length-prefixed message at the head of ``body``, taken out of it and decompressed
    where flagged (by the call's ``encoding``), with the bytes it took on the wire; None while it
    is incomplete. One that says it is over ``limit`` bytes is refused as soon as it says so."""
    if len(body) < 5:
        return None
    size = int.from_bytes(body[1:5], "big")
    if size > limit:
        raise Abort("RESOURCE_EXHAUSTED", f"the request message is larger than the server's limit of {limit} bytes")
    if len(body) < 5 + size:
        return None
    message = bytes(body[5:5 + size])
    if body[0]:
        message = _inflate(message, encoding, limit)
    del body[:5 + size]
    return message, 5 + size


def _inflate(message: bytes, encoding: str, limit: int) -> bytes:
    if encoding not in INFLATE:
        raise Abort("INTERNAL", "a message flagged compressed in a call whose grpc-encoding is identity")
    inflater = zlib.decompressobj(INFLATE[encoding])
    try:
        out = inflater.decompress(message, limit + 1)
    except zlib.error as exc:
        raise Abort("INTERNAL", f"a {encoding} message does not decompress: {exc}") from None
    if len(out) > limit:
        raise Abort("RESOURCE_EXHAUSTED", f"the request message is larger than the server's limit of {limit} "
                                          "bytes once decompressed")
    return out


def grpc_timeout(value: str) -> float:
    """``grpc-timeout`` (up to 8 digits and a unit) in seconds."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit() or value[-1] not in TIMEOUT_UNITS:
        raise Abort("INVALID_ARGUMENT", f"grpc-timeout {_echo(value)!r} is not digits and one of H M S m u n")
    return int(value[:-1]) * TIMEOUT_UNITS[value[-1]]


async def unary_call(connection: Carrier, stream, message: bytes) -> None:
    try:
        response = await stream.method.handler(stream.method.parse(message), stream.context)
    except Exception as exc:  # noqa: BLE001 - every call is answered with a status
        _finish(connection, stream, *_status_of(exc))
        return
    connection.send_message(stream, response.SerializeToString())
    _finish(connection, stream, "OK", "")


async def stream_call(connection: Carrier, stream) -> None:
    failure: list = []
    try:
        async for response in stream.method.handler(_requests(connection, stream, failure), stream.context):
            connection.send_message(stream, response.SerializeToString())
    except Exception as exc:  # noqa: BLE001 - every call is answered with a status
        failure.append(exc)
    _finish(connection, stream, *(_status_of(failure[0]) if failure else ("OK", "")))


def _finish(connection: Carrier, stream, code: str, message: str) -> None:
    """End the call with its status, and write its access-log line."""
    connection.finish(stream, code, message)
    context = stream.context
    log_call(stream.method.path or stream.method.name, context.invocation_metadata(), context.started, code,
             STATUS[code])


async def _requests(connection: Carrier, stream, failure: list) -> AsyncIterator:
    """The stream's request messages as the connection lets the handler take them, parsed; one that
    does not parse or decompress, or a stream that ends inside one, ends the call with that status."""
    while True:
        try:
            message = await connection.next_message(stream)
            if message is None:
                return
            request = stream.method.parse(message)
        except (Abort, DecodeError) as exc:
            failure.append(exc)
            return
        yield request


def refuse_stream(reason: str):
    """A streaming handler that reads the first request, then ends the call UNAUTHENTICATED."""

    async def refuse(requests, context):
        async for _ in requests:
            break
        raise Abort("UNAUTHENTICATED", reason)
        yield  # noqa: RET503 - makes this an async generator, as streaming handlers are

    return refuse


def _status_of(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, Abort):
        return exc.code, exc.message
    if isinstance(exc, DecodeError):
        return "INTERNAL", f"the request message does not parse: {exc}"
    log.error("gRPC call failed", exc_info=exc)
    return "INTERNAL", "internal error; see the server log"
