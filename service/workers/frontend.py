"""A front-end process of ``--workers N``: the FastAPI app and its hot path under uvicorn, on the
listening socket the supervisor bound and handed down, with a ``RemoteEngine`` in place of the
models. Every front end serves gRPC too, on one port shared with SO_REUSEPORT. SIGTERM drains it
(``DrainingServer``) like a single process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from fusedserve.service.app import create_app
from fusedserve.service.http.server import DrainingServer, stop_accepting, uvicorn_config
from fusedserve.service.logs import configure
from fusedserve.service.settings import Settings
from fusedserve.service.workers.supervisor import until_orphaned

log = logging.getLogger("fusedserve")
SIBLINGS_SETTLE_S = 0.2  # how long after SIGTERM every front end's listener is surely closed
# Tests only: every request for the model this names fails in the front end with a bug (a
# RuntimeError), so a test can see such failures answered and counted.
FAULT_ENV = "FUSEDSERVE_TEST_FAULT_MODEL"


class FrontEndServer(DrainingServer):
    """``DrainingServer`` that also drains itself once orphaned (its supervisor was killed)."""

    def __init__(self, *args, supervisor: int | None = None):
        super().__init__(*args)
        self.supervisor = supervisor

    async def serve(self, sockets=None) -> None:
        watch = asyncio.ensure_future(self._drain_when_orphaned())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    def _start_drain(self, sig: int, frame) -> None:
        # Every front end closes its listener first and only then answers "Connection: close":
        # otherwise clients told to reconnect land in a sibling's accept queue, which is reset when
        # that sibling closes its listener a moment later.
        stop_accepting(self)
        self._loop.call_later(SIBLINGS_SETTLE_S, super()._start_drain, sig, frame)

    async def _drain_when_orphaned(self) -> None:
        await until_orphaned(self.supervisor)
        self.handle_exit(signal.SIGTERM, None)


def _inject_fault(engine, model: str) -> None:
    """Make ``engine.infer`` raise a RuntimeError for ``model`` (``FAULT_ENV``)."""
    infer = engine.infer

    async def failing(name: str, *args, **kwargs):
        if name == model:
            raise RuntimeError(f"fault injected for model {model!r} by {FAULT_ENV}")
        return await infer(name, *args, **kwargs)

    log.warning("%s is set: every request for model %r fails (tests only)", FAULT_ENV, model)
    engine.infer = failing


def _engines(args: list[str]) -> str | dict[str, str]:
    """``--engine`` values as ``create_app`` takes them: one path, or ``{label: path}``."""
    if len(args) == 1 and "=" not in args[0]:
        return args[0]
    pairs = [arg.partition("=") for arg in args]
    bad = [arg for arg, (_, sep, _) in zip(args, pairs, strict=True) if not sep]
    if bad:
        raise SystemExit(f"--engine wants LABEL=PATH when there are several, got {bad[0]!r}")
    return {label: path for label, _, path in pairs}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fusedserve front-end process (started by the supervisor)")
    p.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    p.add_argument("--engine", action="append", required=True,
                   help="the engine process's Unix socket; LABEL=PATH for each of several (one per device)")
    p.add_argument("--settings-fd", type=int, required=True, help="a pipe holding Settings.handoff()'s JSON")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text")
    p.add_argument("--supervisor", type=int, default=None, help="its PID (default: the parent at start)")
    args = p.parse_args(argv)
    configure(args.log_level, args.log_format)
    settings = Settings.from_fd(args.settings_fd)
    app = create_app(settings, engine_process=_engines(args.engine))
    if os.environ.get(FAULT_ENV):
        _inject_fault(app.state.engine, os.environ[FAULT_ENV])
    config = uvicorn_config(app, settings, args.log_level)  # the guarded protocol, as one process has
    # socket(fileno=) finds the family itself (TCP): asyncio then sets TCP_NODELAY on each connection.
    server = FrontEndServer(config, app.state.service, settings.drain_grace_s, supervisor=args.supervisor)
    server.run(sockets=[socket.socket(fileno=args.fd)])


if __name__ == "__main__":
    main()
