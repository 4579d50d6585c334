"""What the benchmark tests that start servers and load processes share."""

import os
from pathlib import Path

import pytest

from bench.servers import read_procs, tree

# multiprocessing's helpers live as long as the test process: its resource tracker, and the fork
# server that compile processes fork from, where an earlier test started it.
_HELPERS = (b"resource_tracker", b"multiprocessing.forkserver")


def _helper(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return True
    return any(h in cmdline for h in _HELPERS)


@pytest.fixture
def lingering():
    """A function listing the processes this test process still has below it, its helpers aside."""
    return lambda: [p for p in tree(os.getpid(), read_procs()) if p != os.getpid() and not _helper(p)]
