"""What the routes share: settings, stats, metrics, one batcher per model, readiness."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusedserve.service.errors import BadInput, NotReady, UnknownModel
from fusedserve.service.logs import seconds_since_start
from fusedserve.service.settings import Settings
from fusedserve.service.stats.metrics import Metrics
from fusedserve.service.stats.service_stats import ServiceStats

if TYPE_CHECKING:  # torch: only the process that runs the models imports it
    from fusedserve.service.engine.batcher import Batcher


LOAD_FAILED, WARMUP_FAILED, UNLOADED = "failed to load", "warm-up failed", "unloaded"  # how ``failed`` reasons start


@dataclass
class ModelInfo:
    name: str
    in_features: int
    out_features: int
    dtype: str
    backend: str
    device: str
    version: str = "1"  # the served version (a numbered folder of the model directory, or "1")
    labels: tuple[str, ...] = ()  # a classifier's class labels, one per output (service.classification)


log = logging.getLogger("fusedserve")


class Startup:
    """Where start-up's time went, phase by phase, each logged once as it ends: its seconds, when it
    ended (``at_s``, seconds since the command started) and what it did. /kernel-stats shows it."""

    def __init__(self):
        self.phases: dict[str, dict] = {}

    def record(self, phase: str, seconds: float | None = None, **detail) -> None:
        """``phase`` ended now, after ``seconds`` (None: a moment, not a span); ``detail`` says what it did."""
        at = seconds_since_start()
        entry = {"at_s": round(at, 3), **({} if seconds is None else {"seconds": round(seconds, 3)}), **detail}
        self.phases[phase] = entry
        took = "" if seconds is None else f" in {seconds:.2f} s"
        extra = "".join(f", {key} {value}" for key, value in detail.items())
        log.info("start-up: %s%s, %.2f s since start%s", phase, took, at, extra)

    def snapshot(self) -> dict:
        return {phase: dict(entry) for phase, entry in self.phases.items()}


@dataclass
class ServiceState:
    settings: Settings
    stats: ServiceStats
    metrics: Metrics
    models: dict[str, ModelInfo] = field(default_factory=dict)
    batchers: dict[str, Batcher] = field(default_factory=dict)
    runners: dict[str, Any] = field(default_factory=dict)  # models.ModelRunner per model
    tuner: Any = None  # the models.background.BackgroundTuner once ready, where it runs
    serving: bool = False  # models loaded, warmed up, batchers running
    draining: bool = False  # SIGTERM seen: still answering, but readiness says no
    startup_error: str | None = None
    # Models not served, and why: failed to load or warm up while the others serve (``exit_on_error``
    # off), or unloaded by model control.
    failed: dict[str, str] = field(default_factory=dict)
    # Run once, on the event loop, when draining starts: each front end's own drain (gRPC's).
    drain_hooks: list[Callable[[], None]] = field(default_factory=list)
    startup: Startup = field(default_factory=Startup)  # start-up's phases and their seconds

    @classmethod
    def fresh(cls, settings: Settings) -> ServiceState:
        """A state whose stats hear every request /metrics counts (outcomes by status for
        /model-stats, cleared on reset); the one way an app or engine process builds its state."""
        stats = ServiceStats()
        return cls(settings=settings, stats=stats, metrics=Metrics(on_request=stats.record_outcome))

    def start_draining(self) -> None:
        """Readiness turns false, and every front end starts to drain."""
        self.draining = True
        while self.drain_hooks:
            self.drain_hooks.pop(0)()

    def collect_timings(self) -> None:
        """Hand every layer timing the device has finished to the stats and metrics, without
        waiting for the rest (CUDA events resolve lazily; a reader should see what is done)."""
        for runner in self.runners.values():
            runner.collect_timings()

    @property
    def stalled(self) -> list[str]:
        """Models whose batch loop died while serving: nothing will answer their requests."""
        if not self.serving or self.draining:
            return []
        return sorted(name for name, b in self.batchers.items() if not b.running)

    def model_readiness(self) -> dict[str, tuple[bool, str | None]]:
        """Per model: whether it answers requests now, and the stage it failed at (load, warmup)."""
        out = {name: (self.ready and name in self.batchers, None) for name in self.models}
        for name, reason in self.failed.items():
            out[name] = (False, "load" if reason.startswith(LOAD_FAILED) else
                         "warmup" if reason.startswith(WARMUP_FAILED) else "unloaded")
        return out

    @property
    def ready(self) -> bool:
        return self.serving and not self.draining and not self.stalled

    @property
    def reason(self) -> str:
        """Why the service is not ready (or not live), for the probes and errors."""
        return ("draining" if self.draining else
                f"start-up failed: {self.startup_error}" if self.startup_error else
                f"the batch loop stopped for {self.stalled}" if self.stalled else "warming up")

    def model(self, name: str | None) -> ModelInfo:
        """The named model; ``None`` picks the only one. Raises 404/422/503 with what to send."""
        if not self.serving:
            why = f"start-up failed: {self.startup_error}" if self.startup_error else \
                "models are still loading or warming up"
            raise NotReady(f"the server is not ready: {why}", headers={"Retry-After": "1"})
        return pick_model(self.models, name, self.failed)


def pick_model(models: dict[str, ModelInfo], name: str | None, failed: dict[str, str]) -> ModelInfo:
    """The named model among ``models``; ``None`` picks the only one. Raises 404/422 with what to
    send, or 503 with why for a model in ``failed``."""
    if name is None:
        if len(models) == 1:
            return next(iter(models.values()))
        raise BadInput(f"name the model: this server serves {sorted(models)}")
    info = models.get(name)
    if info is None and name in failed:
        raise NotReady(f"model {name!r} is not ready: {failed[name]}")
    if info is None:
        raise UnknownModel(f"unknown model {name!r}; loaded models: {sorted(models)}")
    return info
