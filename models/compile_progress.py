"""How far the processes that compile a model's tuning candidates ahead (``models.aot``) have got, kept
in a folder so that a tuner in another process times each bucket as soon as its kernels are compiled
rather than after every bucket's.

Each compile process traces the buckets in order and touches ``<bucket>.<share>`` once its share of a
bucket's kernels is compiled; whoever started them touches ``done`` once they have all ended, however
they ended, so a tuner never waits on processes that are gone.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

DONE = "done"
# A tuner waits at most this long for one bucket, then compiles what is missing itself.
WAIT_S = 300.0


class CompileProgress:
    """The folder ``directory`` where ``shares`` compile processes mark the buckets they are done with."""

    def __init__(self, directory, shares: int):
        if shares < 1:
            raise ValueError(f"shares must be >= 1, got {shares}")
        self.directory, self.shares = Path(directory), shares

    def __str__(self) -> str:  # what ``parse`` reads: a worker's command-line argument
        return f"{self.directory}:{self.shares}"

    @classmethod
    def parse(cls, text: str) -> CompileProgress:
        directory, _, shares = text.rpartition(":")
        if not directory or not shares.isdigit():
            raise ValueError(f"compile progress must be DIRECTORY:SHARES, got {text!r}")
        return cls(directory, int(shares))

    def mark(self, bucket: int, share: int) -> None:
        # The folder is gone once the tuner stopped early: the mark has no reader left.
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{bucket}.{share}").touch()

    def finish(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / DONE).touch()

    def compiled(self, bucket: int) -> bool:
        """Whether every share has compiled ``bucket``'s kernels, or the compiling has ended."""
        return (self.directory / DONE).exists() or all(
            (self.directory / f"{bucket}.{share}").exists() for share in range(self.shares))

    def wait(self, bucket: int, timeout_s: float = WAIT_S, poll_s: float = 0.02) -> float:
        """Block until ``compiled(bucket)``, at most ``timeout_s``; the seconds it waited."""
        start = time.monotonic()
        while not self.compiled(bucket) and time.monotonic() - start < timeout_s:
            time.sleep(poll_s)
        return time.monotonic() - start
