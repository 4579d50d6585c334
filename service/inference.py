"""One request through its model's batcher: deadline, client disconnects, stats and metrics."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fastapi import Request

from fusedserve.service.errors import BadInput, ServiceError
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
    t0 = time.perf_counter()
    timeout_s = _timeout_s(state, request)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        out = await state.batchers[model].submit(x, timeout_s, abandon=watch)
    except ServiceError:
        state.stats.record_request(model, ok=False, seconds=time.perf_counter() - t0)
        raise
    finally:
        watch.cancel()
    state.stats.record_request(model, ok=True, seconds=time.perf_counter() - t0)
    state.metrics.record_request(model, "ok")
    return out
