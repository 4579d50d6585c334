"""Log set-up for ``fusedserve serve``: plain text, or one JSON object per line (``--log-format json``)
for log shippers. Fields passed with ``extra=`` (the access log's request id, status, duration)
become keys of the JSON object."""

from __future__ import annotations

import json
import logging
import os
import time

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
# (uvicorn adds "color_message", an ANSI-coloured copy of the message: noise in JSON.)
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName", "color_message"}
FORMATS = ("text", "json")
# When ``fusedserve serve`` started (Unix seconds), in the environment so the processes it starts
# (--workers N) count from the same moment; a process started otherwise counts from this import.
STARTED_AT_ENV = "FUSEDSERVE_STARTED_AT"
_IMPORTED_AT = time.time()


def mark_start() -> None:
    os.environ[STARTED_AT_ENV] = repr(time.time())


def seconds_since_start() -> float:
    """Seconds since the command started: what the ready line reports."""
    try:
        return time.time() - float(os.environ[STARTED_AT_ENV])
    except (KeyError, ValueError):
        return time.time() - _IMPORTED_AT


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str, fmt: str) -> None:
    """Route every logger (ours, uvicorn's, the models') to one stderr handler in ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn installs its own handlers; use ours instead
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
