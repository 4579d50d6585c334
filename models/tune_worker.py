"""``python -m fusedserve.models.tune_worker``: tune (or compile) a model's batch buckets in a process
of its own.

The background tuner (``models.background``) starts one per model on CUDA, so that compiling and
timing candidates (seconds of Python and compiler work that holds the GIL for long stretches) never
runs in the serving process. The worker builds a model of the same config (weights do not change
kernel timings: random ones), times every candidate path of each bucket it is given
(``ModelRunner.tune``), which fills the shared tune cache and Triton's kernel cache, and prints
``TUNED <bucket>`` after each; the serving process then reloads the tune cache and warms the bucket
again from the caches (``ModelRunner.retune``: no timing of kernels, no compiling).

``--compiled DIR:SHARES``: processes are compiling the candidates ahead (``models.aot.compile_candidates_ahead``);
each bucket waits for its kernels there before it is timed (``CompileProgress``: each compile process
touches ``<bucket>.<share>`` once its share of a bucket's kernels is compiled, and whoever started them
touches ``done`` once they have all ended, however they ended, so a worker never waits on processes
that are gone).

``--warm``: compile only, for a cold start (``models.precompile``): warm each bucket as the server
will (``ModelRunner.warm``: its provisional choices, nothing timed, nothing captured), so Triton's
cache holds the kernels the server then loads; prints ``WARM <bucket>`` after each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from fusedserve.kernels.tuning import yielding
from fusedserve.models.mlp import MLP, MLPConfig
from fusedserve.models.runner import ModelRunner

TUNED, WARM = "TUNED", "WARM"
# While the server is busy, a tuning worker waits between two candidates up to this long.
BUSY_WAIT_S = 0.25
# Where compile processes mark their progress, the one that says they have all ended.
DONE = "done"
# A worker waits at most this long for one bucket, then compiles what is missing itself.
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
        """Block until ``compiled(bucket)``, at most ``timeout_s`` (then the worker compiles what is missing
        itself); the seconds it waited."""
        start = time.monotonic()
        while not self.compiled(bucket) and time.monotonic() - start < timeout_s:
            time.sleep(poll_s)
        return time.monotonic() - start


def argv(runner, buckets, warm: bool = False, compiled: CompileProgress | None = None) -> list[str]:
    """The command line of a worker that tunes (``warm``: compiles) ``buckets`` of ``runner``'s model
    as it serves it, each once ``compiled`` says its kernels are compiled where given."""
    return [sys.executable, "-m", "fusedserve.models.tune_worker",
            "--config", json.dumps(runner.model.config.to_dict()),
            "--name", runner.name, "--device", str(runner.device), "--backend", runner.backend,
            "--max-batch-size", str(runner.max_batch_size), "--buckets", ",".join(str(b) for b in buckets),
            *(["--warm"] if warm else []), *(["--compiled", str(compiled)] if compiled is not None else [])]


def build_runner(config: MLPConfig, name: str, device, backend: str, max_batch_size: int,
                 provisional: bool = True) -> ModelRunner:
    """A runner of a model of ``config`` as the server builds one, without CUDA graphs; seeded random
    weights (kernel choices, compiles and timings do not depend on them)."""
    torch.manual_seed(0)
    model = MLP(config, backend=backend, device=device, name=name).eval().requires_grad_(False)
    return ModelRunner(model, max_batch_size=max_batch_size, cuda_graphs=False, provisional=provisional)


class BusyGate:
    """Called between two candidates (``kernels.tuning.yielding``): while the serving process says
    it is busy (the last byte it wrote to ``fd``: b"1" busy, b"0" idle), wait, at most ``max_wait_s``
    a candidate. The GPU time-slices between processes, so a worker timing kernels takes time from
    every batch; this way it times while serving leaves the GPU idle, and still always progresses."""

    def __init__(self, fd: int, max_wait_s: float = BUSY_WAIT_S, poll_s: float = 0.005):
        os.set_blocking(fd, False)
        self.fd, self.max_wait_s, self.poll_s, self.busy = fd, max_wait_s, poll_s, False

    def _read(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        self.busy = data[-1:] == b"1"  # b"": the server is gone, nothing to yield to

    def __call__(self) -> None:
        deadline = time.monotonic() + self.max_wait_s
        self._read()
        while self.busy and time.monotonic() < deadline:
            time.sleep(self.poll_s)
            self._read()


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the model's config.json, as JSON")
    parser.add_argument("--name", default="mlp")
    parser.add_argument("--device", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--max-batch-size", type=int, required=True)
    parser.add_argument("--buckets", required=True, help="comma-separated batch buckets to tune, in order")
    parser.add_argument("--warm", action="store_true", help="compile each bucket's provisional choices only")
    parser.add_argument("--busy-fd", type=int, help="a pipe the server writes b'1' (busy) and b'0' (idle) to")
    parser.add_argument("--compiled", type=CompileProgress.parse,
                        help="DIR:SHARES where processes compiling the candidates ahead mark each bucket")
    parsed = parser.parse_args(args)
    if not parsed.warm and hasattr(os, "nice"):
        os.nice(10)  # tuning is background work: the serving process's threads come first on the CPU
    runner = build_runner(MLPConfig.from_dict(json.loads(parsed.config)), parsed.name, parsed.device,
                          parsed.backend, parsed.max_batch_size, provisional=parsed.warm)
    runner.input_buffer.uniform_(0, 4)  # rows like a client's, not zeros (power draw, clocks)
    gate = BusyGate(parsed.busy_fd) if parsed.busy_fd is not None else None
    with yielding(gate) if gate else contextlib.nullcontext():
        for bucket in (int(b) for b in parsed.buckets.split(",")):
            if parsed.warm:
                runner.warm(bucket)
            else:
                if parsed.compiled is not None:
                    parsed.compiled.wait(bucket)
                runner.tune(bucket)
            print(f"{WARM if parsed.warm else TUNED} {bucket}", flush=True)


if __name__ == "__main__":
    main()
