"""uvicorn with a drain on SIGTERM. Readiness turns false, the listening socket closes (new
connections are refused, so clients go to another replica) and every connection already accepted
keeps being answered, each answer with ``Connection: close``, for ``drain_grace_s``; the process
exits as soon as no connection is left, or at the end of the grace, when idle connections close and
requests still being read or answered get ``shutdown_timeout_s`` more. Plain uvicorn closes idle
keep-alive connections at once, so requests already on their way got a connection reset.
The gRPC server drains at the same moment (``ServiceState.drain_hooks``): new calls are refused,
calls in flight are answered. ``uvicorn_config`` builds the config every front end serves with."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from fusedserve.service.connections import connection_cap
from fusedserve.service.engine.state import ServiceState
from fusedserve.service.http.connection import Limits, protocol_class
from fusedserve.service.settings import Settings

log = logging.getLogger("fusedserve")
_POLL_S = 0.05  # how often the drain looks whether every connection is gone


def limits(settings: Settings) -> Limits:
    return Limits(max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s,
                  body_timeout_s=settings.body_timeout_s,
                  max_connections=connection_cap(settings))


def uvicorn_config(app, settings: Settings, log_level: str) -> uvicorn.Config:
    """The uvicorn config of a front end: our guarded protocol, and a bounded graceful shutdown.
    Our middleware writes the access log, with the request id; uvicorn's own would repeat it."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, lifespan="on",
                          access_log=False, log_config=None, http=protocol_class(limits(settings)),
                          timeout_graceful_shutdown=settings.shutdown_timeout_s)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServiceState, grace_s: float):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.Task | None = None
        self._drain_asked = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # A second signal, or one before the loop runs, stops at once (uvicorn's own behaviour).
        if sig != signal.SIGTERM or self._drain_asked or self._loop is None or self.grace_s <= 0:
            super().handle_exit(sig, frame)
            return
        self._drain_asked = True
        log.info("SIGTERM: draining for up to %.1f s: new connections refused, open ones answered", self.grace_s)
        # call_soon_threadsafe is the loop API that is safe from a signal handler.
        self._loop.call_soon_threadsafe(self._start_drain, sig, frame)

    def _start_drain(self, sig: int, frame) -> None:
        # In one callback: no answer says "Connection: close" while the listener still accepts
        # the client's reconnection (that connection would be reset when the listener closes).
        self.state.start_draining()
        stop_accepting(self)
        self._watch = asyncio.ensure_future(self._exit_when_answered(sig, frame))

    async def _exit_when_answered(self, sig: int, frame) -> None:
        """Stop once no accepted connection is left, or when the grace period ends."""
        end = self._loop.time() + self.grace_s
        while self._loop.time() < end and (self.server_state.connections or self.server_state.tasks):
            await asyncio.sleep(_POLL_S)
        log.info("drain: %d connection(s) still open after %.2f s; shutting down", len(self.server_state.connections),
                 self.grace_s - max(0.0, end - self._loop.time()))
        super().handle_exit(sig, frame)


def stop_accepting(server: uvicorn.Server) -> None:
    """Close the listening sockets: the kernel refuses new connections; accepted ones stay open."""
    for listener in getattr(server, "servers", []):
        listener.close()
