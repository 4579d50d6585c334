"""Every import checks itself: the written model, loaded back as ``fusedserve serve`` would load it,
answers random rows as the source framework does, within its dtype's tolerance; the report of what was
imported and how close it came is printed and kept beside the model (``REPORT_FILE``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fusedserve.models.loading import FILE_MODE, load_model
from fusedserve.models.mlp import MLP

REPORT_FILE = "import_report.json"
CHECK_ROWS, CHECK_SEED = 64, 0
# Largest error allowed against the source, relative to max(1, largest output): a float32 model
# differs from a float32 source by rounding in another summation order (~1e-6 here); 16-bit weights
# and activations round each layer's output to 2^-11 (float16) or 2^-8 (bfloat16) relative.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}


@dataclass
class ImportReport:
    """What an import wrote and how its answers compare with the source's."""

    path: str  # the model directory written
    source: str  # "onnx", "torch" or "scikit-learn", and the file or object imported
    checked_against: str  # the framework (and version) that answered the same rows
    dtype: str
    widths: list[int]
    activations: list[str]  # per layer, the last layer's included
    parameters: int
    labels: int  # class labels stored (0: none)
    rows: int  # random rows compared
    max_error: float  # largest |ours - theirs| / max(1, largest |theirs|)
    tolerance: float
    passed: bool

    def __str__(self) -> str:
        verdict = "matches" if self.passed else "DOES NOT match"
        return (f"imported {self.source} -> {self.path}\n"
                f"  widths {self.widths}, activations {self.activations}, {self.parameters:,} parameters, "
                f"{self.dtype}" + (f", {self.labels} class labels" if self.labels else "") + "\n"
                f"  {verdict} {self.checked_against} on {self.rows} random rows: max error {self.max_error:.3g} "
                f"(tolerance {self.tolerance:g})")

    def save(self, directory: Path) -> None:
        path = directory / REPORT_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.chmod(path, FILE_MODE)


def random_rows(model: MLP, rows: int = CHECK_ROWS) -> np.ndarray:
    """float32 [rows, in] the model normalizes to N(0, 1) values: raw features at their own scale."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    z = torch.randn(rows, model.config.in_features, generator=generator, dtype=torch.float64)
    x = z / model.input_scale.double() + model.input_shift.double()
    return x.float().numpy()


def check(directory: Path, answer, source: str, checked_against: str) -> ImportReport:
    """Load the model at ``directory`` (torch backend, CPU) and compare it on random rows with
    ``answer`` (float32 rows -> the source's outputs) within ``TOLERANCE`` of its dtype."""
    model = load_model(directory, device="cpu", backend="torch")
    x = random_rows(model)
    with torch.no_grad():
        ours = model(torch.from_numpy(x)).double().numpy()
    theirs = np.asarray(answer(x), dtype=np.float64).reshape(ours.shape[0], -1)
    if theirs.shape != ours.shape:
        raise ValueError(f"the source answers {list(theirs.shape)} for {len(x)} rows; the imported model "
                         f"{list(ours.shape)}")
    error = float(np.abs(ours - theirs).max() / max(1.0, float(np.abs(theirs).max())))
    config = model.config
    return ImportReport(
        path=str(directory), source=source, checked_against=checked_against, dtype=config.dtype,
        widths=list(config.widths), activations=list(config.activations),
        parameters=sum(layer.weight.numel() + layer.bias.numel() for layer in model.layers),
        labels=len(model.labels), rows=len(x), max_error=error, tolerance=TOLERANCE[config.dtype],
        passed=bool(error <= TOLERANCE[config.dtype]))
