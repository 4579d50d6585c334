"""The vendor's GEMM as a kernel family: a layer through torch's cuBLAS/cuBLASLt path.

``Y[M, N] = act(X[M, K] @ W[N, K]^T + b[N])`` by ``torch._addmm_activation`` (cuBLASLt with bias and
ReLU or GELU in its epilogue, one kernel) or by ``torch.addmm`` (cuBLASLt with the bias in its
epilogue) and then the activation of ``kernels.activations``, written into the launcher's ``out``.
It is offered for every problem on CUDA, after our own families, so tuning keeps the library where it
is faster; on CPU tensors the same torch ops run (``run_kernel`` reaches it there).
"""

import torch

from fusedserve.kernels.activations import ACTIVATIONS
from fusedserve.kernels.family import KernelFamily
from fusedserve.kernels.rules import GLUON_SMALL_M_MAX, SMALL_M_MAX, few_tiles_long_k

NAME = "torch_cublas"

# The two ways worth timing: the activation in cuBLASLt's epilogue, or relu(F.linear)'s way (GEMM
# with the bias epilogue, then an elementwise kernel); cuBLASLt picks its algorithms per epilogue, so
# either may be faster. For an activation without an epilogue both run the second way.
CANDIDATES = ({"op": "addmm_act"}, {"op": "linear"})
# At this many float32 rows and fewer our GEMV kept up with the library, K off 16 or not.
_FP32_GEMV_MAX_M = 8
# Weights (N * K) of a layer small enough that at 65-256 rows the table's family starts it, not the library.
_SMALL_LAYER = 1 << 21
_DESCRIPTIONS = {
    "addmm_act": "cuBLASLt, bias and relu/gelu in its epilogue",
    "linear": "cuBLASLt addmm, then the activation",
}


def _epilogue(activation: str, x: torch.Tensor) -> str | None:
    """The activation ``torch._addmm_activation`` may compute in the GEMM, or None. Its GELU is our
    tanh form only on CUDA (on the CPU it is the erf form), and cuBLASLt's is good to ~5e-6 (seen on
    an H100): far below 16-bit rounding, but not fp32's, so float32 runs our "gelu" after the GEMM."""
    if activation == "relu" or (activation == "gelu" and x.is_cuda and x.dtype != torch.float32):
        return activation
    return None


def launch(x, weight, bias, activation, out, config, *, input_precision=None, upcast_bf16=False, pdl=False,
           prefetch_weight=False):
    """Run ``config["op"]`` on checked arguments (``x [M, K]``, ``weight [N, K]``, ``out [M, N]``
    contiguous) into ``out``. The keywords every family takes do not apply: float32 follows torch's
    own ``allow_tf32`` flag (where ``input_precision`` comes from), the bf16 upcast is for the
    interpreter's ``tl.dot``, and torch launches its kernels without PDL (a PDL kernel after them
    waits for them in full), so there is no early weight read either."""
    op = (config or CANDIDATES[0])["op"]
    if op not in _DESCRIPTIONS:
        raise ValueError(f"config op must be one of {tuple(_DESCRIPTIONS)}, got {op!r}")
    weight_t = weight.t()  # [K, N], a view: cuBLAS reads W [N, K] transposed
    epilogue = _epilogue(activation, x) if op == "addmm_act" and bias is not None else None
    if epilogue is not None:
        return torch._addmm_activation(bias, x, weight_t, use_gelu=epilogue == "gelu", out=out)
    if bias is None:
        torch.mm(x, weight_t, out=out)
    else:
        torch.addmm(bias, x, weight_t, out=out)
    if activation == "relu":
        out.relu_()  # in place: one elementwise kernel, not a new tensor and a copy back
    elif activation != "none":
        out.copy_(ACTIVATIONS[activation](out))
    return out


def provisional_first(p) -> bool:
    """Before tuning the library runs these problems. float32 past 8 rows with K off a multiple of
    4: rows that are not 16-byte aligned, which our pointer-based kernels read 4 bytes at a time
    (where they did so for K off a multiple of 16, they ran at 0.05-0.48x the library's speed at
    every measured shape on an H100; docs/kernels.md, "Rows 8 elements apart"). 16-bit past
    ``SMALL_M_MAX`` rows: the library won most shapes there once tuned, and trails the winner by
    little where it lost, while the nearest measured shape's family was often far off
    (docs/kernels.md, "Provisional choices"); but not small layers (``_SMALL_LAYER`` weights or
    fewer) up to ``GLUON_SMALL_M_MAX`` rows, where the Gluon weight-streaming kernel won most tuned
    shapes and the library ran up to 1.63x slower (past them the table's tiled kernel started
    1.13-2.38x slower on shapes the library won, the library 1.16x at worst). 16-bit
    from 2 rows where few W tiles stream a long K (``rules.few_tiles_long_k``): the library won all 3
    such tuned H100 shapes, up to 1.65x faster than the Gluon kernel the table's nearest shape named."""
    if p.half:
        small_layer = p.N * p.K <= _SMALL_LAYER and p.M <= GLUON_SMALL_M_MAX
        return (p.M > SMALL_M_MAX and not small_layer) or (p.M >= 2 and few_tiles_long_k(p))
    return p.dtype == torch.float32 and p.K % 4 != 0 and p.M > _FP32_GEMV_MAX_M


def describe(config: dict | None) -> str:
    """``op=addmm_act (cuBLASLt, bias and relu/gelu in its epilogue)``, as kernel stats show it."""
    if not config:
        return ""
    return f"op={config['op']} ({_DESCRIPTIONS.get(config['op'], 'unknown op')})"


FAMILY = KernelFamily(NAME, unfit=lambda p: None, offered=lambda p: p.capability is not None,
                      candidates=lambda p: [dict(c) for c in CANDIDATES], launch=launch,
                      interpret_config=dict(CANDIDATES[0]), describe=describe,
                      provisional_first=provisional_first)
