"""Bring your own model: an MLP trained in PyTorch or scikit-learn, or exported to ONNX, written as an
ordinary model directory that ``fusedserve serve`` loads, after checking itself against the source.

``from_onnx``, ``from_torch`` and ``from_sklearn`` read the source (``onnx_graph``, ``torch_graph``,
``sklearn_model``), ``graph`` checks that it is a chain of linear layers and supported activations and
folds it into an MLP, and ``check`` compares the written model with the source framework on random
rows; a model that is not such a chain, or that does not match, is refused (``UnsupportedModel``,
naming the node or layer) and nothing is written. ``import_file`` picks the reader by file suffix.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from fusedserve.models.importing import graph
from fusedserve.models.importing.check import ImportReport, check
from fusedserve.models.importing.graph import UnsupportedModel
from fusedserve.models.loading import CONFIG_FILE, is_version, save_model, versions

SUFFIXES = {".onnx": "onnx", ".pt2": "torch", ".pt": "torch", ".pth": "torch", ".pkl": "sklearn",
            ".pickle": "sklearn", ".joblib": "sklearn"}
EXTRAS = {"onnx": "onnx", "onnxruntime": "onnx", "sklearn": "sklearn"}


def _require(module: str):
    """Import an optional dependency, or ImportError naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"importing this model needs {module}: pip install 'fusedserve[{EXTRAS[module]}]'") from None


def _target(destination: Path, version: int | None) -> Path:
    """The folder to write: ``destination`` (REPOSITORY/NAME) or its version folder; refuses to
    overwrite a model, saying which version is free."""
    found = versions(destination) if destination.is_dir() else {}
    free = str(max((int(v) for v in found), default=0) + 1)
    if version is None:
        if found:
            raise FileExistsError(f"{destination} already holds a model: pick another name, or import it as a "
                                  f"new version (--version {free})")
        return destination
    if isinstance(version, bool) or not is_version(str(version)) or int(version) < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}")
    if (destination / CONFIG_FILE).is_file():
        raise FileExistsError(f"{destination} holds a model outside a version folder: move its files into "
                              f"{destination / '1'} first, then import version {free}")
    if str(version) in found:
        raise FileExistsError(f"{destination / str(version)} already holds a model: import it as version {free}")
    return destination / str(version)


def _write(imported: graph.Imported, destination, version, dtype: str, answer, source: str,
           checked_against: str) -> ImportReport:
    """Write ``imported`` in ``dtype``, check it against ``answer`` and move it into place (its
    config last, so a server scanning the repository never sees half a model)."""
    directory = _target(Path(destination), version)
    model = imported.to_mlp(dtype, name=Path(destination).name)
    with tempfile.TemporaryDirectory(prefix="fusedserve-import-") as tmp:
        staged = save_model(model, Path(tmp) / "model")
        report = check(staged, answer, source, checked_against)
        report.path = str(directory)
        if not report.passed:
            raise UnsupportedModel(f"{report}\nnothing was written: the imported model does not answer as its "
                                   "source does" + ("; try dtype float32" if dtype != "float32" else ""))
        report.save(staged)
        directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(staged.iterdir(), key=lambda p: p.name == CONFIG_FILE):
            shutil.copy2(path, directory / path.name)
    return report


def from_onnx(source, destination, *, version: int | None = None, dtype: str | None = None) -> ImportReport:
    """Import an ONNX file (or ``onnx.ModelProto``) into model directory ``destination``
    (REPOSITORY/NAME; ``version``: its numbered version folder). ``dtype``: the weights' by default."""
    _require("onnx")
    onnxruntime = _require("onnxruntime")
    from fusedserve.models.importing import onnx_graph

    model = onnx_graph.load(source)
    reading = onnx_graph.read(model)
    layers, gaps = graph.chain(reading.ops, reading.source, reading.output)
    imported = graph.fold(layers, gaps, reading.tolerance, reading.labels)
    what = Path(source).name if isinstance(source, (str, Path)) else "model"
    return _write(imported, destination, version, dtype or reading.dtype, onnx_graph.answerer(model, reading),
                  f"ONNX {what} (opset {reading.opset})", f"onnxruntime {onnxruntime.__version__}")


def from_torch(source, destination, *, version: int | None = None, dtype: str | None = None, activations=None,
               output_activation: str = "none", allow_pickle: bool = False) -> ImportReport:
    """Import a PyTorch MLP: an ``nn.Sequential``, a module whose ``torch.export`` graph is a chain,
    an ``ExportedProgram``, a ``state_dict`` (with ``activations``: one name per hidden layer or one
    for all, and ``output_activation``), or a file of one (``.pt2``; ``.pt``/``.pth`` read with
    ``weights_only`` unless ``allow_pickle``). See ``from_onnx`` for the rest."""
    import torch
    from torch import nn

    from fusedserve.models.importing import torch_graph

    what, module = "object", None
    if isinstance(source, (str, Path)):
        what = Path(source).name
        source = torch_graph.load_file(Path(source), allow_pickle)
    if isinstance(source, nn.Module) and not isinstance(source, nn.Sequential):
        module, source = source, torch_graph.export(source)  # checked against the module itself
    if isinstance(source, nn.Sequential):
        ops, output = torch_graph.sequential_ops(source)
        program, inputs, kind = source, torch_graph.SOURCE, "nn.Sequential"
    elif isinstance(source, torch.export.ExportedProgram):
        ops, inputs, output = torch_graph.program_ops(source)
        program = module or source.module()
        kind = f"{type(module).__name__} (torch.export)" if module is not None else "torch.export program"
    elif isinstance(source, Mapping):
        ops, output = torch_graph.state_dict_ops(source, activations, output_activation)
        inputs, kind = torch_graph.SOURCE, "state_dict"
        program = None
    else:
        raise UnsupportedModel(f"{type(source).__name__} is not an nn.Module, a torch.export program or a state_dict")
    layers, gaps = graph.chain(ops, inputs, output)
    default = torch_graph.module_dtype(program) if program is not None else "float32"
    imported = graph.fold(layers, gaps, graph.MATCH_TOLERANCE[default])
    batch = torch_graph.fixed_batch(source) if isinstance(source, torch.export.ExportedProgram) else None
    answer = _torch_answer(program, ops, inputs, output, batch)
    return _write(imported, destination, version, dtype or default, answer, f"PyTorch {kind} ({what})",
                  f"torch {torch.__version__}")


def _torch_answer(program, ops, source: str, output: str, batch: int | None = None):
    """The source's answer to float32 rows: the module run in its own dtype, or for a state_dict the
    chain of its layers in float64 (there is no module to run)."""
    import torch

    from fusedserve.models.importing import torch_graph

    if program is None:
        run = graph.Gap(source, [op if op.fn is not None else graph.Op(op.where, op.inputs, op.output,
                                                                        fn=_linear(op)) for op in ops], output)
        return lambda x: run(torch.from_numpy(x).double()).numpy()
    parameter = next(iter(program.state_dict().values()))

    def answer(x):
        rows = torch.from_numpy(x).to(parameter.dtype)
        with torch.no_grad(), torch_graph.serving(program):
            if batch is None:
                return program(rows).double().numpy()
            # A program exported for a fixed batch takes only that many rows at once: padded chunks.
            padded = torch.cat([rows, rows.new_zeros(-len(rows) % batch, rows.shape[1])])
            return torch.cat([program(chunk) for chunk in padded.split(batch)])[:len(rows)].double().numpy()

    return answer


def _linear(op: graph.Op):
    import torch.nn.functional as F

    return lambda x: F.linear(x, op.weight, op.bias)


def from_sklearn(source, destination, *, version: int | None = None, dtype: str | None = None,
                 allow_pickle: bool = False) -> ImportReport:
    """Import a fitted ``MLPClassifier``/``MLPRegressor`` (alone or last in a ``Pipeline`` of scalers),
    or a pickle of one (read only if ``allow_pickle``). See ``from_onnx`` for the rest."""
    sklearn = _require("sklearn")
    from fusedserve.models.importing import sklearn_model, torch_graph

    what = "object"
    if isinstance(source, (str, Path)):
        path, what = Path(source), Path(source).name
        if not path.is_file():
            raise FileNotFoundError(f"scikit-learn file not found: {path}")
        if not allow_pickle:
            raise UnsupportedModel(f"{path} is a pickle; {torch_graph.PICKLE_HINT}, or convert the model "
                                   "to ONNX with skl2onnx")
        source = _require("joblib").load(path)
    ops, inputs, output, labels = sklearn_model.read(source)
    layers, gaps = graph.chain(ops, inputs, output)
    imported = graph.fold(layers, gaps, graph.MATCH_TOLERANCE["float32"], labels)
    return _write(imported, destination, version, dtype or "float32", sklearn_model.answer(source),
                  f"scikit-learn {type(sklearn_model._steps(source)[-1][1]).__name__} ({what})",
                  f"scikit-learn {sklearn.__version__}")


def import_file(source, destination, **options) -> ImportReport:
    """Import the file ``source`` with the reader its suffix names (``SUFFIXES``)."""
    path = Path(source)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise UnsupportedModel(f"{path.name}: import reads {', '.join(sorted(SUFFIXES))} files (ONNX, PyTorch, "
                               "scikit-learn pickles)")
    reader, allowed = {"onnx": (from_onnx, {"version", "dtype"}),
                       "sklearn": (from_sklearn, {"version", "dtype", "allow_pickle"}),
                       "torch": (from_torch, set(options))}[kind]
    given = {k: v for k, v in options.items() if v is not None and v is not False}
    if set(given) - allowed:
        raise ValueError(f"{', '.join(sorted(set(given) - allowed))} do not apply to a {path.suffix} file")
    return reader(path, destination, **given)


__all__ = ["ImportReport", "UnsupportedModel", "from_onnx", "from_sklearn", "from_torch", "import_file"]
