"""Launch one fused-linear kernel with one config a few times, for Nsight Compute to profile.

The benchmarks say how long a kernel takes; this is for asking the hardware counters why (shared
memory bandwidth, tensor-core issue, stalls). ``bench/gpu_check.sh ncu`` runs it under ``ncu``;
by hand, on a CUDA GPU from the repository root:

    ncu --clock-control none -k regex:gluon_ws_kernel --launch-skip 2 --launch-count 1 \\
        python bench/ncu_kernel.py --kernel gluon_ws --shape 256x11008x4096 \\
        --config '{"BLOCK_M": 128, "BLOCK_N": 192, "BLOCK_K": 64, "CONSUMERS": 2, "PINGPONG": false,
                   "EPI_SPLIT": 1, "GROUP_M": 8, "num_warps": 4, "STAGES": 4}'

Without ``--config`` it takes the first of the kernel's candidates at that shape (``--list``
prints them, numbered; ``--pick N`` takes the N-th). The launches are plain (no programmatic
dependent launch) and each checks nothing: the GPU tests own correctness. ``--kernel cublaslt``
launches the peer instead, ``torch._addmm_activation`` (cuBLASLt's fused RELU_BIAS epilogue), whose
kernel name, grid and counters say how cuBLAS tiles the same shape.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from fusedserve.kernels.gluon import small_m as gluon_small_m, ws as gluon_ws  # noqa: E402  (needs sys.path)
from fusedserve.kernels.precision import dot_precision  # noqa: E402
from fusedserve.kernels.triton import small_m, tma_persistent  # noqa: E402

MODULES = {m.NAME: m for m in (gluon_ws, tma_persistent, gluon_small_m, small_m)}
KERNELS = tuple(MODULES)
PEER = "cublaslt"


def _shape(text):
    try:
        M, N, K = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK, e.g. 256x11008x4096, got {text!r}") from None
    if min(M, N, K) < 1:
        raise argparse.ArgumentTypeError(f"every dimension must be positive, got {text!r}")
    return M, N, K


def choose(module, M, N, K, dtype, config_json=None, pick=0):
    """The config to profile: ``config_json`` if given, else the ``pick``-th candidate."""
    if config_json is not None:
        config = json.loads(config_json)
        if not isinstance(config, dict):
            raise ValueError(f"--config must be a JSON object, got {config_json!r}")
        return config
    configs = module.candidates(M, N, K, dtype)
    if not 0 <= pick < len(configs):
        raise ValueError(f"--pick {pick}: {module.__name__} has {len(configs)} candidates at {M}x{N}x{K}")
    return configs[pick]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=KERNELS + (PEER,), required=True)
    parser.add_argument("--shape", type=_shape, required=True, help="MxNxK")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--config", help="the config as a JSON object (default: a candidate, --pick)")
    parser.add_argument("--pick", type=int, default=0, help="which candidate (see --list)")
    parser.add_argument("--list", action="store_true", help="print the candidates at this shape and stop")
    parser.add_argument("--launches", type=int, default=5, help="how many launches (ncu picks by --launch-skip)")
    args = parser.parse_args(argv)
    M, N, K = args.shape
    dtype = getattr(torch, args.dtype)
    if args.kernel == PEER:
        if args.list or args.config is not None:
            parser.error(f"--kernel {PEER} has no configs: cuBLASLt picks its own")
        module = config = None
    else:
        module = MODULES[args.kernel]
    if args.list:
        for i, config in enumerate(module.candidates(M, N, K, dtype)):
            print(i, json.dumps(config))
        return 0
    if module is not None:
        try:
            config = choose(module, M, N, K, dtype, args.config, args.pick)
        except ValueError as e:
            parser.error(str(e))
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    out = torch.empty(M, N, device="cuda", dtype=dtype)
    for _ in range(args.launches):
        if module is None:
            torch._addmm_activation(b, x, w.t(), use_gelu=False)
        else:
            module.launch(x, w, b, "relu", out, config, input_precision=dot_precision(dtype), upcast_bf16=False)
    torch.cuda.synchronize()
    print(f"{args.launches} launches of {args.kernel} at {M}x{N}x{K} {args.dtype}: {json.dumps(config)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
