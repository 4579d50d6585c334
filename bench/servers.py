"""The servers a load run compares, as data (name -> command line), and their processes.

A command line is a list of strings with placeholders filled in at start: ``{python}`` (this
interpreter), ``{port}``, ``{repo}`` (the benchmark's model repository), ``{device}``. Each server
runs in the repository root on a loopback port; its CPU time is read from /proc for the whole
process tree (uvicorn's and LitServe's worker processes included).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]
    ready_path: str = "/v2/health/ready"
    infer_path: str = "/infer"
    env: dict = field(default_factory=dict)
    needs: str | None = None  # a module that must be importable, else the server is skipped
    protocols: tuple[str, ...] = ("json", "v2-binary")  # the load's request forms it answers (bench/load.py)
    # Frozen (SIGSTOP) between its own runs: for a server whose idle loops poll, so that it takes no
    # CPU from the one being measured (LitServe idles at ~0.14 of a core on the 2-core box).
    pause_when_idle: bool = False
    # A JSON path polled after ready until no served model has a "provisional" bucket (fusedserve's
    # /kernel-stats): a load run measures the tuned server, not its background tuning.
    settled_path: str | None = None


def fusedserve_spec(name: str, extra_flags: list[str]) -> ServerSpec:
    """``python -m fusedserve serve`` plus ``extra_flags`` (``--workers N`` once it exists). HTTP only:
    two servers must not both take gRPC's 8001."""
    return ServerSpec(name, ("{python}", "-m", "fusedserve", "serve", "--port", "{port}", "--device", "{device}",
                             "--model-repository", "{repo}", "--grpc-port", "0", "--log-level", "warning",
                             *extra_flags), settled_path="/kernel-stats")


def naive_spec(workers: int, runtime: str = "torch") -> ServerSpec:
    """bench/peers/naive_fastapi.py under uvicorn with ``workers`` processes: torch eager on the
    repository's models, or (``runtime="onnxruntime"``) onnxruntime on their ``model.onnx`` files."""
    name, factory = {"torch": ("naive_fastapi", "create_app"),
                     "onnxruntime": ("naive_onnxruntime", "create_onnx_app")}[runtime]
    return ServerSpec(f"{name}_{workers}w",
                      ("{python}", "-m", "uvicorn", "--factory", f"naive_fastapi:{factory}", "--app-dir",
                       "bench/peers", "--host", "127.0.0.1", "--port", "{port}", "--workers", str(workers),
                       "--log-level", "warning", "--no-access-log"),
                      env={"NAIVE_REPOSITORY": "{repo}", "NAIVE_DEVICE": "{device}"}, protocols=("json",))


def litserve_spec() -> ServerSpec:
    return ServerSpec("litserve", ("{python}", "bench/peers/litserve_app.py", "--port", "{port}", "--device",
                                   "{device}", "--repository", "{repo}"), ready_path="/health", needs="litserve",
                      pause_when_idle=True, protocols=("json",))


def device_specs(devices: list[str], extra_flags: list[str]) -> list[ServerSpec]:
    """fusedserve once per ``--devices`` value, to compare them in one run (``cuda:0 all``: one GPU
    against every GPU): the first is ``fusedserve``, the others ``fusedserve_<value>`` (``fusedserve_all``)."""
    names = ["fusedserve", *(f"fusedserve_{re.sub('[^A-Za-z0-9]+', '_', value)}" for value in devices[1:])]
    return [fusedserve_spec(name, [*extra_flags, "--devices", value])
            for name, value in zip(names, devices, strict=True)]


def default_servers(naive_workers: int, fusedserve_flags: list[str],
                    devices: list[str] | None = None) -> dict[str, ServerSpec]:
    """The peers of issue 22: fusedserve (once per ``devices`` value, if given), the naive app with 1
    and N workers, LitServe."""
    ours = device_specs(devices, fusedserve_flags) if devices else None
    specs = [*(ours or [fusedserve_spec("fusedserve", fusedserve_flags)]), naive_spec(1)]
    if naive_workers > 1:
        specs.append(naive_spec(naive_workers))
    specs.append(litserve_spec())
    return {s.name: s for s in specs}


def parse_server(text: str) -> ServerSpec:
    """``NAME=COMMAND`` (placeholders allowed) from the command line: an extra or replaced server."""
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise ValueError(f"--server wants NAME=COMMAND, got {text!r}")
    return ServerSpec(name.strip(), tuple(shlex.split(command)))


def settled(kernel_stats: dict) -> bool:
    """Whether no served model of a fusedserve /kernel-stats answer still has a provisional bucket."""
    return all("provisional" not in info.get("choices", {}).values()
               for info in kernel_stats.get("served", {}).values())


def available(spec: ServerSpec) -> bool:
    if spec.needs is None:
        return True
    probe = subprocess.run([sys.executable, "-c", f"import {spec.needs}"], capture_output=True)
    return probe.returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stat_fields(text: str) -> tuple[int, int, int]:
    """(pid, ppid, CPU ticks: user + system + reaped children's) from a /proc/<pid>/stat line."""
    pid = int(text.split(" ", 1)[0])
    rest = text.rsplit(")", 1)[1].split()  # the command name in parentheses may hold spaces
    return pid, int(rest[1]), sum(int(v) for v in rest[11:15])


def read_procs(proc: Path = Path("/proc")) -> dict[int, tuple[int, int]]:
    """pid -> (ppid, CPU ticks) of every live process (zombies, dead and waiting to be reaped, left out)."""
    procs = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
                pid, ppid, ticks = stat_fields(text)
            except (OSError, IndexError, ValueError):  # gone between listing and reading
                continue
            if text.rsplit(")", 1)[1].split()[0] != "Z":
                procs[pid] = (ppid, ticks)
    return procs


def process_role(pid: int, proc: Path = Path("/proc")) -> str:
    """The module a Python process runs (``-m fusedserve.service.workers.frontend`` -> ``frontend``), or its
    program's name; ``?`` once it is gone."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    if b"-m" in argv[:-1]:
        return argv[argv.index(b"-m") + 1].decode(errors="replace").rsplit(".", 1)[-1]
    return Path(argv[0].decode(errors="replace")).name or "?"


def tree(root: int, procs: dict[int, tuple[int, int]]) -> list[int]:
    """``root`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root] if root in procs else []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class ServerProcess:
    """One server started from its spec; ``stop`` ends it and any process it left, by PID."""

    def __init__(self, spec: ServerSpec, device: str, repo: Path, log_dir: Path):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server_{spec.name}.log"
        values = {"python": sys.executable, "port": self.port, "repo": repo, "device": device}
        self.argv = [a.format(**values) for a in spec.argv]
        env = {**os.environ, **{k: v.format(**values) for k, v in spec.env.items()},
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=out, stderr=out)
        self._paused: list[int] = []

    def wait_ready(self, timeout_s: float) -> None:
        """Until the ready path answers 200, then (``settled_path``) until background tuning is done."""
        end = time.monotonic() + timeout_s
        while not self._poll(self.spec.ready_path, end, lambda r: True):
            time.sleep(0.2)
        if self.spec.settled_path:
            while not self._poll(self.spec.settled_path, end, settled):
                time.sleep(0.5)

    def _poll(self, path: str, end: float, done) -> bool:
        """Whether ``path`` answered 200 and ``done(its JSON or None)``; raises once the server exited
        or ``end`` (monotonic) passed."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.spec.name} exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        if time.monotonic() > end:
            raise RuntimeError(f"{self.spec.name} not ready (or still tuning: {path}) in time:\n"
                               f"{self.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200 and done(json.loads(r.read()) if path == self.spec.settled_path else None)
        except OSError:
            return False

    def cpu_seconds(self, procs: dict[int, tuple[int, int]] | None = None) -> float:
        """CPU time so far of the server's whole process tree (a snapshot of /proc may be passed)."""
        procs = read_procs() if procs is None else procs
        return sum(procs[p][1] for p in tree(self.proc.pid, procs)) / os.sysconf("SC_CLK_TCK")

    def pids(self) -> list[int]:
        return tree(self.proc.pid, read_procs())

    def cpu_by_process(self, before: dict, after: dict, seconds: float) -> dict:
        """Cores each process of the tree kept busy between two ``read_procs`` snapshots, summed by
        role (its ``-m`` module or program name), with the busiest single process of each role: a
        serial stage (one engine process) at ~1.0 core is the ceiling."""
        hz, roles = os.sysconf("SC_CLK_TCK"), {}
        for pid in tree(self.proc.pid, after):
            cores = (after[pid][1] - before.get(pid, (0, 0))[1]) / hz / max(seconds, 1e-9)  # new: all its time
            role = "root" if pid == self.proc.pid else process_role(pid)
            entry = roles.setdefault(role, {"processes": 0, "cores": 0.0, "busiest_cores": 0.0})
            entry["processes"] += 1
            entry["cores"] = round(entry["cores"] + cores, 3)
            entry["busiest_cores"] = round(max(entry["busiest_cores"], cores), 3)
        return roles

    def pause(self) -> None:
        """SIGSTOP the whole tree if the spec asks for it (see ``pause_when_idle``)."""
        if self.spec.pause_when_idle and not self._paused:
            self._paused = self.pids()
            for pid in self._paused:
                os.kill(pid, signal.SIGSTOP)

    def resume(self, settle_s: float = 0.5) -> None:
        """SIGCONT what ``pause`` stopped, children first, and give its loops ``settle_s`` to catch up."""
        if self._paused:
            for pid in reversed(self._paused):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self._paused = []
            time.sleep(settle_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (uvicorn stops its workers, fusedserve drains), then SIGKILL for what is left.

        SIGTERM, not SIGINT: a shell's background job starts with SIGINT ignored, and children inherit it."""
        if self.proc.poll() is not None:
            return
        self.resume(settle_s=0.0)  # a stopped process would not act on SIGTERM
        pids = self.pids()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        left = read_procs()
        for pid in pids[1:]:  # children it started and left behind (orphans now, or still in its tree)
            if pid in left and (left[pid][0] == 1 or left[pid][0] in pids):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
