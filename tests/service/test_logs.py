"""The JSON log format: one object per line, with extra= fields as keys."""

import json
import logging
import subprocess
import sys

from fusedserve.service.logs import JsonFormatter

from .conftest import ROOT


def record(msg, *args, exc_info=None, **extra):
    rec = logging.LogRecord("fusedserve.access", logging.INFO, __file__, 1, msg, args, exc_info)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_json_line_carries_message_and_extra_fields():
    line = JsonFormatter().format(record("%s %d", "POST", 200, request_id="abc", status=200))
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["message"] == "POST 200" and entry["level"] == "info", entry
    assert entry["logger"] == "fusedserve.access" and entry["time"].endswith("Z"), entry
    assert (entry["request_id"], entry["status"]) == ("abc", 200), entry


def test_json_line_keeps_the_exception():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        entry = json.loads(JsonFormatter().format(record("failed", exc_info=sys.exc_info())))
    assert "RuntimeError: boom" in entry["exception"], entry


def test_bad_log_format_from_the_environment_is_a_usage_error():
    env = {"FUSEDSERVE_LOG_FORMAT": "xml", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "fusedserve", "serve"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False, env=env)
    assert out.returncode == 2, out.stderr
    assert "log format must be one of" in out.stderr and "Traceback" not in out.stderr, out.stderr
