"""Test-session set-up shared by every test package.

Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated, so ``TRITON_INTERPRET`` must be set before ``kernels`` is first
imported: this file is loaded before any test module.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
