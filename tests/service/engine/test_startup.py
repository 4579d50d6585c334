"""Start-up's phases: each logged once as it ends, with its seconds, and shown by /kernel-stats."""

import logging
import re

import pytest

PHASES = ["engine_start", "load", "front_ends", "compile", "warm_up", "ready"]  # in the order they end


@pytest.fixture
def info_logs(caplog):
    """INFO records from the app's start-up on (listed before ``client``, whose set-up starts it)."""
    caplog.set_level(logging.INFO, logger="fusedserve")
    return caplog


async def test_each_phase_is_logged_once_and_shown_in_kernel_stats(info_logs, client):
    startup = (await client.get("/kernel-stats")).json()["startup"]
    assert list(startup) == PHASES, startup
    ends = [startup[phase]["at_s"] for phase in PHASES]
    assert ends == sorted(ends) and ends[0] >= 0, startup
    assert startup["load"]["models"] == 2 and startup["load"]["seconds"] >= 0
    assert startup["warm_up"]["kernels_compiled"] == 0  # the CPU compiles no Triton kernel
    assert startup["ready"]["models"] == ["tiny", "wide"]
    lines = [r.getMessage() for r in info_logs.get_records("setup")]
    for phase in PHASES:
        assert len([line for line in lines if line.startswith(f"start-up: {phase}")]) == 1, (phase, lines)
    ready = [line for line in lines if line.startswith("ready after")]
    assert len(ready) == 1 and re.fullmatch(r"ready after \d+\.\d s since start: \['tiny', 'wide'\]", ready[0]), ready


@pytest.mark.parametrize("device, tuning, untuned, started", [
    ("cuda", True, True, True), ("cpu", True, True, False), ("cuda", False, True, False),
    ("cuda", True, False, False),  # a restart on a tuned cache: nothing will tune
])
async def test_the_compile_server_starts_before_warm_up_where_cuda_models_will_tune(monkeypatch, device, tuning,
                                                                                    untuned, started):
    # Its torch import then runs beside the warm-up, not in front of the first model's tuning.
    from types import SimpleNamespace

    from fusedserve.models import precompile
    from fusedserve.service.engine import startup

    calls = []
    monkeypatch.setattr(precompile, "start_compile_server", lambda: calls.append("server"))

    async def warm_up(state, runners):
        calls.append("warm-up")
        return []

    monkeypatch.setattr(startup, "_warm_up", warm_up)
    state = SimpleNamespace(settings=SimpleNamespace(background_tuning=tuning))
    runner = SimpleNamespace(device=SimpleNamespace(type=device), buckets=[1, 2], needs_tuning=lambda b: untuned)
    await startup.warm_up_and_serve(state, [runner])
    assert calls == (["server", "warm-up"] if started else ["warm-up"])
