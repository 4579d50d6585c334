"""Compile every Triton kernel config we may launch for sm_90 (Hopper) without a GPU.

The interpreter runs the kernels' Python, not the compiler, so it misses what only the compiler
rejects (a non-constexpr global, a layout it cannot lower). This compiles each tuning candidate the
way a launch on an H200 would, from mock tensors (through ``tools.sm90``). Run
without ``TRITON_INTERPRET``:

    python -m tools.sm90_triton   # from the repository root: one line per compile; exit status 1 if any failed
"""

import math
import sys
import time

import torch
import triton
from triton.runtime.jit import MockTensor
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedserve.kernels.activations import ACTIVATIONS
from fusedserve.kernels.precision import FP32_PRECISIONS
from fusedserve.kernels.triton import normalize, small_m, split_k, stream_k, tiled, tma_persistent
from tools.sm90 import compile_sm90


def compile_launch(module, M, N, K, dtype, config, activation="relu", pdl=True, precision="ieee"):
    """Compile what ``module.launch`` would run for this shape (mock tensors, bias present), as a
    programmatic dependent launch (with the weight prefetch, where the kernel has one) or not.
    ``precision``: fp32 dots' ``input_precision`` (16-bit dots ignore it)."""
    if module is normalize:  # the input normalization: x [M, K] fp32 -> [M, K] dtype (N is not used)
        x = MockTensor(torch.float32, [M, K])
        shift, scale = MockTensor(torch.float32, [K]), MockTensor(torch.float32, [K])
        return [compile_sm90(normalize._normalize_kernel, (x, shift, scale, MockTensor(dtype, [M, K]), M, K, K, K),
                             dict(USE_PDL=pdl, BLOCK=normalize.BLOCK, **config))]
    x, w, y, b = (MockTensor(dtype, s) for s in ([M, K], [N, K], [M, N], [N]))
    common = dict(HAS_BIAS=True, ACTIVATION=activation, UPCAST_BF16=False)
    precision = dict(INPUT_PRECISION=precision if dtype == torch.float32 else "tf32")
    pdl_flags = dict(USE_PDL=pdl)
    if module is tiled:
        return [compile_sm90(tiled._tiled_linear_kernel, (x, w, b, y, M, N, K, K, K, N),
                             {**common, **precision, **pdl_flags, "K_ALIGN": math.gcd(16, K), **config})]
    if module is small_m:
        part = MockTensor(torch.float32, [config["SPLIT_K"], M, N])
        locks = MockTensor(torch.int32, [small_m._LOCK_SLOTS])
        args = (x, w, b, y, part, locks, M, N, K, K, K, N)
        flags = dict(HAS_BIAS=True, ACTIVATION=activation, USE_PDL=pdl, PREFETCH_W=pdl, K_ALIGN=math.gcd(16, K))
        if config.get("GEMV"):
            meta = {k: v for k, v in config.items() if k not in ("GEMV", "PAIRS")}
            return [compile_sm90(small_m._gemv_kernel, args,
                                 dict(flags, BLOCK_M=triton.next_power_of_2(M), STAGES=meta["num_stages"],
                                      PAIRS=bool(config.get("PAIRS")) and dtype == torch.bfloat16, **meta))]
        return [compile_sm90(small_m._small_m_kernel, args,
                             dict(flags, UPCAST_BF16=False, **precision, BLOCK_M=small_m.block_m(M), **config))]
    if module is split_k:
        meta = dict(config)
        split = meta.pop("SPLIT_K")
        part = MockTensor(torch.float32, [split, M, N])
        return [compile_sm90(split_k._split_k_partial_kernel, (x, w, part, M, N, K, K, K, K),
                             {**precision, "UPCAST_BF16": False, **pdl_flags, "K_ALIGN": math.gcd(16, K), **meta}),
                compile_sm90(split_k._split_k_sum_kernel, (part, b, y, M, N, N),
                             dict(SPLIT_K=split, HAS_BIAS=True, ACTIVATION=activation, BLOCK=split_k._SUM_BLOCK,
                                  num_warps=4, **pdl_flags))]
    if module is stream_k:
        meta = {k: v for k, v in config.items() if k != "SK_WAVES"}
        bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
        descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                 TensorDescriptor.from_tensor(y, [bm, bn]))
        part, counts = MockTensor(torch.float32, [132, 2, bm, bn]), MockTensor(torch.int32, [132])
        return [compile_sm90(stream_k._stream_k_kernel, (*descs, b, part, counts, M, N, K, 132, 7, 5),
                             {**common, **pdl_flags, **meta})]
    meta = {"SPLIT_STORE": False, **common, **pdl_flags, **config}
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
             TensorDescriptor.from_tensor(y, [bm, bn // 2 if meta["SPLIT_STORE"] else bn]))
    return [compile_sm90(tma_persistent._tma_persistent_kernel, (*descs, b, M, N, K), meta)]


def plan():
    """(module, M, N, K, dtype, config, activation, precision): every candidate of every kernel, in
    bf16 and (where it runs fp32) in fp32 at both ``FP32_PRECISIONS``, and each activation once."""
    jobs = []
    for module, (M, N, K) in ((small_m, (1, 4096, 4096)), (small_m, (3, 4096, 4096)),
                              (small_m, (5, 4096, 4096)), (small_m, (300, 4096, 4096)),
                              (tiled, (300, 1000, 704)), (tma_persistent, (300, 1000, 704)),
                              (split_k, (300, 1000, 4096)), (stream_k, (2494, 328, 13936))):
        jobs += [(module, M, N, K, torch.bfloat16, cfg, "relu", "tf32")
                 for cfg in module.candidates(M, N, K, torch.bfloat16)]
    for module, (M, N, K) in ((small_m, (1, 4096, 4096)), (small_m, (5, 1000, 704)), (small_m, (16, 1000, 704)),
                              (small_m, (300, 1000, 704)), (tiled, (300, 1000, 704)), (split_k, (300, 1000, 4096))):
        # (the GEMV has no dot: its products are exact whatever the precision)
        jobs += [(module, M, N, K, torch.float32, cfg, "relu", precision)
                 for cfg in module.candidates(M, N, K, torch.float32)
                 for precision in FP32_PRECISIONS if precision == "ieee" or not cfg.get("GEMV")]
    jobs += [(module, 70, 1000, 704, torch.float16, module.candidates(70, 1000, 704, torch.float16)[0], act, "tf32")
             for module in (small_m, tiled, tma_persistent, split_k) for act in ACTIVATIONS]
    jobs += [(stream_k, 2494, 328, 13936, torch.float16, stream_k.candidates(2494, 328, 13936, torch.float16)[0], act,
              "tf32") for act in ACTIVATIONS]
    gemv = next(cfg for cfg in small_m.candidates(3, 1000, 704, torch.float16) if cfg.get("GEMV"))
    jobs += [(small_m, 3, 1000, 704, torch.float16, gemv, act, "tf32") for act in ACTIVATIONS]
    jobs += [(normalize, 70, 64, 64, dtype, {"num_warps": 4}, "none", "ieee")
             for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    return jobs


def main():
    failures = 0
    for module, M, N, K, dtype, config, activation, precision in plan():
        start = time.perf_counter()
        try:
            compiled = compile_launch(module, M, N, K, dtype, config, activation, precision=precision)
        except Exception as e:  # reported and counted: the exit status says a compile failed
            failures += 1
            # A CompilationError's own text is source context; its cause says what went wrong.
            reason = e.__cause__ if e.__cause__ is not None else e
            print(f"FAIL {module.NAME} {M}x{N}x{K} {dtype} {precision} {activation} {config}: {type(reason).__name__}: "
                  f"{str(reason)[:500]}", flush=True)
            continue
        shared = max(c.metadata.shared for c in compiled)
        print(f"ok   {module.NAME} {M}x{N}x{K} {dtype} {precision} {activation} {config}: shared {shared} B, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    print(f"{failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
