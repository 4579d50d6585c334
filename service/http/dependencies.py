"""FastAPI dependencies the routes share: the app's service state and its engine."""

from __future__ import annotations

from fastapi import Request

from fusedserve.service.engine.state import ServiceState


async def get_state(request: Request) -> ServiceState:
    # async on purpose: FastAPI runs a plain-def dependency in its thread pool, a thread hop per
    # request (on the 2-core dev machine ~12% of the event loop's time under load).
    return request.app.state.service


async def get_engine(request: Request):
    """The app's ``service.engine.client.Engine``: this process's models, or the engine process's."""
    return request.app.state.engine
