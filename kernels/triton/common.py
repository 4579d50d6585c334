"""``@triton.jit`` pieces every Triton family shares: the programmatic-dependent-launch wait, the
grouped tile order and the tensor-core step."""

import math

import triton
import triton.language as tl


@triton.jit
def launch_dependents_then_wait():
    """In a programmatic dependent launch: let the next kernel on the stream start launching now,
    then wait until the previous one has finished (its writes visible) before reading anything it
    may have written. Every kernel before it waited the same way, so all earlier work is done."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


@triton.jit
def dot_acc(acc, a, b, INPUT_PRECISION: tl.constexpr, UPCAST_BF16: tl.constexpr):
    """``acc + a @ b`` on the tensor cores (fp32 tiles under the interpreter, whose bf16 tl.dot is
    wrong while its fp32 one is right)."""
    if UPCAST_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid``: GROUP_M tile rows are swept column by column, so
    neighbouring programs reuse W tiles in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % num_in_group) % group_rows, (pid % num_in_group) // group_rows


@triton.jit
def aligned(value, ALIGN: tl.constexpr):
    """``value``, known to be a multiple of ``ALIGN``, in a form the compiler sees is one. Triton
    specializes an int argument on divisibility by 16 alone; rows 8 elements apart (fp32 K=1016)
    otherwise load 4 bytes at a time, where 16-byte copies fit."""
    if ALIGN > 1:
        value = value // ALIGN * ALIGN
    return value


def k_align(K: int, *tensors) -> int:
    """The largest power of two up to 16 that divides ``K`` and every tensor's row stride (the
    ``K_ALIGN`` of kernels that read ``[rows, K]`` operands through ``aligned``)."""
    return math.gcd(16, K, *(t.stride(0) for t in tensors))
