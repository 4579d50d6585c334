"""The runner's "layers" path: with the torch backend it binds the layers' tensors once and must
compute exactly what the model's own forward computes, hooks included; the "vendor" path the same
model through the vendor family."""

import pytest
import torch

from fusedserve.models import MLP, MLPConfig
from fusedserve.models.paths import LayersPath, VendorPath


def make_model(activation: str, dtype: str) -> MLP:
    torch.manual_seed(1)
    config = MLPConfig(in_features=13, hidden_features=(70, 3), out_features=5, activation=activation, dtype=dtype)
    model = MLP(config, backend="torch", name="tiny").eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "tanh"])
def test_the_bound_layers_compute_the_models_forward_bitwise(activation, dtype):
    model = make_model(activation, dtype)
    path = LayersPath(model)
    for rows in (1, 3, 130):
        x = torch.randn(rows, 13) * 5
        seen_path, seen_model = [], []
        got = path.forward(x, seen_path.append)
        want = model(x, seen_model.append)
        assert seen_path == seen_model == [0, 1, 2, 3]
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops in the same order


def test_the_bound_layers_see_weights_loaded_after_binding():
    model = make_model("relu", "float32")
    path = LayersPath(model)
    with torch.no_grad():
        for layer in model.layers:  # as loading a state dict does: in place
            layer.weight.mul_(-1)
    x = torch.randn(4, 13)
    torch.testing.assert_close(path.forward(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["relu", "gelu_erf", "tanh"])
def test_the_vendor_path_computes_the_models_forward(activation):
    # On the CPU the vendor family runs the same torch ops as the reference (addmm then the
    # activation where torch's CPU epilogue differs), so float32 answers agree to rounding.
    model = make_model(activation, "float32")
    path = VendorPath(model)
    x = torch.randn(7, 13) * 5
    seen_path, seen_model = [], []
    got = path.forward(x, seen_path.append)
    want = model(x, seen_model.append)
    assert seen_path == seen_model == [0, 1, 2, 3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert path.tuned(8) and path.kernel(0, 8)[0] == "torch_cublas"
