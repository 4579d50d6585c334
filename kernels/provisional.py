"""First choices that need no timing: a kernel family and config for a layer before its batch
bucket is tuned, so a model is ready after compiling and capturing, and tuning can come later.

First, a family may claim a class of problems the others are measured to lose
(``KernelFamily.provisional_first``: the vendor's GEMM claims float32 with K off a multiple of 4,
16-bit layers past 64 rows but small ones, and a few W tiles over a long K; ``triton_small_m`` one
16-bit row, ``gluon_small_m`` one short and wide one); it runs its candidate closest to its nearest
measured config there (its first where the table has none), or what the family fits to the problem
from that config (``KernelFamily.provisional_config``). Otherwise the choice comes
from a table shipped in the package per GPU model and Triton version
(``tables/<gpu>-triton-<version>.json``, built by
``tools/provisional_table.py`` from the measured winners in ``bench/results/kernels.jsonl``): the
measured shape nearest to the problem (same dtype, among the families offered for it) names the
family, and of that family's candidates for the problem the one closest to the measured config is
taken. On a GPU or Triton version without a table, or where no measured family is offered, the
rule is the registry's: the first offered family's first candidate.

Which mode a thread is in (``mode()``) decides what ``choosing.choose`` does on a tune-cache miss:
time the candidates (``"tune"``, and the default for a key never chosen provisionally) or take the
provisional choice (``"provisional"``, and the default once a key was chosen provisionally, so a
serving thread never times).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import triton

from fusedserve.kernels.rules import SMALL_M_MAX, Problem, m_bucket, tuning_rows

TABLES = Path(__file__).resolve().parent / "tables"
# Distance between shapes: a factor of two in the batch bucket counts twice one in N or K (the
# families change with M), a different static_weight flag less than any change of shape.
_M_WEIGHT, _STATIC_WEIGHT = 2.0, 0.01
# A near search (``choosing.search``) times what won at this many nearest measured shapes, besides
# the vendor and the provisional choice (docs/kernels.md: how often that holds the full search's winner).
NEAR_ENTRIES = 6
# Up to this many rows a near search also times every candidate of the provisional choice's family:
# our families win there by the most and their best configs vary most (docs/kernels.md, "Tuning search").
NEAR_WHOLE_FAMILY_ROWS = 8

_mode = contextvars.ContextVar("fusedserve_choice_mode", default=None)


@contextlib.contextmanager
def choosing_mode(mode: str):
    """Within the block, this thread's cache misses are ``"provisional"`` (never timed) or
    ``"tune"`` (timed, even for a key chosen provisionally before)."""
    if mode not in ("provisional", "tune"):
        raise ValueError(f"mode must be 'provisional' or 'tune', got {mode!r}")
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def mode() -> str | None:
    """This thread's mode (None: the default, see the module docstring)."""
    return _mode.get()


@dataclass(frozen=True)
class Entry:
    """One measured winner: the family and config the tuner chose at one shape."""

    dtype: str  # "bfloat16", "float16", "float32"
    M: int  # batch bucket (kernels.rules.m_bucket)
    N: int
    K: int
    static_weight: bool
    kernel: str
    config: dict


def table_path(device_name: str, triton_version: str, directory: Path = TABLES) -> Path:
    """Where the table of a GPU model and Triton version lives (named like the tune cache's files)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name)
    return Path(directory) / f"{slug}-triton-{triton_version}.json"


def read_table(path: Path) -> tuple[Entry, ...]:
    """The entries of one table file (see ``tools/provisional_table.py`` for its format)."""
    data = json.loads(Path(path).read_text())
    fields = data["fields"]
    return tuple(Entry(**dict(zip(fields, row, strict=True))) for row in data["entries"])


@functools.cache
def table(device_name: str, triton_version: str | None = None) -> tuple[Entry, ...]:
    """The shipped table for this GPU model (and Triton version, default the installed one); empty
    where none ships."""
    path = table_path(device_name, triton_version or triton.__version__)
    return read_table(path) if path.exists() else ()


def distance(entry: Entry, problem: Problem, static_weight: bool) -> float:
    return (_M_WEIGHT * abs(math.log2(entry.M) - math.log2(m_bucket(problem.M)))
            + abs(math.log2(entry.N) - math.log2(problem.N)) + abs(math.log2(entry.K) - math.log2(problem.K))
            + (_STATIC_WEIGHT if entry.static_weight != static_weight else 0.0))


def closest_config(candidates: list[dict], wanted: dict) -> dict:
    """``wanted`` if it is a candidate, else the candidate sharing most of its values (first on a tie,
    so the first candidate for ``{}``): a measured config is only a hint; the family's own candidates
    for the problem are what run."""
    if wanted in candidates:
        return dict(wanted)
    return dict(max(candidates, key=lambda c: sum(c.get(k) == v for k, v in wanted.items())))


def _weight_bound(rows: int) -> bool:
    return rows <= SMALL_M_MAX


def _ranked(problem: Problem, entries, static_weight: bool) -> list[Entry]:
    """The entries of ``problem``'s dtype measured on the same side of ``SMALL_M_MAX`` rows, nearest
    first: what streams W best for 64 rows says nothing of 128 (an fp32 layer at 94 rows ran a
    64-row shape's weight-streaming winner 21.6x slower than tuned, kernels.jsonl:40)."""
    dtype, bound = str(problem.dtype).removeprefix("torch."), _weight_bound(m_bucket(problem.M))
    return sorted((e for e in entries if e.dtype == dtype and _weight_bound(e.M) == bound),
                  key=lambda e: distance(e, problem, static_weight))


def provisional_choice(problem: Problem, families, entries, static_weight: bool = False) -> tuple[str, dict, str]:
    """``(family name, config, source)`` for ``problem`` among ``families`` (the offered ones, the
    default first), without timing; source is ``"table"`` or ``"rules"``."""
    timed = replace(problem, M=tuning_rows(problem.M))
    ranked = _ranked(problem, entries, static_weight)
    for family in families:
        candidates = family.candidates(timed) if family.provisional_first(timed) else None
        if candidates:
            measured = next((e.config for e in ranked if e.kernel == family.name), {})
            return family.name, start_config(family, timed, candidates, measured), "rules"
    by_name = {f.name: f for f in families}
    for entry in ranked:
        family = by_name.get(entry.kernel)
        candidates = family.candidates(timed) if family is not None else None
        if candidates:
            return entry.kernel, start_config(family, timed, candidates, entry.config), "table"
    for family in families:
        candidates = family.candidates(timed)
        if candidates:
            return family.name, dict(candidates[0]), "rules"
    raise ValueError(f"no family has a config for M={problem.M} N={problem.N} K={problem.K} {problem.dtype}")


def start_config(family, problem: Problem, candidates: list[dict], measured: dict) -> dict:
    """The family's config to start ``problem`` on, from its ``candidates`` and the config it won with
    at the nearest measured shape (``{}``: none there, so its first candidate unless the family says)."""
    if family.provisional_config is not None:
        return dict(family.provisional_config(problem, candidates, measured))
    return closest_config(candidates, measured)


def near_candidates(problem: Problem, families, entries, static_weight: bool = False,
                    count: int = NEAR_ENTRIES) -> list[tuple[str, dict]]:
    """``(family name, config)`` of what won at the ``count`` measured shapes nearest ``problem``
    whose family is among ``families`` (each family's candidate closest to the measured config),
    nearest first, without repeats; empty where the table has no such shape of its dtype."""
    timed = replace(problem, M=tuning_rows(problem.M))
    by_name = {f.name: f for f in families}
    pairs, used = [], 0
    for entry in _ranked(problem, entries, static_weight):
        candidates = by_name[entry.kernel].candidates(timed) if entry.kernel in by_name else None
        if not candidates:
            continue
        pair = (entry.kernel, closest_config(candidates, entry.config))
        if pair not in pairs:
            pairs.append(pair)
        used += 1
        if used == count:
            break
    return pairs
