"""What /model-stats answers, built where the models are: per model the request rate, latency p50/p99,
queue depth and errors by HTTP status, and the peak rates of the devices the models run on. Read from
the same stats object as /kernel-stats, so POST /kernel-stats/reset clears both."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fusedserve.service.errors import ServiceError
from fusedserve.service.stats.peaks import device_peaks

if TYPE_CHECKING:
    from fusedserve.service.engine.state import ModelInfo, ServiceState


def outcome_statuses() -> dict[str, int]:
    """The HTTP status of each outcome label the stats and /metrics count requests under."""
    statuses, todo = {"ok": 200, "error": 500}, [ServiceError]
    while todo:
        cls = todo.pop()
        statuses.setdefault(cls.outcome, cls.status)
        todo.extend(cls.__subclasses__())
    return statuses


def by_status(outcomes: dict[str, int], statuses: dict[str, int]) -> dict[str, int]:
    """Answers other than 200 summed by HTTP status (an unknown outcome counts as a 500)."""
    errors: dict[str, int] = {}
    for outcome, count in outcomes.items():
        status = statuses.get(outcome, 500)
        if status != 200:
            errors[str(status)] = errors.get(str(status), 0) + count
    return dict(sorted(errors.items()))


def _model_row(info, row: dict, queued: int, window_s: float, statuses: dict) -> dict:
    outcomes = row.get("outcomes", {})
    answered = sum(outcomes.values())
    empty = {"count": 0, "mean_s": 0.0, "p50_s": 0.0, "p99_s": 0.0}
    return {"device": info.device, "dtype": info.dtype, "backend": info.backend,
            "in_features": info.in_features, "out_features": info.out_features,
            "requests": answered, "requests_per_s": answered / window_s,
            "latency": row.get("latency", empty), "queue_wait": row.get("queue_wait", empty),
            "queued_rows": queued, "errors_by_status": by_status(outcomes, statuses), "outcomes": outcomes}


def snapshot(state: ServiceState) -> dict:
    """/model-stats from the process that holds the models (``LocalEngine.model_stats``)."""
    queued = {name: batcher.queued_rows for name, batcher in state.batchers.items()}
    devices = {info.device: device_peaks(info.device) for info in state.models.values()}
    return build(state.stats.snapshot(), state.models, queued, devices)


def build(snap: dict, models: Mapping[str, ModelInfo], queued: Mapping[str, int], devices: dict) -> dict:
    """/model-stats from a stats snapshot (``ServiceStats.snapshot``), the served models, the rows
    queued per model and the peaks of their devices (``device_peaks``, by device)."""
    window_s = max(time.time() - snap["since_unix_s"], 1e-6)
    statuses = outcome_statuses()
    rows = {name: _model_row(info, snap["models"].get(name, {}), queued.get(name, 0), window_s, statuses)
            for name, info in sorted(models.items())}
    # Refused before a served model was known (no model named, an unknown one): counted apart.
    stray = dict(snap["unattributed_outcomes"])
    for name, row in snap["models"].items():
        if name not in models:
            for outcome, count in row.get("outcomes", {}).items():
                stray[outcome] = stray.get(outcome, 0) + count
    return {"since_unix_s": snap["since_unix_s"], "window_s": window_s, "models": rows,
            "unattributed": {"requests": sum(stray.values()), "errors_by_status": by_status(stray, statuses)},
            "devices": devices}
