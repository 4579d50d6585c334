"""A sweep's rows written as JSON lines as they are measured, so a sweep stopped by its time limit
(or a crash) keeps everything it timed."""

import json
from pathlib import Path


class JsonLines:
    """``with JsonLines(path) as out: out.emit(row)``; ``out.rows`` holds every row emitted."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        self._file = None

    def __enter__(self):
        self._file = open(self.path, "w")
        return self

    def __exit__(self, *exc):
        self._file.close()

    def emit(self, row: dict) -> None:
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
