"""ONNX files in: what torch.onnx.export (both exporters) and skl2onnx write imports and answers as
onnxruntime does; every other graph is refused naming the node and why, and nothing is written."""

import json

import numpy as np
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from fusedserve.models import from_onnx, load_model
from fusedserve.models.importing import UnsupportedModel, onnx_graph

from .conftest import IN, skl2onnx_file

pytestmark = pytest.mark.timeout(180)  # the session's sources take ~15 s to build (the dynamo exporter)


def run_onnx(path, x):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})


def served(directory, x):
    """What ``fusedserve serve`` would answer: the written model, loaded as the server loads it."""
    with torch.no_grad():
        return load_model(directory, device="cpu")(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("exporter", ["legacy_onnx", "dynamo_onnx"])
def test_torch_exports_import_and_answer_as_onnxruntime(sources, tmp_path, exporter):
    report = from_onnx(getattr(sources, exporter), tmp_path / "repo" / "mlp")
    assert report.passed and report.activations == ["gelu_erf", "silu", "tanh", "softmax"], report
    assert report.widths == [IN, 9, 7, 5, 4]
    saved = json.loads((tmp_path / "repo" / "mlp" / "import_report.json").read_text())
    assert saved["max_error"] == report.max_error and saved["checked_against"].startswith("onnxruntime")
    x = (np.random.default_rng(1).normal(size=(13, IN)) * 30).astype(np.float32)
    # float32 both ways; the (x - mean) / 3 at the input is our normalization now: rounding only.
    np.testing.assert_allclose(served(tmp_path / "repo" / "mlp", x), run_onnx(getattr(sources, exporter), x)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zipmap", [False, True])
def test_a_skl2onnx_pipeline_keeps_its_scaler_and_class_labels(pipeline, tmp_path, zipmap):
    path = skl2onnx_file(pipeline.model, pipeline.x, tmp_path / "clf.onnx", zipmap=zipmap)
    report = from_onnx(path, tmp_path / "repo" / "iris")
    assert report.labels == 3 and report.activations == ["relu", "relu", "softmax"], report
    model = load_model(tmp_path / "repo" / "iris", device="cpu")
    assert model.labels == ("setosa", "versicolor", "virginica")
    np.testing.assert_allclose(served(tmp_path / "repo" / "iris", pipeline.x),
                               pipeline.model.predict_proba(pipeline.x), rtol=1e-4, atol=1e-6)


def test_a_binary_classifier_answers_both_probabilities(pipeline, tmp_path):
    from sklearn.neural_network import MLPClassifier

    clf = MLPClassifier(hidden_layer_sizes=(4,), max_iter=300, random_state=0)
    clf.fit(pipeline.x / 100, pipeline.x[:, 0] > 100)
    path = skl2onnx_file(clf, pipeline.x / 100, tmp_path / "binary.onnx")
    report = from_onnx(path, tmp_path / "repo" / "binary")
    assert report.widths == [IN, 4, 2] and report.activations == ["relu", "softmax"], report
    np.testing.assert_allclose(served(tmp_path / "repo" / "binary", pipeline.x / 100),
                               clf.predict_proba(pipeline.x / 100), rtol=1e-4, atol=1e-6)


def graph(nodes, initializers, opset=20, inputs=("x",), outputs=("y",), width=4):
    """A hand-built ONNX model: float inputs [batch, width], float outputs."""
    return helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", width])
                                       for n in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()]),
        opset_imports=[helper.make_opsetid("", opset)])


WEIGHTS = {"w1": np.full((4, 3), 0.5, np.float32), "b1": np.zeros(3, np.float32),
           "w2": np.ones((3, 2), np.float32), "b2": np.zeros(2, np.float32)}


def layer(i, source, output):
    return [helper.make_node("MatMul", [source, f"w{i}"], [f"m{i}"], name=f"fc{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [output], name=f"bias{i}")]


def test_half_precision_weights_import_as_float16(tmp_path):
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Gemm", ["h", "w", "b"], ["g"], transB=1, name="fc"),
             helper.make_node("Relu", ["g"], ["r"]), helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT)]
    model = graph(nodes, {"w": np.linspace(-1, 1, 12).reshape(3, 4).astype(np.float16),
                          "b": np.array([0.1, -0.2, 0.3], np.float16)})
    report = from_onnx(model, tmp_path / "half")
    assert report.dtype == "float16" and report.activations == ["relu"] and report.passed, report


@pytest.mark.parametrize("nodes, extra, match", [
    ([helper.make_node("Conv", ["x", "w1"], ["y"], name="conv1")], {},
     r"node 'conv1' \(Conv\) is not a linear layer or a supported activation"),
    ([*layer(1, "x", "h"), helper.make_node("LeakyRelu", ["h"], ["a"], name="leaky"), *layer(2, "a", "y")], {},
     r"node 'leaky' \(LeakyRelu\) is not a linear layer"),
    ([*layer(1, "x", "h"), helper.make_node("Mul", ["h", "two"], ["a"], name="double"), *layer(2, "a", "y")],
     {"two": np.float32(2)}, r"node 'double' \(Mul\) between two linear layers computes none of the supported"),
    ([*layer(1, "x", "h"), helper.make_node("Softmax", ["h"], ["a"], name="sm"), *layer(2, "a", "y")], {},
     r"node 'sm' \(Softmax\) between two linear layers computes none"),
    ([*layer(1, "x", "h"), helper.make_node("Relu", ["h"], ["a"]), *layer(2, "a", "z"),
      helper.make_node("Add", ["z", "a"], ["y"], name="skip")], {}, r"node 'skip' \(Add\) reads a tensor computed"),
    ([*layer(1, "x", "h"), helper.make_node("Relu", ["h"], ["a"]), helper.make_node("Tanh", ["h"], ["t"], name="dead"),
      *layer(2, "a", "y")], {}, r"node 'dead' \(Tanh\) computes a tensor the model's chain never uses"),
    ([helper.make_node("MatMul", ["x", "x"], ["y"], name="square")], {},
     r"node 'square' \(MatMul\) is not a linear layer: it must multiply the rows by constant weights"),
    ([helper.make_node("Mul", ["x", "zero"], ["s"], name="mask"), *layer(1, "s", "h"), *layer(2, "h", "y")],
     {"zero": np.array([1, 0, 1, 1], np.float32)}, r"node 'mask' \(Mul\) multiplies input feature 1 by 0"),
    ([helper.make_node("Relu", ["x"], ["s"], name="early"), *layer(1, "s", "h"), *layer(2, "h", "y")], {},
     r"node 'early' \(Relu\) before the first linear layer is not a per-feature scale and shift"),
    ([helper.make_node("Relu", ["x"], ["y"])], {}, "has no linear layer"),
])
def test_graphs_that_are_not_a_chain_are_refused_naming_the_node(tmp_path, nodes, extra, match):
    with pytest.raises(UnsupportedModel, match=match):
        from_onnx(graph(nodes, {**WEIGHTS, **extra}), tmp_path / "refused")
    assert not (tmp_path / "refused").exists(), "a refused model must leave nothing behind"


def test_models_outside_the_supported_opsets_inputs_and_outputs_are_refused(tmp_path):
    chain = [*layer(1, "x", "h"), *layer(2, "h", "y")]
    with pytest.raises(UnsupportedModel, match=r"opset 10; import reads opsets 11 to 23"):
        from_onnx(graph(chain, WEIGHTS, opset=10), tmp_path / "m")
    with pytest.raises(UnsupportedModel, match=r"takes 2 inputs \(\['x', 'x2'\]\)"):
        from_onnx(graph(chain, WEIGHTS, inputs=("x", "x2")), tmp_path / "m")
    with pytest.raises(UnsupportedModel, match=r"has 2 outputs \['y', 'h'\]; import serves one"):
        from_onnx(graph(chain, WEIGHTS, outputs=("y", "h")), tmp_path / "m")
    (tmp_path / "junk.onnx").write_bytes(b"not a protobuf at all")
    with pytest.raises(UnsupportedModel, match="is not a readable ONNX model"):
        from_onnx(tmp_path / "junk.onnx", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_an_import_that_does_not_match_its_source_writes_nothing(tmp_path, monkeypatch):
    chain = [*layer(1, "x", "h"), helper.make_node("Relu", ["h"], ["a"]), *layer(2, "a", "y")]
    monkeypatch.setattr(onnx_graph, "answerer", lambda model, reading: lambda x: np.zeros((len(x), 2)))
    with pytest.raises(UnsupportedModel, match=r"(?s)DOES NOT match onnxruntime .*\nnothing was written"):
        from_onnx(graph(chain, WEIGHTS), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_an_existing_model_is_never_overwritten_and_versions_are_numbered(tmp_path):
    model = graph([*layer(1, "x", "h"), helper.make_node("Sigmoid", ["h"], ["a"]), *layer(2, "a", "y")], WEIGHTS)
    from_onnx(model, tmp_path / "m")
    with pytest.raises(FileExistsError, match=r"already holds a model: .* \(--version 2\)"):
        from_onnx(model, tmp_path / "m")
    with pytest.raises(FileExistsError, match="outside a version folder"):
        from_onnx(model, tmp_path / "m", version=2)
    from_onnx(model, tmp_path / "v", version=1)
    report = from_onnx(model, tmp_path / "v", version=2)
    assert report.path == str(tmp_path / "v" / "2") and (tmp_path / "v" / "2" / "config.json").is_file()
    with pytest.raises(FileExistsError, match="import it as version 3"):
        from_onnx(model, tmp_path / "v", version=2)
