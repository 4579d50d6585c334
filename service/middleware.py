"""Pure ASGI middleware (no per-request task, unlike BaseHTTPMiddleware): X-Request-ID echoed or
generated and written to the access log with the status and duration, and ``Connection: close`` on
every answer while draining so clients reconnect elsewhere."""

from __future__ import annotations

import itertools
import logging
import os
import time

access_log = logging.getLogger("fusedserve.access")


class RequestIdMiddleware:
    def __init__(self, app, is_draining):
        self.app = app
        self.is_draining = is_draining
        # A random per-process prefix and a counter: unique like a uuid4, without a getrandom()
        # system call per request.
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value[:200]  # echo, bounded: a header must not grow our responses unboundedly
                break
        if request_id is None:
            request_id = f"{self._prefix}{next(self._count):016x}".encode()
        start = time.perf_counter()
        status = 0

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id))
                if self.is_draining():
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if access_log.isEnabledFor(logging.INFO):
                rid = request_id.decode(errors="replace")
                ms = (time.perf_counter() - start) * 1e3
                access_log.info("%s %s %d %.2f ms request_id=%s", scope["method"], scope["path"], status, ms, rid,
                                extra={"request_id": rid, "method": scope["method"], "path": scope["path"],
                                       "status": status, "duration_ms": round(ms, 3)})
