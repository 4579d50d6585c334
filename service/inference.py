"""One HTTP request through the engine: its deadline (the server's, or shorter from a header) and a
watch for the client disconnecting; the engine counts it in the stats and metrics."""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import Request

from fusedserve.service.engine import Engine
from fusedserve.service.errors import BadInput
from fusedserve.service.state import ServiceState

TIMEOUT_HEADER = "x-request-timeout-ms"


def _timeout_s(state: ServiceState, request: Request) -> float:
    limit = state.settings.request_timeout_ms
    asked = request.headers.get(TIMEOUT_HEADER)
    if asked is not None:
        try:
            value = float(asked)
        except ValueError:
            raise BadInput(f"{TIMEOUT_HEADER} must be a number of milliseconds, got {asked!r}") from None
        if not value > 0:
            raise BadInput(f"{TIMEOUT_HEADER} must be > 0, got {asked!r}")
        limit = min(limit, value)  # a client may only shorten the server's deadline
    return limit / 1000.0


async def _disconnected(request: Request) -> None:
    # After the body is read, the next ASGI message is http.disconnect (client left or response done).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def infer(state: ServiceState, request: Request, model: str, x: np.ndarray) -> np.ndarray:
    """Outputs [rows, out] for ``x``; raises ServiceError subclasses (recorded by the app's handler)."""
    request.state.model = model
    timeout_s = _timeout_s(state, request)
    engine: Engine = request.app.state.engine
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        return await engine.infer(model, x, timeout_s, abandon=watch)
    finally:
        watch.cancel()
