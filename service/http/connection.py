"""uvicorn's httptools HTTP/1.1 protocol with the limits its options do not reach: a cap on request
head bytes (431 before the parser sees them: httptools grows a header by concatenation, quadratic
in its chunks), deadlines for a request's head and body (408), a connection cap and a share of the
descriptors (``service.connections``; 503 at accept, logged), pipelined requests answered before
the 400 for bad bytes after them, a graceful close that never drops a request already being read,
and an access log that says 499 when the client closed (or half-closed: uvicorn takes either as
leaving) before its answer. ``protocol_class(limits)`` is what ``uvicorn.Config(http=)`` takes;
every front-end process builds it the same way (``service.http.server.uvicorn_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr

from fusedserve.service.connections import Descriptors, Warnings
from fusedserve.service.http.middleware import ANSWERED, CLIENT_GONE, GONE, REQUESTS

LINGER_S = 1.0  # after a refusal: read and drop what the client still sends, so it gets the answer, not a reset
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}


@dataclass
class Limits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    descriptors: Descriptors = field(default_factory=Descriptors)
    warnings: Warnings = field(default_factory=Warnings)  # refusals, logged at most once a second by kind

    def note(self, kind: str, client) -> None:
        self.warnings.note(kind, client)


def _answer(status: int, message: str) -> bytes:
    body = orjson.dumps({"error": message})
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        status, _REASONS[status], len(body), body)


class GuardedProtocol(HttpToolsProtocol):
    limits: Limits  # set on the subclass ``protocol_class`` makes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # bytes of the request head read so far (0: between requests)
        self._reading_head = True
        self._timer = None  # the read deadline of the head or body being read
        self._tail = b""  # the head's last bytes so far: its blank line may span two reads
        self._refused = False  # answered and closing: what still comes is dropped
        self._close_after_answer = False  # shutting down: no request after this one
        self._requests = self._settled = 0  # requests read on this connection; answered or dropped
        self._deferred: tuple[int, str] | None = None  # a refusal due once the requests before it are answered

    def connection_made(self, transport) -> None:
        limits, fits = self.limits, True
        if len(self.connections) >= limits.max_connections:
            why = f"connection limit of {limits.max_connections} reached"
        elif not (fits := limits.descriptors.fits(transport, limits.descriptors.http)):
            why = f"HTTP's share of the open-file limit ({limits.descriptors.soft}) is in use"
        else:
            super().connection_made(transport)
            self._arm(limits.header_timeout_s, "head")
            return
        self.transport = transport
        self.client = get_remote_addr(transport)
        limits.note(f"{why}: answered 503", self.client)
        # Short of descriptors, no linger: it would hold the ones kept for files.
        self._refuse(503, "the server is at its connection limit; retry shortly or on another replica", linger=fits)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_head:
            end = self._head_end(data)
            self._head_bytes += len(data) if end < 0 else end
            self._tail = (self._tail + data[-3:])[-3:] if end < 0 else b""
            if self._head_bytes > self.limits.max_header_bytes:
                self.limits.note(f"request head over {self.limits.max_header_bytes} bytes: answered 431", self.client)
                self._refuse(431, f"request line and headers exceed {self.limits.max_header_bytes} bytes")
                return
        super().data_received(data)
        # A deadline only for a request this data left half-read: most arrive whole, and cost no timer.
        if self._timer is None and not self._refused and not self.transport.is_closing():
            if not self._reading_head:
                self._arm(self.limits.body_timeout_s, "body")
            elif self._head_bytes:
                self._arm(self.limits.header_timeout_s, "head")

    def _head_end(self, data: bytes) -> int:
        """Where in ``data`` the request head ends (past its blank line), or -1."""
        if self._tail:
            end = (self._tail + data[:3]).find(b"\r\n\r\n")
            if end >= 0:
                return end + 4 - len(self._tail)
        end = data.find(b"\r\n\r\n")
        return end + 4 if end >= 0 else -1

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:  # a request (an upgrade makes no cycle)
            self._requests += 1
            self.cycle.scope[GONE] = self.loop.create_future()  # before the app's task first runs
            self.cycle.scope[REQUESTS] = self.tasks
        self._disarm()
        self._reading_head = False
        if self._close_after_answer:
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._reading_head, self._head_bytes, self._tail = True, 0, b""

    def on_response_complete(self) -> None:
        self._settled += 1
        super().on_response_complete()
        if self._deferred is not None and self._settled >= self._requests and not self.transport.is_closing():
            self._refuse(*self._deferred)

    def eof_received(self):
        # uvicorn closes on the client's FIN; an answer written after it goes nowhere, so the request
        # in progress learns now that its client left (and the access log says so).
        self._client_gone()
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._client_gone()
        super().connection_lost(exc)

    def _client_gone(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.scope[CLIENT_GONE] = True  # the access log says 499, not the status the app meant to send
            cycle.disconnected = True
            cycle.message_event.set()
            gone = cycle.scope.get(GONE)
            if gone is not None and not gone.done():
                gone.set_result(None)

    def shutdown(self) -> None:
        """Server shutdown: close an idle connection now; one whose request is being read or answered
        closes after its answer."""
        busy = self._head_bytes or self.pipeline or (self.cycle is not None and not self.cycle.response_complete)
        if (self._refused and self._deferred is None) or not busy:
            self.transport.close()
            return
        self._close_after_answer = True
        if self.cycle is not None:
            self.cycle.keep_alive = False

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes that are not HTTP/1.1, as JSON like every other error, after the
        # answers to the requests read before them. Bytes that break a body end that body's request.
        if not self._reading_head and self.cycle is not None and not self._drop(self.cycle, 400):
            return
        self._refuse_in_turn(400, f"{msg.rstrip('.')}: the request is not valid HTTP/1.1")

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._read_timeout, what, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _read_timeout(self, what: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        # No 408 where it would not be the next answer on the connection: close instead. A head's
        # cycle is the previous request's (still being answered, if pipelined); a body's is its
        # own, which the app may have answered already (413, 401) before the body ended.
        if what == "head" and (not self._head_bytes or (cycle is not None and not cycle.response_complete)):
            self.transport.close()
            return
        if what == "body" and cycle is not None and not self._drop(cycle, 408):
            return
        self.limits.note(f"request {what} not received within {seconds:g} s: answered 408", self.client)
        self._refuse_in_turn(408, f"request {what} not received within {seconds:g} s")

    def _drop(self, cycle, status: int) -> bool:
        """Stop reading ``cycle``'s request: its app sees the client gone, the access log ``status``.
        False where its answer has begun: the connection is closed instead."""
        if cycle.response_started:
            self.transport.close()
            return False
        cycle.scope[ANSWERED] = status
        cycle.disconnected = True
        cycle.message_event.set()
        self._settled += 1
        for entry in [e for e in self.pipeline if e[0] is cycle]:  # queued behind another: never to run
            self.pipeline.remove(entry)
        return True

    def _refuse_in_turn(self, status: int, message: str) -> None:
        """``_refuse``, once every request read before now is answered: nothing more is read meanwhile."""
        if self._settled < self._requests:
            self._refused, self._deferred = True, (status, message)
            self._disarm()
        else:
            self._refuse(status, message)

    def _refuse(self, status: int, message: str, linger: bool = True) -> None:
        """Answer ``status`` and close: send it, half-close, drop what still comes for ``LINGER_S``."""
        self._refused, self._deferred = True, None
        self._disarm()
        transport = self.transport
        transport.write(_answer(status, message))
        if linger and transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()


def protocol_class(limits: Limits) -> type[GuardedProtocol]:
    """A ``GuardedProtocol`` bound to ``limits`` (uvicorn builds one protocol per connection)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "__module__": __name__})

