"""Peak compute and memory rates a roofline is drawn against: the highest rates measured on the GPUs
we run on (H200, H100 SXM), datasheet figures for a few others, and a rough estimate for a CPU. Each
answer says where its numbers come from and whether they are an estimate."""

from __future__ import annotations

import functools
import os

# The measured rows: the best 8192^3 bf16 matmul and device copy that bench/kernels.py records in every
# run's line (matmul_tflops, copy_tbps), over the runs of bench/results/kernels.jsonl on that GPU
# (tests/service/stats/test_model_stats.py checks these against the file). fp16 is taken as bf16; fp32
# without TF32 is the datasheet's.
MEASURED = "the best of bench/results/kernels.jsonl's runs there"
# (substring of torch's device name, peaks). The first match wins: "H100 PCIe" before "H100".
GPU_PEAKS = (
    ("H200", {"tflops": {"bfloat16": 797.4, "float16": 797.4, "float32": 67.0}, "tbps": 4.255, "estimate": False,
              "source": f"measured on an H200, {MEASURED}: bf16 matmul 797 TFLOP/s, copy 4.26 TB/s; "
                        "fp16 as bf16; fp32 without TF32 from the datasheet (67)"}),
    ("H100 PCIe", {"tflops": {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}, "tbps": 2.0, "estimate": True,
                   "source": "H100 PCIe datasheet (dense), not measured"}),
    ("H100", {"tflops": {"bfloat16": 763.9, "float16": 763.9, "float32": 67.0}, "tbps": 3.027, "estimate": False,
              "source": f"measured on an H100 SXM, {MEASURED}: bf16 matmul 764 TFLOP/s, copy 3.03 TB/s; "
                        "fp16 as bf16; fp32 without TF32 from the datasheet (67)"}),
)
_FALLBACK_GPU = "H200"
# A CPU core: an assumed clock, and fp32 flops per cycle (two FMA units of 8 or 16 lanes).
_CPU_GHZ, _CPU_DRAM_TBPS = 2.5, 0.02


def gpu_peaks(name: str) -> dict:
    """Peaks of the GPU torch calls ``name``; an unknown one gets the H200's, marked an estimate."""
    for key, peaks in GPU_PEAKS:
        if key in name:
            return {"name": name, **peaks}
    fallback = dict(GPU_PEAKS)[_FALLBACK_GPU]
    return {"name": name, **fallback, "estimate": True,
            "source": f"no figures for {name!r}: the {_FALLBACK_GPU}'s, as a stand-in"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_peaks(cores: int | None = None, flags: set[str] | None = None) -> dict:
    """A rough CPU roofline: cores x 2.5 GHz x fp32 flops per cycle (AVX-512: 64, AVX2 + FMA: 32,
    else 8), and 20 GB/s of DRAM. Always an estimate: nothing here is measured."""
    cores = cores or os.cpu_count() or 1
    flags = _cpu_flags() if flags is None else flags
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8
    tflops = cores * _CPU_GHZ * per_cycle / 1e3
    return {"name": f"CPU ({cores} cores)", "tflops": dict.fromkeys(("float32", "float16", "bfloat16"), tflops),
            "tbps": _CPU_DRAM_TBPS, "estimate": True,
            "source": f"estimate: {cores} cores x {_CPU_GHZ} GHz x {per_cycle} fp32 flop/cycle, "
                      f"{_CPU_DRAM_TBPS * 1e3:.0f} GB/s DRAM; not measured"}


@functools.cache
def device_peaks(device: str) -> dict:
    """Peaks of a served model's device ("cpu", "cuda:0")."""
    if device.startswith("cuda"):
        from fusedserve.kernels.device import cuda_name  # torch: only where a model is on a GPU

        return gpu_peaks(cuda_name(device))
    return cpu_peaks()
