"""uvicorn with a drain on SIGTERM: readiness turns false and every connection keeps being answered
(with ``Connection: close``) for ``drain_grace_s``; only then does uvicorn stop. Plain uvicorn closes
idle keep-alive connections at once, so requests already on their way get a connection reset.
The gRPC server drains at the same moment (``ServiceState.drain_hooks``): new calls are refused,
calls in flight are answered."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from fusedserve.service.state import ServiceState

log = logging.getLogger("fusedserve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServiceState, grace_s: float):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # A second signal, or one before the loop runs, stops at once (uvicorn's own behaviour).
        if sig != signal.SIGTERM or self.state.draining or self._loop is None or self.grace_s <= 0:
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        log.info("SIGTERM: draining for %.1f s before closing connections", self.grace_s)
        # call_soon_threadsafe is the loop API that is safe from a signal handler.
        self._loop.call_soon_threadsafe(self.state.start_draining)
        self._loop.call_soon_threadsafe(self._loop.call_later, self.grace_s, super().handle_exit, sig, frame)
