"""What a kernel family is to the rest of fusedserve: one record of functions per family.

A family is one kernel (or a few variants of it) with its launcher, for example the portable
tiled GEMM or the Hopper weight-streaming kernel, or a vendor library run through torch. Adding one:
a module under ``triton/``, ``gluon/`` or ``vendor/`` that defines ``FAMILY = KernelFamily(...)``,
and its line in ``registry.FAMILY_MODULES``.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedserve.kernels.rules import Problem


def config_str(config: dict | None) -> str:
    """A config as the short string shown in kernel stats, e.g. ``BLOCK_M=64,...,num_warps=4``."""
    return ",".join(f"{k}={v}" for k, v in (config or {}).items())


@dataclass(frozen=True)
class KernelFamily:
    """One family of fused-linear kernels: ``Y = act(X @ W^T + b)``."""

    name: str  # as tune keys and kernel stats show it, e.g. "triton_tiled"
    # Why the family cannot compute a problem (hardware, dtype, alignment, rows), or None if it can.
    unfit: Callable[[Problem], str | None]
    # Whether the tuner times the family for a problem it can compute (its range of M, say).
    offered: Callable[[Problem], bool]
    # The configs worth timing for a problem; the first is the family's untuned default.
    candidates: Callable[[Problem], list[dict]]
    # launch(x2d, weight, bias, activation, out, config, *, input_precision, upcast_bf16, pdl,
    # prefetch_weight) writes act(x2d @ weight^T + bias) into ``out`` [M, N] and returns it, on
    # checked arguments with unit column strides; the keywords are ``choosing.launch_options``.
    launch: Callable[..., torch.Tensor]
    # The config run under TRITON_INTERPRET=1 (timing means nothing there); None: never runs there.
    interpret_config: dict | None = None
    describe: Callable[[dict | None], str] = config_str
    # Problems the family runs before tuning ahead of the provisional table and of the families
    # before it (``kernels.provisional``): a class of problems the others are measured to lose.
    provisional_first: Callable[[Problem], bool] = lambda p: False
    # provisional_config(problem, candidates, measured): the config to start on before tuning, given
    # the family's candidates and the config it won with at the nearest measured shape ({}: none);
    # None: the candidate sharing most values with the measured one (``provisional.closest_config``).
    provisional_config: Callable[[Problem, list[dict], dict], dict] | None = None
    # Problems where a near search (``choosing.search_list``) times every candidate of the family
    # (where offered): a narrow class with few candidates, which the nearest measured shapes seldom
    # speak for.
    near_whole: Callable[[Problem], bool] = lambda p: False
