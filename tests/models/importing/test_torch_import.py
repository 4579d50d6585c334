"""PyTorch models in: an nn.Sequential, a module through torch.export, a saved program (.pt2), a
state_dict with its activations named; what is not a chain of layers is refused naming the layer,
and a pickle is read only when the user allows it."""

import pytest
import torch
from torch import nn

from fusedserve.models import from_torch, load_model
from fusedserve.models.importing import UnsupportedModel, import_file

from .conftest import IN

pytestmark = pytest.mark.timeout(180)  # the session's sources take ~15 s to build (the dynamo exporter)
ROWS = torch.randn(11, IN, generator=torch.Generator().manual_seed(3)) * 40


def check_serves_like(directory, module):
    model = load_model(directory, device="cpu")
    with torch.no_grad():
        # float32 both ways; the input scaling becomes our normalization: rounding only.
        torch.testing.assert_close(model(ROWS), module(ROWS), rtol=1e-5, atol=1e-6)


def test_a_sequential_imports_as_it_is(sources, tmp_path):
    report = from_torch(sources.mlp, tmp_path / "seq")
    assert report.activations == ["gelu_erf", "silu", "tanh", "softmax"] and report.max_error < 1e-6, report
    check_serves_like(tmp_path / "seq", sources.mlp)


def test_a_module_is_read_through_torch_export_and_keeps_its_mode(sources, tmp_path):
    sources.scaled.train()
    try:
        report = from_torch(sources.scaled, tmp_path / "mod")
        assert sources.scaled.training, "the user's module must come back in its own mode"
    finally:
        sources.scaled.eval()
    assert report.widths == [IN, 9, 7, 5, 4] and "torch.export" in report.source, report
    check_serves_like(tmp_path / "mod", sources.scaled)


def test_files_a_program_and_a_state_dict(sources, tmp_path):
    import_file(sources.program, tmp_path / "program", version=1)
    check_serves_like(tmp_path / "program" / "1", sources.scaled)
    with pytest.raises(UnsupportedModel, match="does not say which activations"):
        import_file(sources.state_dict, tmp_path / "state")
    import_file(sources.state_dict, tmp_path / "state", activations=["gelu_erf", "silu", "tanh"],
                output_activation="softmax")
    check_serves_like(tmp_path / "state", sources.mlp)


def test_a_pickled_module_is_read_only_when_allowed(sources, tmp_path):
    with pytest.raises(UnsupportedModel, match="holds pickled Python objects.*only if you trust the file"):
        import_file(sources.pickled_module, tmp_path / "pickled")
    import_file(sources.pickled_module, tmp_path / "pickled", allow_pickle=True)
    check_serves_like(tmp_path / "pickled", sources.mlp)


def test_a_bfloat16_import_checks_itself_at_its_own_tolerance(sources, tmp_path):
    report = from_torch(sources.mlp, tmp_path / "bf16", dtype="bfloat16")
    assert report.dtype == "bfloat16" and report.passed and 0 < report.max_error <= report.tolerance, report


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, IN)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + x


@pytest.mark.parametrize("source, match", [
    (nn.Sequential(nn.Linear(IN, 4), nn.Conv1d(1, 1, 1)), r"layer '1' \(Conv1d\) is not a linear layer or a supported"),
    (nn.Sequential(nn.Linear(IN, 4), nn.LeakyReLU(), nn.Linear(4, 2)), r"layer '1' \(LeakyReLU\) is not a linear"),
    (nn.Sequential(nn.Linear(IN, 4), nn.ReLU(), nn.Linear(4, 2), nn.Softmax(dim=0)),
     r"layer '3' \(Softmax\) after the last linear layer computes none of the supported activations"),
    (nn.Sequential(nn.Linear(IN, 4), nn.Softmax(dim=-1), nn.Linear(4, 2)),
     r"layer '1' \(Softmax\) between two linear layers computes none"),
    (Skip(), r"node 'add' \(aten.add.Tensor\) reads a tensor computed before the last linear layer"),
    (nn.Sequential(nn.ReLU()), "has no linear layer"),
    ({"0.weight": torch.ones(3, IN), "1.running_mean": torch.ones(3)}, r"tensor '1.running_mean' is not a linear"),
    (42, "int is not an nn.Module, a torch.export program or a state_dict"),
])
def test_what_is_not_a_chain_is_refused_naming_the_layer(tmp_path, source, match):
    with pytest.raises(UnsupportedModel, match=match):
        from_torch(source, tmp_path / "refused", activations="relu")
    assert not (tmp_path / "refused").exists()


def test_a_state_dict_needs_one_activation_per_hidden_layer(sources, tmp_path):
    with pytest.raises(UnsupportedModel, match="has 3 hidden layers but 2 activations were named"):
        from_torch(sources.mlp.state_dict(), tmp_path / "m", activations=["relu", "relu"])
    with pytest.raises(UnsupportedModel, match="activation of layer '6'.*got 'swish'"):
        from_torch(sources.mlp.state_dict(), tmp_path / "m", activations="relu", output_activation="swish")
