"""``fusedserve precompile``: compile a model repository's kernels ahead of time, for a GPU this
machine need not have, into Triton's cache (``TRITON_CACHE_DIR``).

A server's warm-up then loads every kernel it launches from that cache instead of compiling it (a
fresh node: seconds per kernel). Each model is warmed as the compile workers warm it
(``tune_worker.build_runner``, ``ModelRunner.warm``: every bucket up to ``--max-batch-size``, the
provisional choices, or the tuned ones where the tune cache in ``FUSEDSERVE_TUNE_CACHE`` holds a
whole bucket), on a *virtual GPU* (``virtual_gpu``): tensors live in host memory but report
``cuda:0``, torch's device queries answer with the target's name, capability and SM count, and each
Triton launch compiles for the target (``cuda``, its capability, warp 32) instead of running. The
launchers, choices, argument specializations and options are the server's own code's, so Triton's
cache keys are the ones the server computes. Where a C compiler is present, the launcher stubs Triton
builds at a kernel's first launch (one per signature) are built into the cache too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from fusedserve.kernels import device as kernel_device
from fusedserve.kernels.arguments import interpreting
from fusedserve.kernels.rules import batch_buckets
from fusedserve.models import tune_worker
from fusedserve.models.launchers import Launchers
from fusedserve.models.loading import latest_version, model_directories, read_config
from fusedserve.models.precompile import default_workers, log_to_stderr, run_in_pool, throwaway_tune_cache

log = logging.getLogger(__name__)

# GPU models whose provisional choices are known per name (a shipped table or the rules), with their
# compute capability and SMs: ``--capability`` picks those of one capability.
KNOWN_GPUS = {"NVIDIA H100 80GB HBM3": ((9, 0), 132), "NVIDIA H200": ((9, 0), 132)}


@dataclass(frozen=True)
class Target:
    """The GPU model kernels are compiled for: its name as torch reports it (the provisional table
    and tune cache are kept per name), compute capability and SM count (tile rules read it)."""

    name: str
    capability: tuple[int, int]
    sms: int

    @property
    def triton_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability[0] * 10 + self.capability[1], 32)


def targets(capability: str = "9.0", gpus: list[str] | None = None) -> list[Target]:
    """``--gpu NAME`` or ``NAME:SMS`` entries (known names need no SMS), else every known GPU model of
    ``capability`` ("9.0"). ValueError says what to pass instead."""
    match = re.fullmatch(r"(\d+)\.(\d+)", capability.strip())
    if match is None:
        raise ValueError(f"capability must look like 9.0, got {capability!r}")
    cap = (int(match[1]), int(match[2]))
    if not gpus:
        found = [Target(name, cap, sms) for name, (known, sms) in KNOWN_GPUS.items() if known == cap]
        if not found:
            raise ValueError(f"no known GPU model has capability {capability}: name one with --gpu NAME:SMS "
                             f"(known: {', '.join(KNOWN_GPUS)})")
        return found
    out = []
    for entry in gpus:
        name, _, sms = entry.rpartition(":") if re.search(r":\d+$", entry) else (entry, "", "")
        if sms:
            out.append(Target(name, KNOWN_GPUS.get(name, (cap, 0))[0], int(sms)))
        elif name in KNOWN_GPUS:
            out.append(Target(name, *KNOWN_GPUS[name]))
        else:
            raise ValueError(f"--gpu {entry!r}: unknown GPU model; give its SM count as NAME:SMS "
                             f"(the name as torch.cuda.get_device_name reports it)")
    return out


_CUDA0 = torch.device("cuda", 0)
_CUDA_NAME = re.compile(r"cuda(:\d+)?")
# Tensor attributes read through properties that answer for the virtual device.
_GETTERS = {torch._C.TensorBase.__dict__["device"]: _CUDA0, torch._C.TensorBase.__dict__["is_cuda"]: True,
            torch._C.TensorBase.__dict__["is_cpu"]: False}
_ON_HOST_ALREADY = (torch.Tensor.cuda, torch.Tensor.pin_memory)
# The vendor's GEMMs (kernels/vendor/cublas.py) compile nothing, so they return their output unwritten,
# as a Triton launch does: computed on host tensors they took half a compile process's time, again in
# every process and bucket (torch's threads in each of 8 processes contending on the cores).
# Each maps to the position of its [M, K] operand ([K, N] follows it).
_GEMMS = {torch._addmm_activation: 1, torch.addmm: 1, torch.mm: 0}


def _host(value):
    """``value`` with a CUDA device (a torch.device or its name) replaced by the CPU."""
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and _CUDA_NAME.fullmatch(value):
        return "cpu"
    return value


class _OnVirtualDevice(TorchFunctionMode):
    """Every tensor says it is on ``cuda:0``; tensors asked for on CUDA (or in pinned memory) are made
    in host memory."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        slot = getattr(func, "__self__", None)
        if slot in _GETTERS:
            return _GETTERS[slot]
        if func in _ON_HOST_ALREADY:
            return args[0]
        if func is torch.device:  # torch.device(x.device) names the virtual device, as x.device does
            return func(*args, **kwargs)
        if func in _GEMMS:
            a, b = args[_GEMMS[func]], args[_GEMMS[func] + 1]
            out = kwargs.get("out")
            return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
        kwargs.pop("pin_memory", None)
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        return func(*(_host(a) for a in args), **kwargs)


class _TargetDriver:
    """What Triton's JIT asks its active driver before compiling: the device, stream and target."""

    def __init__(self, target: Target):
        self.target = target.triton_target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _torch_cuda_stand_ins(target: Target) -> dict:
    """torch.cuda's functions the kernels and the runner call on the way to a launch, answering for
    ``target`` as device 0 (no CUDA graph is ever captured: the runner warms eagerly)."""
    props = SimpleNamespace(name=target.name, major=target.capability[0], minor=target.capability[1],
                            multi_processor_count=target.sms)
    return {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
            "get_device_name": lambda device=None: target.name,
            "get_device_capability": lambda device=None: target.capability,
            "get_device_properties": lambda device=None: props, "synchronize": lambda device=None: None,
            "is_current_stream_capturing": lambda: False, "device": lambda device: contextlib.nullcontext()}


def _share_hook(index: int, count: int):
    """Triton's ``jit_cache_hook`` for process ``index`` of ``count`` that trace the same launches:
    True (skip the compile) for every kernel but those whose specialization hashes to ``index``, so
    the processes together compile each kernel once."""
    def skip(compile, **_):
        digest = hashlib.sha256(compile["specialization_data"].encode()).digest()
        return int.from_bytes(digest[:8], "big") % count != index
    return skip


@contextlib.contextmanager
def virtual_gpu(target: Target, on_compile=None, share: tuple[int, int] = (0, 1)):
    """Within the block this process computes as if ``target`` were ``cuda:0`` (see the module
    docstring); every Triton launch compiles (into Triton's cache) and returns without running.
    ``on_compile(kernel)`` is called with each compiled ``CompiledKernel``. ``share`` ``(i, n)``:
    compile only the i-th of n hash-dealt shares of the kernels launched (``_share_hook``)."""
    import triton
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if interpreting():
        raise RuntimeError("unset TRITON_INTERPRET: precompiling builds GPU kernels, not interpreted ones")
    run, touched, hook = JITFunction.run, set(), triton.knobs.runtime.jit_cache_hook

    def compile_only(self, *args, grid, warmup, **kwargs):
        touched.add(self)
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if on_compile is not None and kernel is not None:  # None: another share's kernel
            on_compile(kernel)
        return kernel

    saved = {name: getattr(torch.cuda, name) for name in _torch_cuda_stand_ins(target)}
    active = driver._active  # (private: DriverConfig.reset_active would build the real driver)
    try:
        for name, stand_in in _torch_cuda_stand_ins(target).items():
            setattr(torch.cuda, name, stand_in)
        JITFunction.run = compile_only
        if share[1] > 1:
            triton.knobs.runtime.jit_cache_hook = _share_hook(*share)
        driver.set_active(_TargetDriver(target))
        kernel_device.forget_devices()
        with _OnVirtualDevice():
            yield
    finally:
        JITFunction.run = run
        triton.knobs.runtime.jit_cache_hook = hook
        driver._active = active
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
        for fn in touched:  # their binders hold the virtual target: a real launch builds its own
            fn.device_caches.clear()
        kernel_device.forget_devices()


def local_target(device) -> Target:
    """The GPU model of CUDA ``device``, to compile for it as its own tuner will launch."""
    props = torch.cuda.get_device_properties(device)
    return Target(torch.cuda.get_device_name(device), (props.major, props.minor), props.multi_processor_count)


@contextlib.contextmanager
def every_candidate():
    """Within the block, tuning (mode "tune") launches every candidate of its search
    (``kernels.choosing.SEARCH_ENV``) and times nothing: under ``virtual_gpu`` each launch compiles.
    What it would keep is meaningless, so only a process whose tune cache is a throwaway one may
    run it (``throwaway_tune_cache``)."""
    from fusedserve.kernels import choosing, provisional, tuning

    def timer(run):
        run()
        return lambda repeats: [1.0] * repeats
    saved = choosing.default_timer, tuning.default_timer
    choosing.default_timer = tuning.default_timer = lambda calls_hint=1: timer
    copies = tuning._rotating_bytes.set(0)  # nothing is timed, so no copies past L2 (they cost seconds)
    try:
        with provisional.choosing_mode("tune"):
            yield
    finally:
        choosing.default_timer, tuning.default_timer = saved
        tuning._rotating_bytes.reset(copies)


def compile_task(target: Target, name: str, config: dict, max_batch_size: int, buckets: list[int],
                 launchers: bool = True, candidates: bool = False, share: tuple[int, int] = (0, 1),
                 progress: tune_worker.CompileProgress | None = None) -> tuple[int, int]:
    """Compile model ``name`` (a config.json's dict) at ``buckets`` for ``target`` as a server with
    ``max_batch_size`` warms it, or with ``candidates`` every kernel its tuner would time there; only
    ``share`` of those kernels (see ``virtual_gpu``), each bucket marked in ``progress`` once done.
    ``(launches of its share's kernels, launcher stubs built)``."""
    from fusedserve.models.mlp import MLPConfig

    launches = []
    with tempfile.TemporaryDirectory() as workdir, Launchers(Path(workdir), launchers) as stubs:

        def on_compile(kernel):
            launches.append(kernel)
            stubs(kernel)

        start, cpu = time.perf_counter(), _cpu_seconds()
        with virtual_gpu(target, on_compile, share):
            runner = tune_worker.build_runner(MLPConfig.from_dict(config), name, "cuda:0", "triton", max_batch_size)
            for bucket in buckets:
                if candidates:
                    with every_candidate():
                        runner.tune(bucket)
                elif runner.needs_tuning(bucket):
                    runner.warm(bucket)  # provisional choices, as warm-up runs them
                else:
                    runner.tune(bucket)  # every path on its tuned choices, all in the tune cache: nothing timed
                if progress is not None:
                    progress.mark(bucket, share[0])
        stubs.utilities()
        own, compilers = (now - then for now, then in zip(_cpu_seconds(), cpu, strict=True))
        # CPU seconds beside the wall clock: far below it, the process waited (for a core, a lock).
        log.info("compiled %r M=%s for %s, share %d/%d: %d launches in %.1f s (CPU: %.1f s here, %.1f s in "
                 "compilers it ran)", name, ",".join(map(str, buckets)), target.name, share[0] + 1, share[1],
                 len(launches), time.perf_counter() - start, own, compilers)
    return len(launches), stubs.built


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished children (ptxas, cc)."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def repository_models(repository) -> list[tuple[str, dict]]:
    """``(name, config dict)`` of the served version of every model in ``repository``."""
    return [(d.name, read_config(latest_version(d)[1]).to_dict()) for d in model_directories(repository)]


def precompile(repository, max_batch_size: int, gpus: list[Target], jobs: int | None = None,
               launchers: bool = True) -> dict:
    """Compile every model of ``repository`` for every target in ``gpus``, in up to ``jobs`` processes
    at once; a summary: models, buckets, targets, launches, launcher stubs, seconds."""
    start = time.perf_counter()
    models = repository_models(repository)
    buckets = batch_buckets(max_batch_size)
    totals = _compile_in_pool([(gpu, name, config) for gpu in gpus for name, config in models], buckets,
                              max_batch_size, jobs or default_workers(), launchers)
    return {"models": [name for name, _ in models], "buckets": buckets, "gpus": [g.name for g in gpus],
            "launches": totals[0], "launchers": totals[1], "seconds": round(time.perf_counter() - start, 1)}


def compile_candidates(target: Target, name: str, config: dict, max_batch_size: int, buckets: list[int],
                       jobs: int | None = None, progress: tune_worker.CompileProgress | None = None) -> tuple[int, int]:
    """Compile every kernel model ``name``'s tuner would time at ``buckets`` on ``target``, in up to
    ``jobs`` processes at once (``progress``'s shares where given), none touching a GPU: the tuner then
    only times (compiling was ~94% of tuning on an H100). ``(kernel launches, launcher stubs built)``."""
    jobs = progress.shares if progress is not None else jobs or default_workers()
    return tuple(_compile_in_pool([(target, name, config)], buckets, max_batch_size, jobs, True, candidates=True,
                                  progress=progress))


def compile_candidates_ahead(target: Target, name: str, config: dict, max_batch_size: int, buckets: list[int],
                             directory, jobs: int | None = None):
    """``compile_candidates`` started on a thread, its progress marked in ``directory``, so a tuner times
    each bucket once ``progress.wait(bucket)`` returns, while later buckets compile. ``(progress, future
    of (kernel launches, launcher stubs built, seconds))``."""
    progress = tune_worker.CompileProgress(directory, jobs or default_workers())
    future, start = concurrent.futures.Future(), time.perf_counter()

    def run():
        result = error = None
        try:
            result = (*compile_candidates(target, name, config, max_batch_size, buckets, progress=progress),
                      time.perf_counter() - start)
        except BaseException as exc:  # handed to whoever waits on the future
            error = exc
        progress.finish()  # first: whoever the future wakes finds the folder complete
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    threading.Thread(target=run, name="fusedserve-compile-ahead", daemon=True).start()
    return progress, future


def compile_layer_task(target: Target, shapes: list[tuple[int, int, int, str]], activation: str = "relu") -> int:
    """Compile every candidate ``kernels.tune`` would time (its search) for each layer shape ``(M, N, K, dtype
    name)``, served (static weights) and not; the launches compiled."""
    from fusedserve.kernels import fused_linear

    launches = []
    with virtual_gpu(target, launches.append), every_candidate():
        for M, N, K, dtype in shapes:
            x, w, b = (torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
                       for shape in ([M, K], [N, K], [N]))
            for static_weight in (False, True):
                fused_linear(x, w, b, activation, static_weight=static_weight)
    return len(launches)


def compile_layer_candidates(target: Target, shapes, jobs: int | None = None) -> int:
    """``compile_layer_task`` for ``shapes`` dealt over up to ``jobs`` fresh processes (no GPU needed),
    so timing them later compiles nothing; the launches compiled."""
    shapes = [(M, N, K, str(dtype).removeprefix("torch.")) for M, N, K, dtype in shapes]
    jobs = max(1, min(jobs or default_workers(), len(shapes)))
    return sum(run_in_pool(compile_layer_task, [(target, shapes[i::jobs]) for i in range(jobs)], jobs,
                            throwaway_tune_cache))


def _compile_in_pool(keys, buckets, max_batch_size, jobs, launchers, candidates=False, progress=None) -> list[int]:
    """``compile_task`` for every ``(target, name, config)`` in ``keys`` at ``buckets`` in up to ``jobs``
    fresh processes: each of a key's processes traces every bucket and compiles its share of the
    kernels (dealing buckets instead compiled the kernels buckets share once per process, 3.5x the
    work for a 16-bucket model); ``[launches, launcher stubs]`` summed."""
    shares = max(1, round(jobs / len(keys))) if keys else 1
    tasks = [(*key, max_batch_size, buckets, launchers, candidates, (i, shares), progress)
             for key in keys for i in range(shares)]
    results = run_in_pool(compile_task, tasks, jobs, throwaway_tune_cache if candidates else log_to_stderr)
    return [sum(counts) for counts in zip(*results, strict=True)] if results else [0, 0]


def run(args, settings) -> None:
    """``fusedserve precompile`` with ``settings`` (the repository and max batch size a server takes)."""
    if settings.backend == "torch":
        raise SystemExit("precompile: the torch backend runs no Triton kernels (FUSEDSERVE_BACKEND=torch)")
    try:
        gpus = targets(args.capability, args.gpu)
    except ValueError as exc:
        raise SystemExit(f"precompile: {exc}") from None
    if args.cache_dir:
        os.environ["TRITON_CACHE_DIR"] = str(Path(args.cache_dir).resolve())
    from triton import knobs

    cache = Path(knobs.cache.dir)
    before = cache_entries(cache)
    print(f"precompiling {settings.model_repository} up to {settings.max_batch_size} rows for "
          f"{', '.join(g.name for g in gpus)} into {cache}", flush=True)
    summary = precompile(settings.model_repository, settings.max_batch_size, gpus, args.jobs, args.launchers)
    after = cache_entries(cache)
    print(f"{', '.join(summary['models'])} at M={','.join(map(str, summary['buckets']))}: {summary['launches']} "
          f"kernel launches compiled in {summary['seconds']} s; {cache} holds {len(after)} kernels and launcher "
          f"stubs ({len(after - before)} new)", flush=True)


def cache_entries(cache: Path) -> set[str]:
    """The entries of Triton's cache directory (one per compiled kernel or built module)."""
    return {p.name for p in cache.iterdir() if p.is_dir()} if cache.is_dir() else set()
