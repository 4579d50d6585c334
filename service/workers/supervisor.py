"""``fusedserve serve --workers N`` (N > 1), or several devices: a small supervisor process. It binds
the HTTP port (one SO_REUSEPORT socket per front end), spawns one engine process per device
(``service.workers.engine_process``: models, batchers, CUDA graphs, stats; ``service.workers.devices``
says which) and, once every engine has imported its code, N front ends (``service.workers.frontend``:
uvicorn on its inherited socket, a ``RemoteEngine`` per engine, every one also serving gRPC on one
port shared with SO_REUSEPORT), and restarts any that dies while the others serve; an engine whose
event loop stops beating (its ``Heartbeat``) is killed first. Children are fresh interpreters
(spawned, never forked: the engine may touch CUDA), in their own session so a terminal's Ctrl-C
reaches only the supervisor, which passes each signal on exactly once.

SIGTERM: every front end drains (``DrainingServer``: answers for ``drain_grace_s``, then finishes what
it accepted); once all have exited, the engines stop (their batchers answer what they queued)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from fusedserve.service.settings import Settings
from fusedserve.service.workers.devices import Slot, engine_settings, engines

log = logging.getLogger("fusedserve")
POLL_S = 0.05
RESTART_BACKOFF_S = 1.0  # a child that dies within this long of its start waits this long to restart
ENGINE_STOP_S = 30.0  # the engine's own shutdown (batchers answering their queues)
ORPHAN_POLL_S = 0.5  # how often a child checks that its supervisor is still its parent
# What an engine writes on its ready pipe: its code is imported (front ends may start), its models loaded.
IMPORTED, LOADED = b"i", b"1"
HEARTBEAT_S = 0.5  # how often the engine's event loop shows it runs (a byte to us, a PONG to each PING)
# An engine silent this many heartbeat timeouts is killed. Readiness turns off after one (cheap, and
# undone when it answers again); a restart costs a model load and warm-up.
KILL_AFTER = 2


@dataclass
class Child:
    name: str
    argv: list[str]
    settings: str  # Settings.handoff(): JSON with the secrets
    pass_fds: tuple[int, ...] = ()
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restart_at: float | None = None
    restarts: int = field(default=0)

    def start(self) -> None:
        # Settings go through a pipe, not argv: a command line shows in `ps`, and keys must reach the child.
        read, write = os.pipe()
        with os.fdopen(write, "w") as pipe:
            pipe.write(self.settings)  # a few kB: fits the pipe's buffer before the child reads
        try:
            self.proc = subprocess.Popen([*self.argv, "--settings-fd", str(read)], pass_fds=(*self.pass_fds, read),
                                         start_new_session=True)
        finally:
            os.close(read)
        self.started, self.restart_at = time.monotonic(), None
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


async def until_orphaned(supervisor: int | None) -> None:
    """Return once ``supervisor`` (a PID; None: this process's parent now) is no longer our parent:
    it was killed, and nobody will restart or stop us. A PID given on the command line also catches
    a supervisor that died before this process began to watch (while it imported or loaded)."""
    parent = os.getppid() if supervisor is None else supervisor
    while os.getppid() == parent:
        await asyncio.sleep(ORPHAN_POLL_S)


def check_free(host: str, port: int, flag: str) -> None:
    """Exit (status 1, one line naming ``flag``) if another program holds the port, before anything
    loads: the front ends' SO_REUSEPORT sockets would share it, and one process would find it taken
    only when uvicorn binds, after its models loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise SystemExit(f"cannot listen on {host}:{port} ({exc}): is the port taken? Choose another "
                         f"with {flag}") from None


def _bind(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one port, one per front end, bound here with SO_REUSEPORT: the
    kernel spreads new connections evenly over them (one shared socket would not: an event loop
    accepts a whole burst at once, so one front end took every connection of a burst). A socket
    stays open here while its front end restarts, so connections wait in its backlog, never reset.
    A first bind without SO_REUSEPORT proves the port free: no other program's sockets join the group."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family) as probe:
            port = probe.getsockname()[1]
        socks = [socket.create_server((host, port), family=family, backlog=2048, reuse_port=True)
                 for _ in range(count)]
    except OSError as exc:
        raise SystemExit(f"cannot listen on {host}:{port} ({exc}): is the port taken? Choose another "
                         "with --port") from None
    for sock in socks:
        sock.set_inheritable(True)
    return socks


class Heartbeat:
    """The pipe an engine's event loop writes a byte into every ``HEARTBEAT_S``: one per device for the
    supervisor's life, inherited by each engine started there. Each engine's first byte arms it, so
    its imports, before its event loop runs, never count as silence."""

    def __init__(self):
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)
        self._pid: int | None = None
        self._last: float | None = None

    def silent_s(self, pid: int, now: float) -> float:
        """Seconds since engine ``pid`` last beat (0 before its first beat or after ``disarm``)."""
        if pid != self._pid:  # a new engine: what the last one wrote says nothing of this one
            self._drain()
            self._pid, self._last = pid, None
        if self._drain():
            self._last = now
        return 0.0 if self._last is None else now - self._last

    def disarm(self) -> None:
        self._last = None

    def _drain(self) -> bool:
        try:
            return bool(os.read(self.read, 1 << 16))  # a pipe holds at most 64 KiB
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.read)
        os.close(self.write)


@dataclass
class EngineSlot:
    """One device's engine process: its child, socket, heartbeat pipe, and whether it loaded once."""

    slot: Slot
    path: str
    heartbeat: Heartbeat
    child: Child | None = None
    ready_pipe: int | None = None  # where it says it imported, then loaded its models (first start only)
    imported: bool = False
    loaded: bool = False

    def poll(self) -> None:
        """Read what the engine said on ``ready_pipe``: ``IMPORTED`` once its code is imported, then
        ``LOADED`` once its models are."""
        if self.loaded:
            return
        try:
            said = os.read(self.ready_pipe, 2)
        except BlockingIOError:
            return
        self.imported = self.imported or bool(said)
        self.loaded = LOADED in said


class Supervisor:
    def __init__(self, settings: Settings, log_level: str, log_format: str, slots: list[Slot] | None = None):
        self.settings = settings
        self.slots = slots or engines(settings)
        self._handoff = settings.handoff()
        self._common = ["--log-level", log_level, "--log-format", log_format, "--supervisor", str(os.getpid())]
        self._stop_signal: int | None = None
        self._front_ends: list[Child] = []
        self._engines: list[EngineSlot] = []

    def _start_engine(self, engine: EngineSlot) -> None:
        """The engine, started; it says on ``ready_pipe`` when its models loaded (first start only)."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        beat = engine.heartbeat.write
        label = ["--label", engine.slot.label] if len(self._engines) > 1 else []
        argv = [sys.executable, "-m", "fusedserve.service.workers.engine_process", "--socket", engine.path,
                *self._common, "--heartbeat-fd", str(beat), *label]
        name = f"engine {engine.slot.label}" if label else "engine"
        handoff = engine_settings(self.settings, engine.slot).handoff()
        engine.child = Child(name, [*argv, "--ready-fd", str(write)], handoff, (write, beat))
        engine.child.start()
        os.close(write)
        engine.child.argv, engine.child.pass_fds = argv, (beat,)  # a restarted engine need not say it loaded
        engine.ready_pipe = read

    def _engine_args(self) -> list[str]:
        """A front end's ``--engine`` arguments: the socket path, or ``LABEL=PATH`` of each of several."""
        if len(self._engines) == 1:
            return ["--engine", self._engines[0].path]
        return [arg for e in self._engines for arg in ("--engine", f"{e.slot.label}={e.path}")]

    def _on_signal(self, sig: int, frame) -> None:
        if self._stop_signal is None:
            self._stop_signal = sig
        else:  # a second signal: front ends stop at once (uvicorn's second-signal behaviour)
            for child in self._front_ends:
                child.signal(sig)

    def run(self) -> int:
        settings = self.settings
        socks = _bind(settings.host, settings.port, settings.workers)
        tmp = tempfile.mkdtemp(prefix="fusedserve-")
        several = len(self.slots) > 1
        self._engines = [EngineSlot(slot, os.path.join(tmp, f"engine-{i}.sock" if several else "engine.sock"),
                                    Heartbeat()) for i, slot in enumerate(self.slots)]
        self._front_ends = [
            Child(f"front end {i}", [sys.executable, "-m", "fusedserve.service.workers.frontend",
                                     "--fd", str(sock.fileno()), *self._engine_args(), *self._common],
                  self._handoff, (sock.fileno(),))
            for i, sock in enumerate(socks)]
        if settings.grpc_port:
            check_free(settings.host, settings.grpc_port, "--grpc-port")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        labels = ", ".join(e.slot.label for e in self._engines)
        log.info("supervisor: %d engine%s (%s) and %d front ends on http://%s:%d", len(self._engines),
                 "s" if several else "", labels, settings.workers, settings.host, socks[0].getsockname()[1])
        try:
            for engine in self._engines:
                self._start_engine(engine)
            code = self._watch()
            for sock in socks:  # this process's copies: else the port keeps accepting once the front ends close theirs
                sock.close()
            self._shut_down()
            return code
        finally:
            for sock in socks:
                sock.close()
            for engine in self._engines:
                engine.heartbeat.close()
                if engine.ready_pipe is not None:
                    os.close(engine.ready_pipe)
            shutil.rmtree(tmp, ignore_errors=True)

    def _watch(self) -> int:
        """Start the front ends once every engine has imported its code (started beside them, their
        imports delayed an engine's start by 5-7 s on a 16-core GPU host; after, they import while
        the engines load and warm up, and connect once they listen; connections wait in the sockets'
        backlog meanwhile), then restart children until a signal comes. Returns the exit code (1: an
        engine exited before its models loaded)."""
        started = False
        while self._stop_signal is None:
            for engine in self._engines:
                engine.poll()
                if not engine.loaded and engine.child.proc.poll() is not None:
                    log.error("%s exited (%s) before its models loaded: see its log above", engine.child.name,
                              engine.child.proc.returncode)
                    self._stop_signal = signal.SIGINT  # nothing was served: no drain
                    return 1
            if not started and all(engine.imported for engine in self._engines):
                started = True
                for child in self._front_ends:
                    child.start()
            for engine in self._engines:
                self._kill_if_wedged(engine)
            for child in (*(e.child for e in self._engines), *self._front_ends):
                self._restart_if_dead(child)
            time.sleep(POLL_S)
        return 0

    def _kill_if_wedged(self, engine: EngineSlot) -> None:
        """SIGKILL an engine whose event loop stopped beating (SIGSTOP, a deadlock): it answers
        nothing and never would; ``_restart_if_dead`` then starts a new one."""
        limit = KILL_AFTER * self.settings.engine_heartbeat_timeout_s
        proc = engine.child.proc
        if not limit or proc.poll() is not None:
            return
        silent = engine.heartbeat.silent_s(proc.pid, time.monotonic())
        if silent > limit:
            log.error("%s (pid %d) sent no heartbeat for %.1f s: its event loop is stopped or wedged; killing "
                      "it (SIGKILL) to restart it", engine.child.name, proc.pid, silent)
            proc.kill()
            engine.heartbeat.disarm()

    def _restart_if_dead(self, child: Child) -> None:
        code = None if child.proc is None else child.proc.poll()  # None: running, or not started yet
        if code is None:
            return
        now = time.monotonic()
        if child.restart_at is None:
            quick = now - child.started < RESTART_BACKOFF_S
            child.restart_at = now + (RESTART_BACKOFF_S if quick else 0.0)
            log.error("%s (pid %d) exited with %s; restarting it", child.name, child.proc.pid, code)
        if now >= child.restart_at:
            child.restarts += 1
            child.start()

    def _shut_down(self) -> None:
        """Front ends first (each drains what it accepted), then the engines they were waiting on."""
        sig = self._stop_signal or signal.SIGTERM
        for child in self._front_ends:
            child.signal(sig)
        limit = self.settings.drain_grace_s + self.settings.request_timeout_ms / 1000 + 5
        for child in self._front_ends:
            _wait(child, limit)
        for engine in self._engines:
            engine.child.signal(signal.SIGTERM)
        for engine in self._engines:
            _wait(engine.child, ENGINE_STOP_S)


def _wait(child: Child, timeout_s: float) -> None:
    if child.proc is None:  # never started: the engine stopped before loading
        return
    try:
        child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.error("%s did not stop within %.0f s: killing it", child.name, timeout_s)
        child.proc.kill()
        child.proc.wait()


def run(settings: Settings, log_level: str, log_format: str, slots: list[Slot] | None = None) -> None:
    sys.exit(Supervisor(settings, log_level, log_format, slots).run())
