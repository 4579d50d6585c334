"""Pure ASGI middleware (no per-request task, unlike BaseHTTPMiddleware): X-Request-ID echoed or
generated, and ``Connection: close`` on every answer while draining so clients reconnect elsewhere."""

from __future__ import annotations

import itertools
import os


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

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id))
                if self.is_draining():
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
