"""MLP's definition: the per-layer hook the runner times through, static weights, normalization."""

import pytest
import torch

from fusedserve.models import MLP, MLPConfig

CONFIG = MLPConfig(in_features=17, hidden_features=(70, 3), out_features=5)


def make_model(backend="torch"):
    torch.manual_seed(0)
    model = MLP(CONFIG, backend=backend, name="tiny").eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    return model


def test_hook_runs_before_each_layer_and_after_the_last():
    model = make_model()
    seen = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: seen.append(f"layer {i}"))
    x = torch.randn(3, 17)
    out = model(x, lambda i: seen.append(i))
    assert seen == [0, "layer 0", 1, "layer 1", 2, "layer 2", 3], seen
    # The hook only observes: the same ops on the same rows, bitwise.
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("static_weight", [False, True])
def test_static_weight_reaches_fused_linear(monkeypatch, static_weight):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU interpreter's model")
    model = make_model("triton")
    assert not any(layer.static_weight for layer in model.layers), "static_weight must default to False"
    calls = []
    for layer in model.layers:
        real = layer._fused_linear
        layer._fused_linear = lambda *args, real=real, **kw: calls.append(kw) or real(*args, **kw)
        layer.static_weight = static_weight
    model(torch.randn(2, 17))
    assert calls == [{"static_weight": static_weight}] * 3, calls


def test_triton_normalize_is_one_kernel_bit_equal_to_torch(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU interpreter's model")
    model, reference = make_model("triton"), make_model("torch")
    launches = []
    real = model._normalize_kernel
    model._normalize_kernel = lambda *args: launches.append(args[0].shape) or real(*args)
    x = torch.randn(5, 17) * 100
    # The same fp32 subtract and multiply, then one rounding: bitwise equal.
    assert torch.equal(model.normalize(x), reference.normalize(x))
    assert launches == [(5, 17)], launches
    # Not float32 [M, K] (the kernel's contract): torch's ops, the same values.
    assert torch.equal(model.normalize(x.double()), reference.normalize(x.double()))
    assert len(launches) == 1, launches
