"""Live kernel timings: GET /kernel-stats, POST /kernel-stats/reset."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from fusedserve.service.state import ServiceState, get_state

router = APIRouter(prefix="/kernel-stats", tags=["stats"])


def _timing_policy(runner) -> dict:
    """How the runner times layers, so a reader knows whether ``calls`` counts every batch."""
    if runner.device.type == "cuda" and not runner.cuda_graphs:
        return {"sampled": False, "every_batch": True, "method": runner.timing_method}
    # Graph replays hide single kernels, and on the CPU a timed batch's records cost more than a
    # small model's compute: only some batches are timed layer by layer.
    return {"sampled": True, "every_batch": False, "method": runner.timing_method,
            "sample_every": runner.timing_sample_every,
            "min_interval_s": runner.timing_min_interval_s,
            "rule": "first batch of each bucket, then at most one batch in sample_every per bucket, "
                    "and at most one per min_interval_s"}


def _choices(runner) -> dict:
    """Per bucket whether its kernels run a provisional choice (not timed yet), a tuned one, or a
    fixed one (nothing is timed there); and how warm-up's seconds split."""
    return {"choices": {str(bucket): state for bucket, state in runner.choice_states.items()},
            "startup_s": {phase: round(s, 3) for phase, s in runner.startup_seconds.items()}}


@router.get("", summary="Per-layer kernel timings, batch sizes and queue waits")
async def kernel_stats(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    state.collect_timings()
    snap = state.stats.snapshot()
    snap["served"] = {
        name: {"in_features": m.in_features, "out_features": m.out_features, "dtype": m.dtype,
               "backend": m.backend, "device": m.device,
               "layer_timings": _timing_policy(state.runners[name]),
               **_choices(state.runners[name])}
        for name, m in state.models.items()}
    return snap


@router.post("/reset", summary="Clear every timing and histogram")
async def reset_kernel_stats(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    state.collect_timings()  # finished launches from before the reset must not show up after it
    state.stats.reset()
    return {"reset": True}
