"""Activations applied in the GEMM epilogue, shared by every fused-linear kernel.

The kernels take the activation as a ``tl.constexpr`` string, so each choice compiles to its own
specialised epilogue with no branch at run time.
"""

import torch.nn.functional as F
import triton
import triton.language as tl

ACTIVATIONS = ("none", "relu", "gelu", "silu")

# What each activation computes, in torch: the reference the kernels are tested against, and what
# the torch code paths (empty K, the torch backend) apply.
TORCH_ACTIVATIONS = {
    "none": lambda y: y,
    "relu": F.relu,
    "gelu": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
}

# sqrt(2 / pi), the constant of the tanh approximation of GELU (a constexpr: jit code may only
# read globals that are).
_GELU_TANH_C = tl.constexpr(0.7978845608028654)


@triton.jit
def apply_activation(acc, ACTIVATION: tl.constexpr):
    """act(acc) on an fp32 tile; ``gelu`` is the tanh approximation (torch's approximate="tanh")."""
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): avoids a tanh, which core Triton does not provide.
        u = _GELU_TANH_C * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * u)
    elif ACTIVATION == "silu":
        acc = acc * tl.sigmoid(acc)
    return acc
