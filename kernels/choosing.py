"""Which kernel family and config runs one layer, and running it.

The families a problem is offered to (``registry.offered``) compete once per batch bucket on each
GPU model: a tuning call (``tune``, the model runner's tuner: mode "tune") times candidate configs at
the bucket's largest batch, on rotating copies of its arguments (``tuning.time_configs``), and the
tune cache keeps the winner. Which candidates: by default a near search (``SEARCH_ENV``), the
provisional choice, the vendor's GEMM and what won at the GPU's nearest measured shapes; with
"full", every family's every config. A first call outside any tuning (``kernels.provisional.mode()``
None: a user's direct call) times a short list instead, the provisional choice and the vendor's
GEMM, once and at the call's own rows, so it answers in well under a second, and keeps the
winner as a "quick" entry that a tuning call replaces. Under the interpreter the first offered
family runs its fixed config. Where nothing may be timed (a CUDA-graph capture, which timing would
break, or a thread in ``provisional`` mode: the model runner's start-up) an untuned bucket runs its
provisional choice (``kernels.provisional``: a shipped table or the rules), remembered per key so
that later calls outside a tuning thread keep it until the bucket is tuned.
"""

import itertools
import os
from dataclasses import dataclass, replace

import torch

from fusedserve.kernels import provisional, registry
from fusedserve.kernels.arguments import interpreting
from fusedserve.kernels.device import cuda_name, pdl_supported
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.precision import dot_precision
from fusedserve.kernels.rules import Problem, bucket_rows, m_bucket, tuning_rows
from fusedserve.kernels.timers import default_timer
from fusedserve.kernels.tune_cache import device_cache
from fusedserve.kernels.tuning import rotating_sets, time_configs
from fusedserve.kernels.vendor.cublas import NAME as VENDOR


@dataclass(frozen=True)
class Choice:
    """The kernel family and config that run a layer."""

    kernel: str  # the family's name
    config: dict | None  # None: not known before tuning
    tuned: bool  # the tuner's pick here (False: the default before tuning, or the interpreter's)
    source: str = "tuned"  # "tuned" (full search), "near", "quick", or before tuning "table", "rules", "default"

    def describe(self) -> str:
        """The config as kernel stats show it ("" when not known yet)."""
        return registry.family(self.kernel).describe(self.config) if self.config is not None else ""


def launch_options(x2d: torch.Tensor, static_weight: bool) -> dict:
    """The keywords every family's launch takes, the same for all (a family ignores what it has no
    use for): fp32 dots' ``input_precision``; ``upcast_bf16``, bf16 tiles to fp32 before tl.dot
    (the interpreter's bf16 dot is wrong); ``pdl``, a programmatic dependent launch (wait for the
    previous kernel before reading X); ``prefetch_weight``, with pdl read W before that wait."""
    pdl = pdl_supported(x2d.device)
    return dict(input_precision=dot_precision(x2d.dtype), upcast_bf16=interpreting() and x2d.dtype == torch.bfloat16,
                pdl=pdl, prefetch_weight=pdl and static_weight)


def launch(choice: Choice, x2d, weight, bias, activation, static_weight=False) -> torch.Tensor:
    """Run ``choice`` on checked arguments (``x2d [M, K]`` and ``weight`` with unit column stride)
    into a new ``[M, N]`` output."""
    out = torch.empty((x2d.shape[0], weight.shape[0]), device=x2d.device, dtype=x2d.dtype)
    return registry.family(choice.kernel).launch(x2d, weight, bias, activation, out, choice.config,
                                                 **launch_options(x2d, static_weight))


def _tune_key(families, problem: Problem, static_weight: bool) -> str:
    # The offered set is part of the key (without Gluon a bucket is tuned afresh), and so is the
    # weight prefetch, which changes the kernels' timing and shared memory.
    return (f"{'+'.join(f.name for f in families)}|M{m_bucket(problem.M)}|N{problem.N}|K{problem.K}"
            f"|{str(problem.dtype).removeprefix('torch.')}|{dot_precision(problem.dtype)}"
            + ("|static_weight" if static_weight else ""))


# How widely a tuning call (mode "tune") searches, in this process and those it starts: "near" (the
# default) times the provisional choice, the vendor's GEMM and what won at the shipped table's
# nearest measured shapes (``provisional.near_candidates``); "full" every candidate of every family,
# as the tables are built. Where the GPU has no table entry of the dtype, near is full.
SEARCH_ENV = "FUSEDSERVE_TUNING_SEARCH"
SEARCHES = ("near", "full")
# Tune-cache entries mark a narrower search than full: the short list (see the module docstring),
# or a near search. A tuning call redoes an entry narrower than its own search.
QUICK, NEAR = "quick", "near"
_BREADTH = {QUICK: 0, NEAR: 1, "tuned": 2}


def search() -> str:
    """This process's tuning search, ``$FUSEDSERVE_TUNING_SEARCH`` (see ``SEARCHES``)."""
    value = os.environ.get(SEARCH_ENV) or SEARCHES[0]
    if value not in SEARCHES:
        raise ValueError(f"{SEARCH_ENV} must be one of {', '.join(SEARCHES)}, got {value!r}")
    return value


def _settled(choice: Choice) -> bool:
    """Whether ``choice`` came from a search at least as wide as this process's tuning asks for."""
    return _BREADTH.get(choice.source, -1) >= _BREADTH["tuned" if search() == "full" else NEAR]


def _entry_choice(entry: dict | None) -> Choice | None:
    if entry is None:
        return None
    source = QUICK if entry.get(QUICK) else NEAR if entry.get(NEAR) else "tuned"
    return Choice(entry["kernel"], entry["config"], tuned=True, source=source)


def cached(problem: Problem, device, static_weight=False) -> Choice | None:
    """The tuned choice for this problem's bucket on ``device``'s GPU model, from a search as wide
    as ``search()`` asks for, or None."""
    choice = current(problem, device, static_weight)
    return choice if _settled(choice) else None


def current(problem: Problem, device, static_weight=False) -> Choice:
    """What a launch of this problem runs now without timing anything: the tuned choice (a short
    list's included), else the provisional one if one was made, else ``default``."""
    if interpreting():
        return default(problem)
    key, name = _tune_key(registry.offered(problem), problem, static_weight), cuda_name(device)
    return _entry_choice(device_cache(name).get(key)) or _provisional.get((name, key)) or default(problem)


def default(problem: Problem) -> Choice:
    """The choice before tuning: the first offered family; its config is known only where nothing
    is tuned (the interpreter's fixed config)."""
    first = registry.offered(problem)[0]
    return Choice(first.name, first.interpret_config if interpreting() else None, tuned=False, source="default")


# (device name, tune key) -> the provisional Choice made there: every launch of an untuned bucket
# runs the same config (a capture must not meet a config the eager warm-up did not compile).
_provisional: dict[tuple[str, str], Choice] = {}


def provisional_choice(problem: Problem, device, static_weight=False, families=None) -> Choice:
    """The choice for this problem before its bucket is tuned, without timing (``kernels.provisional``),
    the same for every call until then."""
    families = families or registry.offered(problem)
    name = cuda_name(device)
    memo = (name, _tune_key(families, problem, static_weight))
    choice = _provisional.get(memo)
    if choice is None:
        kernel, config, source = provisional.provisional_choice(problem, families, provisional.table(name),
                                                                static_weight)
        choice = _provisional.setdefault(memo, Choice(kernel, config, tuned=False, source=source))
    return choice


def choose(problem: Problem, x2d, weight, bias, activation, static_weight=False,
           families: tuple[KernelFamily, ...] | None = None) -> Choice:
    """The choice for this layer: the interpreter's fixed one, the cached tuned one, the provisional
    one where nothing may be timed (see the module docstring), or (first call in a bucket) the
    winner of timing them all now. ``families``: the competitors (default: every family offered
    for the problem)."""
    families = families or registry.offered(problem)
    if interpreting():  # (check_args lets CPU tensors through only then)
        return Choice(families[0].name, families[0].interpret_config, tuned=False, source="interpreter")
    key = _tune_key(families, problem, static_weight)
    cache = device_cache(cuda_name(x2d.device))
    found, mode = _entry_choice(cache.get(key)), provisional.mode()
    capturing = torch.cuda.is_current_stream_capturing()
    if found is not None and (mode != "tune" or capturing or _settled(found)):
        return found
    if mode == "provisional" or (mode is None and (cuda_name(x2d.device), key) in _provisional) or capturing:
        return provisional_choice(problem, x2d.device, static_weight, families)
    if mode == "tune":
        table = provisional.table(cuda_name(x2d.device)) if search() == NEAR else ()
        pairs, narrow = search_list(problem, families, table, static_weight)
    else:
        pairs = _short_list(families, problem, x2d.device, static_weight)
        narrow = QUICK if len(pairs) < len(every_candidate(families, problem)) else None
    kernel, config = _tune(pairs, x2d, weight, bias, activation, static_weight, at_call_rows=narrow == QUICK)
    cache.put(key, {"kernel": kernel, "config": config, **({narrow: True} if narrow else {})})
    return Choice(kernel, config, tuned=True, source=narrow or "tuned")


def every_candidate(families, problem) -> list[tuple[str, dict]]:
    """``(family name, config)`` of every candidate of ``families`` for ``problem`` (a full search)."""
    timed = replace(problem, M=tuning_rows(problem.M))
    return [(f.name, config) for f in families for config in f.candidates(timed)]


def _short_list(families, problem, device, static_weight) -> list[tuple[str, dict]]:
    """The provisional choice and the vendor's candidates where it is offered: at most one kernel to
    compile, so a first call is quick (the vendor's GEMM needs no compiling)."""
    provisional_pick = provisional_choice(problem, device, static_weight, families)
    return _with_vendor((provisional_pick.kernel, provisional_pick.config), families, problem)


def _with_vendor(first: tuple[str, dict], families, problem) -> list[tuple[str, dict]]:
    """``first``, then the vendor's candidates (where it is offered) but ``first``."""
    vendor = every_candidate([f for f in families if f.name == VENDOR], problem)
    return [first] + [pair for pair in vendor if pair != first]


def search_list(problem: Problem, families, entries, static_weight=False) -> tuple[list[tuple[str, dict]], str | None]:
    """What a tuning call times, and how its tune-cache entry is marked: with the table ``entries``
    a near search (see ``SEARCH_ENV``; marked ``NEAR``), the provisional choice, the vendor's GEMM,
    then what won at the nearest measured shapes (at a few rows, every config of the provisional
    choice's family too; every config of a family whose ``near_whole`` says so); every candidate (no
    mark) where that is no shorter or the table has no usable entry of the problem's dtype (pass no
    entries for a full search)."""
    every = every_candidate(families, problem)
    near = provisional.near_candidates(problem, families, entries, static_weight)
    if not near:
        return every, None
    kernel, config, _ = provisional.provisional_choice(problem, families, entries, static_weight)
    pairs = _with_vendor((kernel, config), families, problem)
    if tuning_rows(problem.M) <= provisional.NEAR_WHOLE_FAMILY_ROWS:
        near = near + every_candidate([f for f in families if f.name == kernel], problem)
    near = near + every_candidate([f for f in families if f.near_whole(problem)], problem)
    pairs += [pair for pair in near if pair not in pairs]
    return (pairs, NEAR) if len(pairs) < len(every) else (every, None)


def _tune(pairs, x2d, weight, bias, activation, static_weight, at_call_rows=False):
    """``(family name, config)``: the fastest of ``pairs`` at the bucket's largest batch. A direct call
    runs its own rows, not the bucket's: where they differ, the winner, our fastest and every vendor
    op are timed again at those rows and the fastest kept (``at_call_rows``: a short list, timed at
    those rows alone; a tuning call replaces its entry). cuBLAS's speed moves with M: at M=293
    N=6248 K=5824 bf16 its bias-only GEMM won at the bucket's 320 rows and ran 1.12x slower than its
    fused epilogue at 293 (kernels.jsonl:41); at M=611 N=1536 K=7064 bf16 it won at 640 rows and
    ran 1.16x slower than our split-K at 611 (kernels.jsonl:45). A runner's padded batches are timed once."""
    if at_call_rows:
        return _time(pairs, x2d, weight, bias, activation, static_weight)[1]
    x_timed = bucket_rows(x2d)
    timings, best = _time(pairs, x_timed, weight, bias, activation, static_weight)
    if x_timed is x2d:
        return best
    own = [(ms, pair) for ms, pair in timings if pair[0] != VENDOR]
    ours = [min(own, key=lambda t: t[0])[1]] if own else []
    again = [best] + [pair for pair in ours + [p for _, p in timings if p[0] == VENDOR] if pair != best]
    if len(again) == 1:
        return best
    return _time(again, x2d, weight, bias, activation, static_weight)[1]


def _time(pairs, x2d, weight, bias, activation, static_weight):
    """``time_configs`` of ``pairs`` on rotating copies of the arguments (cold L2, as in serving)."""
    sets = rotating_sets(x2d, weight, bias)
    turn = itertools.count()

    def run(pair):  # each call takes the next copy of the arguments
        xs, ws, bs = sets[next(turn) % len(sets)]
        return launch(Choice(*pair, tuned=False), xs, ws, bs, activation, static_weight)

    return time_configs(pairs, run, timer=default_timer(len(sets)))
