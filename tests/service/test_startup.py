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
