"""bench/startup.py: where the time to ready went, read from the server's log timestamps."""

import datetime

from bench.startup import phases


def test_phases_are_seconds_from_the_start_to_each_marks_last_line():
    start = datetime.datetime(2026, 12, 5, 14, 0, 0)
    lines = ["2026-12-05 14:00:03,500 INFO uvicorn.error: Started server process [1]",
             "2026-12-05 14:00:04,000 INFO fusedserve.models.loading: loaded model 'a' from ...",
             "2026-12-05 14:00:04,250 INFO fusedserve.models.loading: loaded model 'b' from ...",
             "2026-12-05 14:00:04,300 INFO fusedserve.access: GET /v2/health/ready 503",
             "not a log line: loaded model",
             "2026-12-05 14:00:06,000 INFO fusedserve.models.runner: start-up 'a': warm in 1.7 s",
             "2026-12-05 14:00:06,100 INFO fusedserve: ready after 2.0 s of warm-up: ['a', 'b']"]
    assert phases(lines, start.timestamp()) == {"imported": 3.5, "models_loaded": 4.25, "warm": 6.0, "ready": 6.1}
