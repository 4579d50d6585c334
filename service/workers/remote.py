"""``RemoteEngine``: the ``Engine`` of a front-end process (``--workers N``), over one Unix stream socket
to the engine process (``service.workers.wire`` frames: raw float32 rows, JSON only for control).

The engine pushes its status (models, live, ready) on connect and on every change. While the engine
process is gone, every request in flight and every new one is answered at once with 503 (NotReady,
Retry-After) and the probes fail; the connection is retried until the restarted engine answers.

A heartbeat (PING every ``HEARTBEAT_S``; any frame counts as an answer) finds an engine that is
there but answers nothing (stopped, wedged): after ``engine_heartbeat_timeout_s`` of silence its
requests in flight and every new one get 503 and readiness turns false until it answers again or
the supervisor restarts it. Liveness stays true meanwhile: this process is fine, and the supervisor,
not the orchestrator, restarts the engine (a pod restart would also drop every front end)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Mapping

import numpy as np
import orjson

from fusedserve.service.engine.state import ModelInfo, ServiceState, pick_model
from fusedserve.service.engine.waiting import wait_answer
from fusedserve.service.errors import NotReady
from fusedserve.service.workers import wire
from fusedserve.service.workers.supervisor import HEARTBEAT_S

log = logging.getLogger("fusedserve")
RECONNECT_S = 0.05  # between attempts to reach the engine process
CONTROL_TIMEOUT_S = 10.0  # a stats or metrics question the engine leaves unanswered this long fails
# The engine enforces each deadline; this much later the front end answers 504 itself (a stuck engine).
DEADLINE_SLACK_S = 0.1
FIRST_STATUS_S = 5.0  # how long start() waits for a listening engine's first status
GONE = "the engine process is not running (the supervisor restarts it); retry shortly"
STUCK = "the engine process stopped answering (silent for {:.1f} s; the supervisor restarts it); retry shortly"


def _gone() -> NotReady:
    return NotReady(GONE, headers={"Retry-After": "1"})


class RemoteEngine(asyncio.Protocol):
    """``service.engine.client.Engine`` for a front end; ``state`` is the front end's own (settings, draining)."""

    def __init__(self, path: str, state: ServiceState):
        self._path = path
        self._state = state
        self._transport: asyncio.Transport | None = None
        self._outbox: wire.Outbox | None = None
        self._frames = wire.Frames()
        self._groups: dict[tuple[int, float], wire.InferGroup] = {}  # this turn's requests, sent at its end
        self._max_group_rows = state.settings.max_batch_size  # the engine never splits what it queued
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._status: dict | None = None  # the engine's last status; None while disconnected
        self._models: dict[str, ModelInfo] = {}
        self._index: dict[str, int] = {}
        self._lost: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._first_try = asyncio.Event()
        self._heard = 0.0  # loop time of the engine's last frame
        self._stuck: str | None = None  # why requests get 503 while the engine is connected but silent
        self._beat: asyncio.Task | None = None

    # -- the connection ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect; returns once the engine's status came, or at once if no engine listens yet (a
        restarted front end must not answer its first requests 503 while its status is on the way)."""
        self._first_try = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._keep_connected(), name="engine-connection")
        timeout_s = self._state.settings.engine_heartbeat_timeout_s
        if timeout_s:
            self._beat = self._loop.create_task(self._heartbeat(timeout_s), name="engine-heartbeat")
        try:
            await asyncio.wait_for(self._first_try.wait(), FIRST_STATUS_S)
        except asyncio.TimeoutError:
            log.warning("the engine process sent no status within %.0f s; serving 503 until it does", FIRST_STATUS_S)

    async def close(self) -> None:
        self._closing = True
        tasks = [task for task in (self._task, self._beat) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._transport is not None:
            self._transport.close()

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._lost = loop.create_future()
            try:
                await loop.create_unix_connection(lambda: self, self._path)
            except OSError:
                self._first_try.set()
                await asyncio.sleep(RECONNECT_S)
                continue
            await self._lost
            await asyncio.sleep(RECONNECT_S)

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._outbox = wire.Outbox(transport, pack=self._pack_groups)
        self._frames = wire.Frames()
        self._groups = {}
        self._heard, self._stuck = self._loop.time(), None
        log.info("connected to the engine process")

    def connection_lost(self, exc) -> None:
        if self._status is not None and not self._closing:
            log.error("lost the engine process: answering its requests with 503 until it is back")
        self._transport, self._outbox, self._status, self._models = None, None, None, {}
        self._groups, self._stuck = {}, None
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(_gone())
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._heard = self._loop.time()
        if self._stuck is not None:
            self._stuck = None
            log.warning("the engine process answers again: serving")
        for kind, ident, payload in self._frames.feed(data):
            if kind == wire.STATUS:
                self._set_status(orjson.loads(payload))
                continue
            if kind == wire.PONG:
                continue
            future = self._pending.pop(ident, None)
            if future is None or future.done():
                continue  # withdrawn meanwhile
            if kind == wire.RESULT:
                future.set_result(wire.read_result(payload))
            elif kind == wire.ERROR:
                future.set_exception(wire.read_error(payload))
            elif kind == wire.REPLY:
                future.set_result(orjson.loads(payload))

    async def _heartbeat(self, timeout_s: float) -> None:
        """PING the engine every ``HEARTBEAT_S``; once it sent nothing for ``timeout_s``, answer what
        it holds and every new request 503 (``_silenced``) until it answers again."""
        loop = self._loop
        while True:
            tick = loop.time()
            await asyncio.sleep(HEARTBEAT_S)
            now = loop.time()
            if self._outbox is None or self._status is None:
                continue
            # A tick that came late means this process was stalled: the engine's answer may still
            # wait unread (uvloop runs timers before reading), so only an on-time tick may judge.
            on_time = now - tick < 2 * HEARTBEAT_S
            if on_time and self._stuck is None and now - self._heard > timeout_s:
                self._silenced(now - self._heard)
            self._outbox.send(wire.PING_FRAME)

    def _silenced(self, silent_s: float) -> None:
        self._stuck = STUCK.format(silent_s)
        log.error("%s: answering its %d requests in flight, and new ones, with 503", self._stuck, len(self._pending))
        for ident in list(self._pending):
            self._withdraw(ident, self._unavailable())

    def _unavailable(self) -> NotReady:
        """The 503 for a request the engine cannot take now: it is gone, or silent."""
        return _gone() if self._stuck is None else NotReady(self._stuck, headers={"Retry-After": "1"})

    def _set_status(self, status: dict) -> None:
        self._models = {row[0]: ModelInfo(*row) for row in status["models"]}
        self._index = {name: i for i, name in enumerate(self._models)}
        self._status = status
        self._first_try.set()

    # -- the Engine protocol ------------------------------------------------------------------------
    def models(self) -> Mapping[str, ModelInfo]:
        return self._models

    def live(self) -> bool:
        return self._status is not None and self._status["live"]

    def ready(self) -> bool:
        return self.serving() and not self._state.draining

    def serving(self) -> bool:
        """The engine is connected, answers, and is ready (warm, every batch loop running, not stopping)."""
        return self._status is not None and self._status["ready"] and self._stuck is None

    def connected(self) -> bool:
        """The engine is connected and answers (it may still be warming up)."""
        return self._outbox is not None and self._stuck is None

    def reason(self) -> str:
        if self._state.draining:
            return "draining"
        return GONE if self._status is None else self._stuck or self._status["reason"]

    def failed(self) -> Mapping[str, str]:
        return {} if self._status is None else self._status["failed"]

    def model(self, name: str | None) -> ModelInfo:
        status = self._status
        if status is None or self._stuck is not None:
            raise self._unavailable()
        if not status["serving"]:
            why = f"start-up failed: {status['startup_error']}" if status["startup_error"] else \
                "models are still loading or warming up"
            raise NotReady(f"the server is not ready: {why}", headers={"Retry-After": "1"})
        return pick_model(self._models, name, self.failed())

    async def infer(self, model: str, rows: np.ndarray, timeout_s: float,
                    abandon: asyncio.Future | None = None, alone: bool = False) -> np.ndarray:
        # (``alone`` is not sent: the engine process batches rows from every front end)
        if self._outbox is None or self._stuck is not None:
            raise self._unavailable()
        ident = next(self._ids) & wire.ID_MASK
        future = self._pending[ident] = self._loop.create_future()
        self._gather(self._index[model], ident, rows, timeout_s)
        return await wait_answer(future, model, timeout_s, abandon, functools.partial(self._withdraw, ident),
                                 slack_s=DEADLINE_SLACK_S)

    def _gather(self, model: int, ident: int, rows: np.ndarray, timeout_s: float) -> None:
        """Adds a request to this turn's group for its model and timeout: the engine queues, answers
        and times a group as one (its per-request cost was the engine's ceiling). A group that would
        outgrow a batch goes out at once."""
        key = (model, timeout_s)
        group = self._groups.get(key)
        if group is not None and (group.rows + rows.shape[0] > self._max_group_rows
                                  or len(group.entries) == wire.MAX_GROUP):
            self._outbox.send(*group.frame())
            group = None
        if group is None:
            group = self._groups[key] = wire.InferGroup(model, rows.shape[1], timeout_s)
            self._outbox.send()  # the flush at the turn's end packs it
        group.add(ident, rows)

    def _pack_groups(self) -> list:
        groups, self._groups = self._groups, {}
        return [chunk for group in groups.values() for chunk in group.frame()]

    def _withdraw(self, ident: int, error: Exception | None) -> None:
        """End the wait of request ``ident`` with ``error`` (None: cancel) and tell the engine to drop it."""
        future = self._pending.pop(ident, None)
        if future is None or future.done():
            return
        if error is None:
            future.cancel()
        else:
            future.set_exception(error)
        if self._outbox is not None:
            self._outbox.send(wire.cancel_frame(ident))

    def record_error(self, model: str, outcome: str) -> None:
        self._tell("record_error", model=model, outcome=outcome)

    def record_unexpected(self, where: str) -> None:
        self._tell("record_unexpected", where=where)

    def _tell(self, op: str, **fields) -> None:
        # The engine owns the metrics: a front end's counts go there (lost while it is gone or silent:
        # nothing would read them, and they would pile up in this process).
        if self._outbox is not None and self._stuck is None:
            self._outbox.send(wire.json_frame(wire.CONTROL, 0, {"op": op, **fields}))

    async def _ask(self, op: str, **fields):
        if self._outbox is None or self._stuck is not None:
            raise self._unavailable()
        ident = next(self._ids) & wire.ID_MASK
        future = self._pending[ident] = asyncio.get_running_loop().create_future()
        self._outbox.send(wire.json_frame(wire.CONTROL, ident, {"op": op, **fields}))
        try:
            reply = await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._pending.pop(ident, None)
            raise NotReady(f"the engine process did not answer {op!r} within {CONTROL_TIMEOUT_S:.0f} s") from None
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"the engine failed on {op!r}: {reply['error']}")
        return reply

    async def kernel_stats(self) -> dict:
        return await self._ask("kernel_stats")

    async def reset_stats(self) -> None:
        await self._ask("reset_stats")

    async def metrics_text(self) -> bytes:
        return (await self._ask("metrics")).encode()

    async def model_stats(self) -> dict:
        return await self._ask("model_stats")

    async def stats_export(self) -> dict:
        """The engine's ``ServiceStats.export``: what the totals over several engines are built from."""
        return await self._ask("stats_export")

    async def model_counts(self, model: str) -> dict:
        counts = await self._ask("model_counts", model=model)
        counts["batch_sizes"] = {int(k): v for k, v in counts["batch_sizes"].items()}
        return counts
