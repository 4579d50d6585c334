"""Real source models built at test time, small and quick: a torch MLP (and its ONNX files from both
exporters, its torch.export program, its state_dict), a scikit-learn Pipeline(StandardScaler,
MLPClassifier) and its skl2onnx file."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

IN = 6


def torch_mlp() -> nn.Sequential:
    """A 6 -> 9 -> 7 -> 5 -> 4 MLP using every activation an export writes (erf GELU, SiLU, tanh,
    softmax), behind a per-feature scale at the input."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 9), nn.GELU(), nn.Linear(9, 7), nn.SiLU(), nn.Linear(7, 5), nn.Tanh(),
                         nn.Linear(5, 4), nn.Softmax(dim=-1)).eval()


class Scaled(nn.Module):
    """The same MLP after ``(x - mean) / 3``: a module that is no Sequential, read through torch.export."""

    def __init__(self, mlp: nn.Sequential):
        super().__init__()
        self.mlp = mlp
        self.register_buffer("mean", torch.linspace(-50, 50, IN))

    def forward(self, x):
        return self.mlp((x - self.mean) / 3.0)


def export_onnx(module: nn.Module, path, dynamo: bool):
    """``torch.onnx.export`` with a dynamic batch, by the dynamo exporter or the TorchScript one."""
    example = (torch.randn(2, IN),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, example, path, dynamo=True, input_names=["x"], output_names=["y"],
                              dynamic_shapes=({0: torch.export.Dim("batch")},))
        else:
            torch.onnx.export(module, example, path, dynamo=False, input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return path


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """Every source file, built once per session."""
    root = tmp_path_factory.mktemp("sources")
    mlp = torch_mlp()
    scaled = Scaled(mlp).eval()
    files = SimpleNamespace(mlp=mlp, scaled=scaled, root=root)
    files.legacy_onnx = export_onnx(scaled, root / "legacy.onnx", dynamo=False)
    files.dynamo_onnx = export_onnx(scaled, root / "dynamo.onnx", dynamo=True)
    program = torch.export.export(scaled, (torch.randn(2, IN),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, root / "scaled.pt2")
    files.program = root / "scaled.pt2"
    torch.save(mlp.state_dict(), root / "state.pt")
    files.state_dict = root / "state.pt"
    torch.save(mlp, root / "module.pt")
    files.pickled_module = root / "module.pt"
    return files


@pytest.fixture(scope="session")
def pipeline():
    """A fitted Pipeline(StandardScaler, MLPClassifier) over three named classes of raw features at
    their own scales, and rows to ask it about."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(90, IN)) * np.arange(1, IN + 1) * 10 + 100).astype(np.float32)
    y = np.array(["setosa", "versicolor", "virginica"])[(x[:, 0] > 100).astype(int) + (x[:, 1] > 100)]
    model = Pipeline([("scale", StandardScaler()),
                      ("mlp", MLPClassifier(hidden_layer_sizes=(8, 5), max_iter=50, random_state=0))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y)
    return SimpleNamespace(model=model, x=x)


def skl2onnx_file(model, x, path, zipmap: bool = False):
    from skl2onnx import to_onnx

    onnx_model = to_onnx(model, x[:1], options={"zipmap": zipmap} if hasattr(model, "predict_proba") else None)
    path.write_bytes(onnx_model.SerializeToString())
    return path
