"""The shipped ``digits`` model: loads, keeps its recorded accuracy, and both backends agree."""

import json

import pytest
import torch

from fusedserve.models import DEFAULT_REPOSITORY, load_model, load_repository
from tools.train_digits import TRAINING_FILE, held_out_split

DIGITS = DEFAULT_REPOSITORY / "digits"


@pytest.fixture(scope="module")
def record():
    return json.loads((DIGITS / TRAINING_FILE).read_text())


@pytest.fixture(scope="module")
def test_split(record):
    pytest.importorskip("sklearn", reason="the held-out split comes from scikit-learn's load_digits")
    _, x_test, _, y_test = held_out_split(record["seed"], record["split"]["test_size"])
    return x_test, y_test


def test_shipped_repository_holds_digits():
    models = load_repository(device="cpu")
    assert "digits" in models
    assert models["digits"].config.widths == (64, 256, 256, 10)


def test_held_out_accuracy_is_at_least_97_percent_and_as_recorded(record, test_split):
    x_test, y_test = test_split
    model = load_model(DIGITS, device="cpu", backend="torch")
    with torch.no_grad():
        predicted = model(x_test).argmax(dim=1)
    accuracy = (predicted == y_test).float().mean().item()
    assert len(y_test) == record["split"]["test_rows"]
    assert accuracy >= 0.97, f"held-out accuracy {accuracy:.4f} < 0.97"
    # One row of 360 flipping would move it by 0.0028: the recorded figure must reproduce exactly.
    assert accuracy == pytest.approx(record["held_out_accuracy"], abs=1e-5)


def test_triton_backend_matches_torch_backend():
    # Raw 8x8 images have integer pixels 0..16. A few awkward row counts only: the Triton
    # interpreter is slow on the CPU.
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = load_model(DIGITS, device=device, backend="torch")
    fused = load_model(DIGITS, device=device, backend="triton")
    for rows in (1, 3, 17):
        x = torch.randint(0, 17, (rows, 64)).float().to(device)
        with torch.no_grad():
            want, got = reference(x), fused(x)
        # float32 end to end: only summation order differs (TF32 is off, as torch's default);
        # 1e-4 relative covers K=256 accumulations of O(1) activations.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, rows=rows: f"rows={rows}: {m}")
