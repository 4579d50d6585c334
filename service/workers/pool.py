"""``EnginePool``: the ``Engine`` of a front end when there are several engine processes, one per device
(``--devices``): a ``RemoteEngine`` to each, behind one ``Engine``.

Each request goes whole to one engine: the one with the fewest of this front end's rows outstanding
for its model, among those that serve it now (ties go round in turn). An engine that is gone or
silent is out of rotation at once: ``RemoteEngine`` answers what it held with 503, and the others
take every new request while the supervisor restarts it. Readiness holds while the engines that
serve cover every model; liveness while any engine is live. Stats and metrics are asked of every
engine that answers and given per device and in total (``service.stats.devices``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.errors import NotReady
from fusedserve.service.stats import devices
from fusedserve.service.workers.remote import RemoteEngine


def engine_client(engine_process: str | Mapping[str, str], state: ServiceState):
    """The front end's ``Engine``: one engine process's socket path, or ``{device label: path}`` of several."""
    if isinstance(engine_process, str):
        return RemoteEngine(engine_process, state)
    return EnginePool(engine_process, state)


class EnginePool:
    def __init__(self, paths: Mapping[str, str], state: ServiceState):
        self._labels = list(paths)
        self._members = [RemoteEngine(path, state) for path in paths.values()]
        self._outstanding: list[dict[str, int]] = [{} for _ in self._members]  # per engine: model -> rows
        self._state = state
        self._turn = 0

    async def start(self) -> None:
        await asyncio.gather(*(member.start() for member in self._members))

    async def close(self) -> None:
        await asyncio.gather(*(member.close() for member in self._members))

    # -- routing ----------------------------------------------------------------------------------
    def _pick(self, model: str) -> int | None:
        """The engine for one request of ``model``: fewest rows outstanding, among those serving it."""
        n = len(self._members)
        self._turn = start = (self._turn + 1) % n
        best, fewest = None, 0
        for k in range(n):
            i = (start + k) % n
            member = self._members[i]
            if member.serving() and model in member.models():
                rows = self._outstanding[i].get(model, 0)
                if best is None or rows < fewest:
                    best, fewest = i, rows
        return best

    def _fallback(self) -> RemoteEngine:
        """The engine whose errors explain why none serves: the first connected one, else the first."""
        return next((m for m in self._members if m.connected()), self._members[0])

    async def infer(self, model: str, rows: np.ndarray, timeout_s: float,
                    abandon: asyncio.Future | None = None, alone: bool = False) -> np.ndarray:
        i = self._pick(model)
        if i is None:
            raise NotReady(f"no engine serves model {model!r} now ({self.reason()}); retry shortly",
                           headers={"Retry-After": "1"})
        outstanding, n = self._outstanding[i], rows.shape[0]
        outstanding[model] = outstanding.get(model, 0) + n
        try:
            return await self._members[i].infer(model, rows, timeout_s, abandon)
        finally:
            outstanding[model] -= n

    def outstanding(self) -> dict[str, dict[str, int]]:
        """Rows this front end has sent each engine and not yet had answered, by device label and model."""
        return {label: dict(rows) for label, rows in zip(self._labels, self._outstanding, strict=True)}

    # -- what the probes and routes ask -----------------------------------------------------------
    def models(self) -> Mapping[str, ModelInfo]:
        found: dict[str, ModelInfo] = {}
        for member in self._members:
            for name, info in member.models().items():
                found.setdefault(name, info)
        return found

    def model(self, name: str | None) -> ModelInfo:
        for member in self._members:
            if member.serving() and (name is None or name in member.models()):
                return member.model(name)
        return self._fallback().model(name)

    def live(self) -> bool:
        return any(member.live() for member in self._members)

    def _covered(self) -> bool:
        """Whether the engines serving now hold every model any connected engine has."""
        known: set[str] = set()
        served: set[str] = set()
        for member in self._members:
            known.update(member.models())
            if member.serving():
                served.update(member.models())
        return bool(served) and known <= served

    def ready(self) -> bool:
        return not self._state.draining and self._covered()

    def reason(self) -> str:
        if self._state.draining:
            return "draining"
        return "; ".join(f"engine {label}: {member.reason()}" for label, member in zip(
            self._labels, self._members, strict=True) if not member.serving()) or "serving"

    def failed(self) -> Mapping[str, str]:
        served = self.models()
        return {name: why for member in self._members for name, why in member.failed().items() if name not in served}

    def record_error(self, model: str, outcome: str) -> None:
        self._fallback().record_error(model, outcome)  # kept by one engine: the metrics add them up

    def record_unexpected(self, where: str) -> None:
        self._fallback().record_unexpected(where)

    # -- stats, per device and in total -----------------------------------------------------------
    async def _each(self, op: str, *args) -> dict:
        """``{label: answer}`` of every engine that answers ``op``; gone or silent ones are left out
        (NotReady), unless none answers."""
        answers = await asyncio.gather(*(getattr(m, op)(*args) for m in self._members), return_exceptions=True)
        found = {}
        for label, answer in zip(self._labels, answers, strict=True):
            if isinstance(answer, NotReady):
                continue
            if isinstance(answer, BaseException):
                raise answer
            found[label] = answer
        if not found:
            raise next(a for a in answers if isinstance(a, BaseException))
        return found

    async def _with_exports(self, op: str) -> tuple[dict, dict]:
        parts, exports = await asyncio.gather(self._each(op), self._each("stats_export"))
        both = parts.keys() & exports.keys()
        return ({k: v for k, v in parts.items() if k in both}, {k: v for k, v in exports.items() if k in both})

    async def kernel_stats(self) -> dict:
        snap = devices.merge_kernel_stats(*await self._with_exports("kernel_stats"))
        snap["processes"]["rows_outstanding_from_this_front_end"] = self.outstanding()
        return snap

    async def model_stats(self) -> dict:
        return devices.merge_model_stats(*await self._with_exports("model_stats"))

    async def reset_stats(self) -> None:
        await self._each("reset_stats")

    async def metrics_text(self) -> bytes:
        texts = await self._each("metrics_text")
        return devices.merge_metrics({label: text.decode() for label, text in texts.items()}).encode()

    async def model_counts(self, model: str) -> dict:
        return devices.merge_counts(list((await self._each("model_counts", model)).values()))
