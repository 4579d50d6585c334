"""One HTTP request through the engine: its deadline (the server's, or shorter from a header) and a
watch for the client disconnecting; the engine counts it in the stats and metrics."""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import Request

from fusedserve.service.engine.client import Engine
from fusedserve.service.engine.state import ServiceState
from fusedserve.service.errors import BadInput

TIMEOUT_HEADER = "x-request-timeout-ms"


def timeout_s(state: ServiceState, asked: str | None) -> float:
    """The request's deadline in seconds: the server's, or a shorter one the client asked for."""
    limit = state.settings.request_timeout_ms
    if asked is not None:
        try:
            value = float(asked)
        except ValueError:
            raise BadInput(f"{TIMEOUT_HEADER} must be a number of milliseconds, got {asked!r}") from None
        if not value > 0:
            raise BadInput(f"{TIMEOUT_HEADER} must be > 0, got {asked!r}")
        limit = min(limit, value)  # a client may only shorten the server's deadline
    return limit / 1000.0


async def _disconnected(receive) -> None:
    # After the body is read, the next ASGI message is http.disconnect (client left or response done).
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_rows(engine: Engine, model: str, x: np.ndarray, timeout: float, receive,
                   gone: asyncio.Future | None = None, alone: bool = False) -> np.ndarray:
    """Outputs [rows, out] for ``x``; raises ServiceError subclasses. A request whose client leaves
    first is withdrawn: ``gone`` (the HTTP protocol's ``middleware.GONE``) says so, else a watch on
    ``receive``, the request's ASGI receive. ``alone``: no other request is in progress on this
    server (``middleware.REQUESTS``), so none can join its batch."""
    if gone is not None:
        return await engine.infer(model, x, timeout, abandon=gone, alone=alone)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        return await engine.infer(model, x, timeout, abandon=watch)
    finally:
        watch.cancel()


async def infer(state: ServiceState, request: Request, model: str, x: np.ndarray) -> np.ndarray:
    """``run_rows`` for a framework route (its error handler records a failure)."""
    request.state.model = model
    timeout = timeout_s(state, request.headers.get(TIMEOUT_HEADER))
    return await run_rows(request.app.state.engine, model, x, timeout, request.receive)
