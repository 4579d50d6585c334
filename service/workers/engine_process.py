"""The engine process of ``--workers N``: owns the models, the batchers, the runners (CUDA graphs) and
the stats, and serves the front ends over one Unix stream socket each (``service.workers.wire`` frames).

Rows from every front end go through the same ``LocalEngine`` and so into one queue per model: a
batch merges rows from all of them. A front end's connection closing withdraws its requests not
yet in a batch. Started by ``service.workers.supervisor`` (spawned, never forked: it may touch CUDA); SIGTERM
stops it once the front ends have drained, SIGINT is the supervisor's to act on."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
from collections.abc import Callable

from fusedserve.service.engine import startup
from fusedserve.service.engine.client import LocalEngine
from fusedserve.service.engine.state import ServiceState
from fusedserve.service.errors import ClientGone, NotReady, ServiceError
from fusedserve.service.logs import configure
from fusedserve.service.settings import Settings
from fusedserve.service.stats.sinks import LayerSinks
from fusedserve.service.workers import wire
from fusedserve.service.workers.supervisor import HEARTBEAT_S, IMPORTED, LOADED, until_orphaned

log = logging.getLogger("fusedserve")
STATUS_POLL_S = 0.05  # how often readiness changes are looked for and pushed to the front ends


class Connection(asyncio.Protocol):
    """One front end: its requests in flight (each with the group that holds it) and its outbox."""

    def __init__(self, server: EngineServer, origin: int):
        self.server = server
        self.origin = origin  # tells this front end's requests apart in a batch
        self.frames = wire.Frames()
        self.groups: dict[int, Group] = {}  # request id -> its group, until answered or withdrawn
        self.outbox: wire.Outbox | None = None

    def connection_made(self, transport) -> None:
        self.outbox = wire.Outbox(transport)
        self.server.connections.add(self)
        self.outbox.send(wire.json_frame(wire.STATUS, 0, self.server.status()))

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        groups, self.groups = set(self.groups.values()), {}
        for group in groups:  # nobody is left to answer: never compute them
            group.withdraw()

    def data_received(self, data: bytes) -> None:
        for kind, ident, payload in self.frames.feed(data):
            if kind == wire.INFER:
                self._infer(ident, payload)
            elif kind == wire.CANCEL:
                group = self.groups.pop(ident, None)
                if group is not None:
                    group.drop()
            elif kind == wire.CONTROL:
                asyncio.ensure_future(self._control(ident, payload))
            elif kind == wire.PING:  # answered here, on the event loop, whatever batch is running
                self.outbox.send(wire.PONG_FRAME)

    def _infer(self, ident: int, payload: bytearray) -> None:
        try:
            model, idents, rows, x, timeout_s = wire.read_infer(payload)
        except ServiceError as exc:  # a front end's bug: its first request hears of it, the rest time out
            log.error("bad INFER frame from front end %d: %s", self.origin, exc)
            self.outbox.send(wire.json_frame(wire.ERROR, ident, wire.error_payload(exc)))
            return
        group = Group(self, idents, rows)
        for i in idents:
            self.groups[i] = group
        try:
            group.withdraw = self.server.submit(model, x, timeout_s, group.answer, self.origin, len(idents))
        except Exception as exc:  # noqa: BLE001 - refused at once (queue full, not serving) or a bug
            group.answer(None, exc)

    async def _control(self, ident: int, payload: bytearray) -> None:
        try:
            reply = await self.server.control(json.loads(payload))
        except Exception as exc:  # noqa: BLE001 - the front end answers it as an error
            log.exception("engine control message failed")
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if ident:
            self.outbox.send(wire.json_frame(wire.REPLY, ident, reply))


class Group:
    """The requests of one INFER frame, queued and answered as one: each gets its rows of the output
    (or the error) unless withdrawn; once all are withdrawn the group leaves the queue."""

    def __init__(self, conn: Connection, idents: list[int], rows: list[int]):
        self.conn, self.idents, self.rows = conn, idents, rows
        self.live = len(idents)
        self.withdraw: Callable[[], None] = _nothing

    def drop(self) -> None:
        """One of its requests was withdrawn (its client left, its deadline passed at the front end)."""
        self.live -= 1
        if self.live == 0:
            self.withdraw()

    def answer(self, out, error: BaseException | None) -> None:
        conn, groups, start = self.conn, self.conn.groups, 0
        frame = None if error is None else _error_frame(error)
        for ident, n in zip(self.idents, self.rows, strict=True):
            if groups.get(ident) is self:
                del groups[ident]
                if error is None:
                    conn.outbox.send(*wire.result_frame(ident, out[start:start + n]))
                elif frame is not None:
                    conn.outbox.send(wire.json_frame(wire.ERROR, ident, frame))
            start += n


def _nothing() -> None:
    pass


def _error_frame(error: BaseException) -> dict | None:
    """The ERROR payload for ``error``; None for ClientGone (the front end already answered)."""
    if isinstance(error, ClientGone):
        return None
    if not isinstance(error, ServiceError):  # a bug: answered, logged, never a hung request
        log.error("engine request failed", exc_info=error)
        error = ServiceError(f"internal error in the engine: {type(error).__name__}: {error}")
    return wire.error_payload(error)


class EngineServer:
    """The engine's side of every front-end connection, over this process's ``ServiceState``."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.engine = LocalEngine(state)
        self.connections: set[Connection] = set()
        self._names: list[str] = []
        self._max_rows = state.settings.max_batch_size  # of a group; each request's were checked
        self._last_status: dict | None = None

    def status(self) -> dict:
        state = self.state
        self._names = list(state.models)
        return {"models": [[m.name, m.in_features, m.out_features, m.dtype, m.backend, m.device, m.version,
                            list(m.labels)]
                           for m in state.models.values()],
                "failed": dict(state.failed),
                "serving": state.serving, "live": self.engine.live(), "ready": state.ready,
                "reason": state.reason, "startup_error": state.startup_error}

    async def watch_status(self) -> None:
        """Push the status to every front end whenever it changes (warm, draining, a loop died)."""
        while True:
            status = self.status()
            if status != self._last_status:
                self._last_status = status
                frame = wire.json_frame(wire.STATUS, 0, status)
                for conn in list(self.connections):
                    conn.outbox.send(frame)
            await asyncio.sleep(STATUS_POLL_S)

    def submit(self, model: int, x, timeout_s: float, answer: Callable, origin: int,
               requests: int) -> Callable[[], None]:
        if not self.state.serving or self.state.draining:
            raise NotReady("the engine is not serving (warming up or stopping); retry shortly",
                           headers={"Retry-After": "1"})
        name = self._names[model]
        info = self.state.models[name]
        if x.shape[1] != info.in_features or x.shape[0] > self._max_rows:  # the front end checks: a bug
            raise ServiceError(f"rows {x.shape} do not fit model {name!r}")
        return self.engine.submit(name, x, timeout_s, answer, origin, requests)

    async def control(self, message: dict):
        op, engine = message.get("op"), self.engine
        if op == "record_error":
            engine.record_error(message["model"], message["outcome"])
            return None
        if op == "record_unexpected":
            engine.record_unexpected(message["where"])
            return None
        if op == "kernel_stats":
            snap = await engine.kernel_stats()
            snap["processes"] = {
                "front_ends_connected": len(self.connections),
                "batches_with_rows_from_several_front_ends": {
                    name: b.mixed_batches for name, b in self.state.batchers.items()}}
            return snap
        if op == "reset_stats":
            await engine.reset_stats()
            for batcher in self.state.batchers.values():
                batcher.mixed_batches = 0
            return {"reset": True}
        if op == "metrics":
            return (await engine.metrics_text()).decode()
        if op == "model_stats":
            return await engine.model_stats()
        if op == "stats_export":
            self.state.collect_timings()
            return self.state.stats.export()
        if op == "model_counts":
            return await engine.model_counts(message["model"])
        raise ValueError(f"unknown control op {op!r}")


async def _stop_when_orphaned(supervisor: int | None, stop: asyncio.Event) -> None:
    await until_orphaned(supervisor)
    stop.set()


async def _beat(fd: int) -> None:
    """A byte into the supervisor's heartbeat pipe every ``HEARTBEAT_S``, from this event loop: when
    they stop coming, the loop is stopped or wedged and the supervisor restarts this process."""
    os.set_blocking(fd, False)
    while True:
        try:
            os.write(fd, b".")
        except BlockingIOError:  # the supervisor has not read them yet: one more adds nothing
            pass
        except BrokenPipeError:
            log.warning("the supervisor's heartbeat pipe closed: no more heartbeats")
            return
        await asyncio.sleep(HEARTBEAT_S)


async def serve(settings: Settings, path: str, ready_fd: int | None, supervisor: int | None = None,
                heartbeat_fd: int | None = None, label: str | None = None) -> None:
    log.info("engine%s imported its code; loading models", f" {label}" if label else "")
    if ready_fd is not None:  # the front ends may start importing theirs while this one loads
        os.write(ready_fd, IMPORTED)
    # Beats from the start: loading and warm-up run on threads, so a long one is never a silent loop.
    beat = None if heartbeat_fd is None else asyncio.create_task(_beat(heartbeat_fd))
    state = ServiceState.fresh(settings)
    state.metrics.watch_queues(state.batchers)
    server = EngineServer(state)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    orphaned = asyncio.create_task(_stop_when_orphaned(supervisor, stop))  # watched while models load too
    runners = await startup.load(state, LayerSinks((state.stats, state.metrics)))
    if label is not None:  # one of several engines: its models say which (cpu:0 and cpu:1 share "cpu")
        for info in state.models.values():
            info.device = label
    if stop.is_set():  # stopped or orphaned while loading: nothing to answer yet
        orphaned.cancel()
        return
    if os.path.exists(path):
        os.unlink(path)  # left by the engine this one replaces
    origins = itertools.count(1)
    listener = await loop.create_unix_server(lambda: Connection(server, next(origins)), path, backlog=1024)
    if ready_fd is not None:  # tell the supervisor the models loaded: from now on a crash is restarted
        os.write(ready_fd, LOADED)
        os.close(ready_fd)
    log.info("engine%s listening on %s", f" {label}" if label else "", path)
    tasks = [asyncio.create_task(startup.warm_up_and_serve(state, runners)),
             asyncio.create_task(server.watch_status()), orphaned, *([beat] if beat else [])]
    await stop.wait()
    state.draining = True
    await startup.stop(state, tasks[0])  # the batchers answer what they queued
    listener.close()
    for task in tasks[1:]:
        task.cancel()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fusedserve engine process (started by the supervisor)")
    p.add_argument("--socket", required=True)
    p.add_argument("--settings-fd", type=int, required=True, help="a pipe holding Settings.handoff()'s JSON")
    p.add_argument("--ready-fd", type=int, default=None)
    p.add_argument("--heartbeat-fd", type=int, default=None, help="a pipe to write a byte to every HEARTBEAT_S")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text")
    p.add_argument("--supervisor", type=int, default=None, help="its PID (default: the parent at start)")
    p.add_argument("--label", default=None, help="one of several engines: its device label in stats and metrics")
    args = p.parse_args(argv)
    configure(args.log_level, args.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us once the front ends are done
    settings = Settings.from_fd(args.settings_fd)
    main_task = serve(settings, args.socket, args.ready_fd, args.supervisor, args.heartbeat_fd, args.label)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_task)
    else:
        uvloop.run(main_task)


if __name__ == "__main__":
    main()
