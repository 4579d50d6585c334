"""Per-layer activations: a config names one activation per hidden layer and one after the last
layer (softmax included, run in torch after the last kernel), and every way a model runs computes them:
the torch backend, the Triton layers under the interpreter, the fused chain. Old configs (one
``activation`` string) keep their meaning and their file."""

import json

import pytest
import torch
import torch.nn.functional as F

from fusedserve.kernels.activations import ACTIVATIONS, split_activation
from fusedserve.models import MLP, MLPConfig, ModelRunner, load_model, save_model

ON_GPU = torch.cuda.is_available()
CONFIG = MLPConfig(in_features=13, hidden_features=(17, 9, 6), out_features=4,
                   activation=["gelu_erf", "silu", "tanh"], output_activation="softmax")


def reference(model: MLP, x: torch.Tensor) -> torch.Tensor:
    """The model's math written out in float64: torch's own functions, not the activation table."""
    h = (x.double() - model.input_shift.double()) * model.input_scale.double()
    acts = [lambda y: F.gelu(y), F.silu, torch.tanh, lambda y: torch.softmax(y, -1)]
    for layer, act in zip(model.layers, acts, strict=True):
        h = act(F.linear(h, layer.weight.double(), layer.bias.double()))
    return h


def make(backend="torch", config=CONFIG):
    torch.manual_seed(0)
    model = MLP(config, backend=backend).eval().requires_grad_(False)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    return model


def test_each_layer_applies_its_own_activation():
    model = make()
    assert [layer.activation for layer in model.layers] == ["gelu_erf", "silu", "tanh", "softmax"]
    x = torch.randn(7, 13)
    got = model(x)
    # float32 through four small layers: a few roundings of O(1) values.
    torch.testing.assert_close(got.double(), reference(model, x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(7), rtol=1e-6, atol=1e-6)  # softmax rows


def test_one_activation_string_still_means_every_hidden_layer_and_a_linear_last_layer():
    config = MLPConfig.from_dict({"in_features": 3, "hidden_features": [4, 5], "out_features": 2,
                                  "activation": "gelu", "dtype": "float32"})
    assert config.activations == ("gelu", "gelu", "none")
    assert config.to_dict() == {"in_features": 3, "hidden_features": [4, 5], "out_features": 2,
                                "activation": "gelu", "dtype": "float32"}


def test_a_list_config_round_trips_through_its_file(tmp_path):
    model = make()
    save_model(model, tmp_path / "m")
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    assert data["activation"] == ["gelu_erf", "silu", "tanh"] and data["output_activation"] == "softmax"
    loaded = load_model(tmp_path / "m", device="cpu")
    assert loaded.config == model.config
    x = torch.randn(3, 13)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("change, match", [
    ({"activation": ["relu"]}, r"one activation per hidden layer \(3\), got 1"),
    ({"activation": ["relu", "softmax", "relu"]}, r"'softmax' \(row-wise: only output_activation"),
    ({"activation": ["relu", "swish", "relu"]}, "got 'swish'"),
    ({"output_activation": "argmax"}, "output_activation must be one of"),
    ({"output_activation": ["softmax"]}, "output_activation must be one of"),
])
def test_bad_activations_are_refused_naming_them(change, match):
    data = {**CONFIG.to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        MLPConfig.from_dict(data)


def test_gelu_keeps_the_tanh_form_and_gelu_erf_is_exact():
    y = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS["gelu"](y), F.gelu(y, approximate="tanh"), rtol=0, atol=0)
    torch.testing.assert_close(ACTIVATIONS["gelu_erf"](y), 0.5 * y * (1 + torch.erf(y / 2**0.5)))
    # The two differ by more than any rounding: a stored "gelu" model must keep the tanh form.
    assert (ACTIVATIONS["gelu"](y) - ACTIVATIONS["gelu_erf"](y)).abs().max() > 1e-4
    assert split_activation("softmax")[0] == "none" and split_activation("gelu_erf") == ("gelu_erf", None)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's run; the GPU suite runs the kernels")
@pytest.mark.parametrize("fused", [True, False])
def test_the_triton_paths_compute_per_layer_activations_under_the_interpreter(fused):
    model, torch_model = make("triton"), make("torch")
    runner = ModelRunner(model, max_batch_size=8, fused=fused)
    x = torch.randn(5, 13) * 3
    got = runner.run(x)
    # fp32 dots under the interpreter are exact fp32 products; sums in another order than torch's.
    torch.testing.assert_close(got.double(), reference(torch_model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's run")
def test_half_precision_chain_with_a_sigmoid_head():
    config = MLPConfig(in_features=13, hidden_features=(17,), out_features=3, activation=["gelu_erf"],
                       dtype="float16", output_activation="sigmoid")
    model = make("triton", config)
    x = torch.randn(4, 13)
    got = ModelRunner(model, max_batch_size=4).run(x)
    want = make("torch", config)(x)
    # float16 activations: a few roundings of 2^-11 relative on values near 1.
    torch.testing.assert_close(got, want.float(), rtol=4e-3, atol=4e-3)
    assert ((got > 0) & (got < 1)).all()
