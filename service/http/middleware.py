"""Request ids, the access log and ``Connection: close`` while draining: a pure ASGI middleware
(no per-request task) for the framework's routes, and the same pieces for the rows' hot path."""

from __future__ import annotations

import itertools
import logging
import os
import time

from fusedserve.service import tracing

access_log = logging.getLogger("fusedserve.access")
# Set in the request's scope by the HTTP protocol (service.http.connection) when the connection closed
# before the answer was written: the access log then says 499, not the status that never left.
CLIENT_GONE = "fusedserve.client_gone"
# Set there too when the protocol itself answered the request (408: its body came too slowly).
ANSWERED = "fusedserve.answered"
# A future the HTTP protocol completes when the request's client leaves before its answer: the rows'
# routes withdraw the request on it (without it, a task per request watches ASGI receive).
GONE = "fusedserve.gone"
# The set of the server's requests in progress (uvicorn's tasks, each added as its head is read): a
# request alone in it was the only one read this turn, and need not wait a turn for others to join.
REQUESTS = "fusedserve.requests"


class RequestIds:
    """``X-Request-ID`` echoed (bounded: a header must not grow our responses unboundedly) or made
    from a random per-process prefix and a counter: unique like a uuid4, without a getrandom()
    system call per request."""

    def __init__(self):
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def take(self, scope) -> bytes:
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                return value[:200]
        return f"{self._prefix}{next(self._count):016x}".encode()


def answer_headers(request_id: bytes, draining: bool) -> list[tuple[bytes, bytes]]:
    """The headers every answer carries: its request id, and ``Connection: close`` while draining
    so clients reconnect elsewhere."""
    return [(b"x-request-id", request_id), (b"connection", b"close")] if draining else [(b"x-request-id", request_id)]


def log_access(scope, status: int, start: float, request_id: bytes) -> None:
    """One access-log line (with fields for the JSON log format), if INFO is on. An answer the client
    never got (its connection closed first) is logged as 499, naming the status it would have had.
    With tracing on, the request's span too."""
    if tracing.spans is not None:
        tracing.http_span(scope, status, start, request_id.decode(errors="replace"))
    if access_log.isEnabledFor(logging.INFO):
        rid = request_id.decode(errors="replace")
        ms = (time.perf_counter() - start) * 1e3
        extra = {"request_id": rid, "method": scope["method"], "path": scope["path"], "status": status,
                 "duration_ms": round(ms, 3)}
        note = ""
        if scope.get(ANSWERED):
            extra["status"], note = scope[ANSWERED], " (answered by the HTTP protocol: request body too slow)"
        elif scope.get(CLIENT_GONE) and status != 499:
            extra["status"], extra["undelivered_status"] = 499, status
            note = f" (answer {status} not delivered: the client closed the connection)"
        _write("%s %s %d %.2f ms request_id=%s%s", (scope["method"], scope["path"], extra["status"], ms, rid, note),
               extra)


def log_call(path: str, metadata: tuple, started: float, code: str, number: int) -> None:
    """A gRPC call's access-log line, with HTTP's fields (``status``: the gRPC status number) and
    ``grpc_status`` (its name); the request id is the call's ``x-request-id`` metadata, if sent.
    With tracing on, the call's span too."""
    rid = next((v for k, v in metadata if k == "x-request-id"), "")[:200] or "-"
    if tracing.spans is not None:
        tracing.grpc_span(path, metadata, started, code, number, rid)
    if access_log.isEnabledFor(logging.INFO):
        ms = (time.perf_counter() - started) * 1e3
        extra = {"request_id": rid, "method": "POST", "path": path, "status": number, "grpc_status": code,
                 "duration_ms": round(ms, 3)}
        _write("gRPC %s %s %.2f ms request_id=%s", (path, code, ms, rid), extra)


def _write(message: str, args: tuple, extra: dict) -> None:
    # makeRecord, not .info(): a record without its caller (findCaller walks the stack, per request).
    access_log.handle(access_log.makeRecord(access_log.name, logging.INFO, "", 0, message, args, None, extra=extra))


INTERNAL_ERROR = b'{"error":"internal server error; see the server log"}'


def internal_error_start(request_id: bytes, draining: bool) -> dict:
    """The ``http.response.start`` of a JSON 500 (body ``INTERNAL_ERROR``), for a bug's request."""
    return {"type": "http.response.start", "status": 500,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(INTERNAL_ERROR)).encode()),
                        *answer_headers(request_id, draining)]}


class RequestIdMiddleware:
    """Request ids, the access log, and the last word on a bug: a JSON 500 with the request id
    (never the framework's plain-text one), reported once through ``on_error(scope, exc)``."""

    def __init__(self, app, is_draining, ids: RequestIds, on_error):
        self.app = app
        self.is_draining = is_draining
        self.ids = ids
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = self.ids.take(scope)
        start = time.perf_counter()
        status = 0

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers += answer_headers(request_id, self.is_draining())
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - a bug: logged, counted and answered, not re-raised
            self.on_error(scope, exc)
            if status == 0:  # nothing sent yet: the client still gets an answer it can parse
                status = 500
                await send(internal_error_start(request_id, self.is_draining()))
                await send({"type": "http.response.body", "body": INTERNAL_ERROR})
        finally:
            log_access(scope, status, start, request_id)
