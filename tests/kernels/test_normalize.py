"""The one-launch input normalization against torch's expression of it (``models.MLP.normalize``):
bit-equal, under the interpreter on the CPU and on a GPU; its argument checks."""

import pytest
import torch

from fusedserve.kernels.triton.normalize import BLOCK, normalize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, shift, scale, dtype):
    return ((x.float() - shift) * scale).to(dtype)


def interpreter_reference(x, shift, scale, dtype):
    """``reference`` as triton 3.6's interpreter rounds: its fp32 -> bf16 cast truncates the low 16
    bits where the GPU (and torch) round to nearest even; every other cast rounds as torch does."""
    if dtype != torch.bfloat16:
        return reference(x, shift, scale, dtype)
    y = ((x.float() - shift) * scale).contiguous()
    return (y.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)  # exact: low bits are zero


def make(M, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(M, K, generator=g) * 16).to(DEVICE)
    shift = (torch.rand(K, generator=g) * 8).to(DEVICE)
    scale = (torch.rand(K, generator=g) + 0.1).to(DEVICE)
    return x, shift, scale


# Awkward shapes: one row, rows that end mid-block, more elements than one block (BLOCK = 1024).
@pytest.mark.parametrize("M, K", [(1, 64), (37, 70), (3, 1000), (2, BLOCK + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_bit_equal_to_torch(M, K, dtype):
    x, shift, scale = make(M, K)
    expected = reference if x.is_cuda else interpreter_reference
    got, want = normalize(x, shift, scale, dtype), expected(x, shift, scale, dtype)
    assert got.dtype == dtype and got.shape == (M, K)
    # Same fp32 subtract and multiply, one rounding: nothing may differ.
    diff = (got.float() != want.float()).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def test_strided_rows():
    x, shift, scale = make(5, 40)
    wide = torch.zeros(5, 64, device=DEVICE)
    wide[:, :40] = x
    view = wide[:, :40]  # rows 64 apart
    assert torch.equal(normalize(view, shift, scale, torch.float16), reference(x, shift, scale, torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_batch_on_the_gpu():
    x, shift, scale = make(4096, 4096)
    assert torch.equal(normalize(x, shift, scale, torch.bfloat16), reference(x, shift, scale, torch.bfloat16))


def test_rejects_bad_arguments():
    x, shift, scale = make(2, 8)
    with pytest.raises(ValueError, match="x must be a float32"):
        normalize(x.half(), shift, scale, torch.float32)
    with pytest.raises(ValueError, match="shift must be"):
        normalize(x, shift[:4], scale, torch.float32)
    with pytest.raises(ValueError, match="scale must be"):
        normalize(x, shift, scale.double(), torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        normalize(x, shift, scale, torch.int8)
