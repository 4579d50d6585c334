"""Kernel families that run a vendor library's GEMM through torch (cuBLAS/cuBLASLt), timed against
our own kernels so a layer never runs slower than the library where the library wins."""
