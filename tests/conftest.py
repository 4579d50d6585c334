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


def _language_modules():
    import triton.language as tl
    from triton.language import core, math, standard

    return (tl, core, math, standard, tl.tensor, core.tensor)


@pytest.fixture(autouse=True, scope="session")
def _language_snapshot():
    """triton.language as imported, before any kernel is interpreted (None on a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    return [(module, dict(vars(module))) for module in _language_modules()]


@pytest.fixture(autouse=True)
def _undo_interpreter_patches(_language_snapshot):
    """Put back what Triton's interpreter leaves patched in ``triton.language`` after a test.

    triton 3.6's interpreter swaps ``triton.language.core`` functions for interpreted ones while
    a kernel runs, but a call into a ``@triton.jit`` helper (``tl.cdiv``, ``tl.sum``, our own)
    patches them again and never restores them. A Gluon kernel compiled for sm_90 later in the same
    process then lowers those interpreted stand-ins and fails (``'block_argument' object has no
    attribute 'dtype'`` in ``cdiv``)."""
    yield
    for module, attributes in _language_snapshot or ():
        current = vars(module)
        for name, value in attributes.items():
            if current.get(name) is not value:
                setattr(module, name, value)


@pytest.fixture(autouse=True)
def _no_grpc_on_the_default_port(monkeypatch):
    """An app built in a test serves no gRPC unless the test asks for a port: never 8001, where
    another test's server (or a developer's) may be listening."""
    monkeypatch.setenv("FUSEDSERVE_GRPC_PORT", "0")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
