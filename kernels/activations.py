"""The activations a layer may apply, in one table: what torch computes (the reference the kernels
are tested against, and what the torch backend runs) and, in ``apply_activation``, what every
kernel's epilogue computes. The Triton and the Gluon kernels all compile ``_activate``, whose ``else``
branch fails the compile, so a name added to the table alone cannot run as the identity.
"gelu" is GELU's tanh approximation (what stored models mean by it); "gelu_erf" is the exact form.
``OUTPUT_ACTIVATIONS`` are row-wise, so no epilogue computes them: only a model's last layer may
have one, and torch applies it to that layer's kernel output (``split_activation``).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.experimental import gluon

ACTIVATIONS = {
    "none": lambda y: y,
    "relu": F.relu,
    "gelu": lambda y: F.gelu(y, approximate="tanh"),
    "gelu_erf": F.gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}

# Row-wise: softmax over each output row, computed in float32 whatever the model dtype.
OUTPUT_ACTIVATIONS = {
    "softmax": lambda y: torch.softmax(y, dim=-1, dtype=torch.float32).to(y.dtype),
}


def split_activation(name: str):
    """``(epilogue, after)`` for activation ``name``: the ``ACTIVATIONS`` name a kernel's epilogue
    applies, and the row-wise function torch applies to the kernel's output (None if none)."""
    if name in OUTPUT_ACTIVATIONS:
        return "none", OUTPUT_ACTIVATIONS[name]
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS | OUTPUT_ACTIVATIONS)}, got {name!r}")
    return name, None


def torch_activation(name: str):
    """What torch computes for activation ``name``, elementwise or row-wise."""
    epilogue, after = split_activation(name)
    return after or ACTIVATIONS[epilogue]


def _activate(acc, ACTIVATION: tl.constexpr):
    """``ACTIVATIONS[ACTIVATION]`` of an fp32 tile, in fp32. Builtins only (``tl.sigmoid`` is a jit
    function of its own), so the same source compiles as Triton and as Gluon, interpreter or not.
    Its constants are literals, not constexpr globals: Triton 3.6 adds a callee's constexpr globals
    to a kernel's cache key only where the callee was hashed first, so a kernel's key (and its
    Triton cache entry) would depend on what the process compiled before it."""
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): core Triton has no tanh.
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)  # sqrt(2 / pi) * (...)
        acc = acc * (1 / (1 + tl.exp(-(2.0 * u))))
    elif ACTIVATION == "gelu_erf":
        # erf by Abramowitz and Stegun's 7.1.26 (|error| < 1.5e-7, below fp32's GELU rounding):
        # libdevice's erff spills registers in the widest wgmma tiles, this does not.
        z = tl.abs(acc) * 0.7071067811865476  # |x| / sqrt(2)
        t = 1 / (1 + 0.3275911 * z)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        erf_abs = 1 - poly * tl.exp(-z * z)
        acc = 0.5 * acc * (1 + tl.where(acc >= 0, erf_abs, -erf_abs))
    elif ACTIVATION == "silu":
        acc = acc * (1 / (1 + tl.exp(-acc)))
    elif ACTIVATION == "sigmoid":
        acc = 1 / (1 + tl.exp(-acc))
    elif ACTIVATION == "tanh":
        acc = 2.0 / (1 + tl.exp(-2.0 * acc)) - 1.0
    else:
        tl.static_assert(ACTIVATION == "none", "apply_activation has no branch for this activation")
    return acc


# The epilogue of the Triton kernels and, compiled from the same source, of the Gluon kernels.
apply_activation = triton.jit(_activate)
apply_activation_gluon = gluon.jit(_activate)
