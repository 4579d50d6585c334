"""Log set-up for ``fusedserve serve``: plain text, or one JSON object per line (``--log-format json``)
for log shippers. Fields passed with ``extra=`` (the access log's request id, status, duration)
become keys of the JSON object."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
# (uvicorn adds "color_message", an ANSI-coloured copy of the message: noise in JSON.)
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName", "color_message"}
FORMATS = ("text", "json")
ACCESS_LOGGER = "fusedserve.access"
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


class BatchedHandler(logging.Handler):
    """A stream handler for the access log that keeps a request's cost to queueing its record: a
    thread formats and writes the records in batches, every ``interval_s`` or once ``batch`` wait
    (``close`` and ``flush``, which logging calls at exit, write the rest)."""

    def __init__(self, stream, formatter: logging.Formatter, stream_lock=None, interval_s: float = 0.2,
                 batch: int = 1024):
        super().__init__()
        self.setFormatter(formatter)
        self.stream, self.interval_s, self.batch = stream, interval_s, batch
        # The lock of another handler writing to the same stream: its lines and ours never interleave.
        self._stream_lock = stream_lock or threading.Lock()
        self.records: list[logging.LogRecord] = []
        self._writing = threading.Lock()  # one batch at a time, so lines keep their order
        self._wake, self._stop = threading.Event(), threading.Event()
        threading.Thread(target=self._write_batches, name="access-log", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if len(self.records) >= self.batch:
            self._wake.set()

    def flush(self) -> None:
        with self._writing:
            with self.lock:
                records, self.records = self.records, []
            lines = []
            for record in records:
                try:
                    lines.append(self.format(record) + "\n")
                except Exception:  # noqa: BLE001 - logging's way: report it, keep the others
                    self.handleError(record)
            if lines:
                with self._stream_lock:
                    self.stream.write("".join(lines))
                    self.stream.flush()

    def _write_batches(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.flush()
        super().close()


def configure(level: str, fmt: str) -> None:
    """Route every logger (ours, uvicorn's, the models') to one stderr handler in ``fmt``; the
    access log (``fusedserve.access``) goes to stderr in batches (``BatchedHandler``)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # No record needs its thread's or process's name (no format shows them): each costs a lookup.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    for old in access.handlers:
        old.close()
    access.handlers[:] = [BatchedHandler(handler.stream, handler.formatter, handler.lock)]
    access.propagate = False
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn installs its own handlers; use ours instead
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
