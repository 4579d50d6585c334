"""The Triton kernel families (any GPU Triton supports, and the CPU interpreter), the whole-MLP
chain kernel and the input normalization."""
