"""Saving, loading and the errors a broken model directory gives."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusedserve.models import MLP, MLPConfig, load_model, load_repository, save_model

CONFIG = MLPConfig(in_features=3, hidden_features=(17, 70), out_features=5)


def saved(tmp_path, name="tiny", config=CONFIG):
    torch.manual_seed(0)
    model = MLP(config)
    model.input_shift.uniform_(-1, 1)
    model.input_scale.uniform_(0.5, 2)
    save_model(model, tmp_path / name)
    return model, tmp_path / name


def test_round_trip_gives_same_outputs_and_metadata(tmp_path):
    model, path = saved(tmp_path)
    loaded = load_model(path, device="cpu")
    x = torch.randn(17, 3) * 10
    # Same tensors, same ops, same device: bitwise equal.
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert (loaded.name, loaded.backend, loaded.device.type) == ("tiny", "torch", "cpu")
    assert loaded.config == CONFIG
    assert not loaded.training


def test_normalization_is_applied_inside_the_model(tmp_path):
    model, path = saved(tmp_path)
    loaded = load_model(path, device="cpu")
    x = torch.randn(3, 3)
    by_hand = x.sub(model.input_shift).mul(model.input_scale)
    for layer in loaded.layers:
        by_hand = layer(by_hand)
    torch.testing.assert_close(loaded(x), by_hand, rtol=0, atol=0)


def test_last_layer_has_no_activation():
    model = MLP(CONFIG)
    assert [layer.activation for layer in model.layers] == ["relu", "relu", "none"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_load_in_their_dtype(tmp_path, dtype):
    config = MLPConfig(3, (17,), 5, dtype=dtype)
    _, path = saved(tmp_path, config=config)
    loaded = load_model(path, device="cpu")
    assert loaded.layers[0].weight.dtype == config.torch_dtype
    assert loaded(torch.randn(1, 3)).dtype == config.torch_dtype


def test_repository_loads_every_model_directory(tmp_path):
    saved(tmp_path, "a")
    saved(tmp_path, "b")
    (tmp_path / "not_a_model").mkdir()
    models = load_repository(tmp_path, device="cpu")
    assert sorted(models) == ["a", "b"]
    assert models["b"].name == "b"


def test_empty_repository_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="holds no model"):
        load_repository(tmp_path)


def test_missing_directory_and_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")
    _, path = saved(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"in_features": 3, "out_features": 5}', "missing config keys"),
    ('{"in_features": 3, "hidden_features": [4], "out_features": 5, "colour": 1}', "unknown"),
    ('{"in_features": 3, "hidden_features": [4], "out_features": 5, "dtype": "int8"}', "dtype"),
    ('{"in_features": 0, "hidden_features": [4], "out_features": 5}', "in_features"),
    ('{"in_features": 3, "hidden_features": [4], "out_features": 5, "activation": "x"}',
     "activation"),
])
def test_bad_config_says_what_is_wrong(tmp_path, text, message):
    _, path = saved(tmp_path)
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_tensors_that_do_not_match_the_config_are_rejected(tmp_path):
    _, path = saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["layers.0.weight"] = torch.zeros(17, 4)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.0.weight"):
        load_model(path)
    del tensors["layers.0.weight"]
    tensors["extra"] = torch.zeros(1)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['layers.0.weight'\].*\['extra'\]"):
        load_model(path)


def test_config_file_is_plain_json(tmp_path):
    _, path = saved(tmp_path)
    assert json.loads((path / "config.json").read_text()) == {
        "in_features": 3, "hidden_features": [17, 70], "out_features": 5,
        "activation": "relu", "dtype": "float32",
    }


def test_bad_backend_and_device(tmp_path, monkeypatch):
    _, path = saved(tmp_path)
    with pytest.raises(ValueError, match="backend"):
        load_model(path, device="cpu", backend="onnx")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        load_model(path, device="cpu", backend="triton")
    with pytest.raises(ValueError, match="device"):
        load_model(path, device="tpu")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, value):
    _, path = saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["layers.1.bias"][4] = value
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'layers.1.bias' holds 1 NaN or infinite value\(s\), first at \[4\]"):
        load_model(path, device="cpu")


def test_weights_that_overflow_the_config_dtype_are_refused(tmp_path):
    # 1e6 is a finite float32 in the file, but past float16's largest value (65504): inf once cast.
    _, path = saved(tmp_path, config=MLPConfig(3, (17,), 5, dtype="float16"))
    tensors = load_file(path / "model.safetensors")
    tensors["layers.0.weight"] = tensors["layers.0.weight"].float()
    tensors["layers.0.weight"][2, 1] = 1e6
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"as float16.*'layers.0.weight'.*first at \[2, 1\]"):
        load_model(path, device="cpu")
